"""The per-layer protocol's types: a method's name (`MethodName`), what its rule receives for one covered linear
layer's backward in one micro-batch (`LayerCall`) and what it returns (`LayerGrads`).

A rule is a `LayerBackward` subclass (`engine.py`) that implements `grads(call: LayerCall) -> LayerGrads`; the
engine calls it inside the one backward pass, once per covered layer and micro-batch, and puts what it returns in
the layer's `.grad` as an ordinary gradient. ISOPO (`trl_isopo/isopo/isopo_backward.py`) and PROMA
(`trl_isopo/proma/backward.py`) are such rules; docs/layerwise.md documents the protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .inputs import SharedInput
from .micro_batch import MicroBatch


@dataclass(frozen=True)
class MethodName:
    """A method's name as the engine prints it: `title` in messages ("ISOPO"), `prefix` in its config fields
    (`isopo_lm_head`), coverage keys (`isopo_layers`) and logged metrics (`isopo/scale_mean`)."""

    title: str
    prefix: str

    def field(self, name: str) -> str:
        """The method's config field or coverage key `name`: "lm_head" -> "isopo_lm_head"."""
        return f"{self.prefix}_{name}"

    def metric(self, name: str) -> str:
        """The logged metric `name`: "scale_mean" -> "isopo/scale_mean"."""
        return f"{self.prefix}/{name}"


@dataclass(frozen=True)
class LayerCall:
    """One covered layer's backward in one micro-batch.

    name, index: the module's name and its stable index among the covered layers (seeds, state keys).
    X: (B, L, d_in) the layer's input; G: (B, L, d_out) the gradient of the advantage-free surrogate
        -sum_i sum_t m_it log pi_it / n_i at the layer's output. Row i is sequence i: token (i, t) belongs to
        sequence i, so sequence i's own weight gradient is V_i = G_i^T X_i (d_out, d_in), and the ordinary one is
        sum_i V_i. The padding rows of one of X and G are zero (the other's are finite), so a product summed over
        tokens drops them. Both are in the operand dtype: `dtype`, or bf16 / fp16 for half inputs.
    dtype: the dtype to compute and return in (float32; float64 for float64 inputs).
    mb: the micro-batch: `mask` (B, L) bool valid positions, `advantages` (B,) A_i, `stat_scale` (B,) n_i,
        `seed`, `step_sequences`; a method's `MicroBatch` subclass adds its place in the optimizer step (PROMA's
        `index`, `active`). Immutable; `mb.advantages_as(dtype, device)` gives A_i cast once per micro-batch.
    has_bias: whether the layer has a trainable bias (then `LayerGrads.bias` is its gradient).
    shared_input: the entry of the layer's input tensor in this micro-batch (`inputs.SharedInput`), common to every
        covered layer that reads the same input (q/k/v, gate/up): `shared_input.statistic(key, compute)` computes an
        input-only statistic once for all of them. None where no engine made the call (direct calls, tests).
    """

    name: str
    index: int
    X: torch.Tensor
    G: torch.Tensor
    dtype: torch.dtype
    mb: MicroBatch
    has_bias: bool
    shared_input: SharedInput | None = None

    @property
    def mask(self) -> torch.Tensor:
        """(B, L) bool: valid (non-padding) positions."""
        return self.mb.mask

    @property
    def advantages(self) -> torch.Tensor:
        """(B,) A_i in `dtype` on X's device."""
        return self.mb.advantages_as(self.dtype, self.X.device)


class LayerGrads(NamedTuple):
    """What a rule returns for one `LayerCall`: the layer's weight gradient (d_out, d_in) and bias gradient (d_out,)
    or None, in `call.dtype` (the engine casts them to the parameters' dtype)."""

    weight: torch.Tensor
    bias: torch.Tensor | None
