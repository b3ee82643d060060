"""ISOPO's backward object: `ISOPOBackward`, the `layerwise.engine.LayerBackward` whose per-layer gradient is ISOPO's.

Its state, each in its own object: `settings` (frozen `ISOPOSettings`), `ema` (`ema.EMAStatistics`, the regularizer's
reference points), `metrics` (`metrics.StepMetrics`, the step's records), `sampler` (`sampling.FisherSampler`, the
Fisher token sample's generators); and from the base, `inputs` (the masked-input cache), `scratch` (the buffer pool),
`calls` (call tracking). The math of one layer call is `layer.isopo_linear_grad`; here only the state around it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..layerwise.engine import LayerBackward
from ..layerwise.micro_batch import MicroBatch
from ..layerwise.rule import LayerCall, LayerGrads, MethodName
from .ema import EMAStatistics
from .head import ISOPOHead
from .layer import isopo_linear_grad, reference_point
from .metrics import StepMetrics
from .reweight import REG_REFERENCES

# The stored EMA values a layer call may read (`layer.isopo_linear_grad`'s `history`).
_HISTORY_KEYS = ("e", "f", "rho", "ntk", "e@median", "f@median", "rho@median")


@dataclass(frozen=True)
class ISOPOSettings:
    """The math knobs (see `ISOPOConfig` for their documentation). No defaults: a config is the one place that
    has them, and `ISOPOConfig.isopo_settings` builds these from it."""

    p: float
    q: float
    r: float
    reg: float
    reg_reference: str
    ema_decay: float
    fisher_tokens: int
    interacting: bool
    interacting_reg: float
    route: str
    budget_bytes: int
    seed: int
    # Keep bf16 / fp16 operands for the statistics where the device has no float32-output half GEMM (CPU): the GPU's
    # path, for tests (`precision.keeps_half_operands`). False: by device.
    force_half_operands: bool

    def __post_init__(self):
        if self.reg_reference not in REG_REFERENCES:
            raise ValueError(f"reg_reference must be one of {REG_REFERENCES}, got {self.reg_reference!r}")

    @property
    def needs_fisher(self) -> bool:
        return not self.interacting and (self.p != 0 or self.r != 0)

    @property
    def needs_euclidean(self) -> bool:
        """Whether e_i is computed: the math needs it (q, r, interacting: free as diag K), or no other statistic is.

        Not for p alone (the default): on wide layers (Gram route) e^2 would add ~0.6x the Fisher numerator's work.
        """
        return self.interacting or self.q != 0 or self.r != 0 or not self.needs_fisher


ISOPO = MethodName(title="ISOPO", prefix="isopo")


class ISOPOBackward(LayerBackward):
    """ISOPO's per-layer backward (see the module docstring). `weight_override`: a test hook, (name, A) -> (B,)
    coefficients used instead of the computed ones (e.g. all ones: plain autograd)."""

    def __init__(self, settings: ISOPOSettings, ema: EMAStatistics | None = None):
        super().__init__(ISOPO)
        self.settings = settings
        self.ema = EMAStatistics(settings.ema_decay) if ema is None else ema
        self.metrics = StepMetrics()
        self.sampler = FisherSampler()
        self.weight_override = None

    @property
    def records(self) -> list[torch.Tensor]:
        """This step's (6, B) metrics records (`metrics.StepMetrics`)."""
        return self.metrics.records

    @property
    def lambdas(self) -> list:
        """This step's interacting lambdas (`metrics.StepMetrics`)."""
        return self.metrics.lambdas

    def fisher_sample(self, name: str, mb: MicroBatch, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Layer `name`'s Fisher token sample (S,) for `mb` (`sampling.FisherSampler.draw`; `mask`: another pool)."""
        index = self.layer_index.get(name, len(self.layer_index))  # a module outside the covered layers: its own
        return self.sampler.draw(name, index, self.settings.fisher_tokens, mb, mask)

    def shared_fisher_sample(self, call: LayerCall) -> torch.Tensor:
        """The Fisher sample of a layer call: one per distinct input and micro-batch, drawn by the first covered layer
        to read that input in the backward pass (its own seed) and used by every later one (q/k/v; gate/up), so that
        their input products X a_J^T are made once (`statistics.gram_input_statistics`, with the e^2 blocks). Each
        layer's J is still a uniform sample of the micro-batch's valid positions, independent of its data; only the
        joint law across the layers reading one input changes (docs/isopo.md, "Shared input statistics"). A test's
        fixed samples (`sampler.override`) stay per layer."""
        draw = functools.partial(self.fisher_sample, call.name, call.mb)
        if call.shared_input is None or self.sampler.override is not None:
            return draw()
        return call.shared_input.statistic(("isopo_fisher_sample", self.settings.fisher_tokens), draw)

    def grads(self, call: LayerCall) -> LayerGrads:
        """ISOPO's weight (and bias) gradient of one covered layer in one micro-batch (`layer.isopo_linear_grad`)."""
        s, name, mb, X, dt = self.settings, call.name, call.mb, call.X, call.dtype
        A = call.advantages
        sample = self.shared_fisher_sample(call) if s.needs_fisher else None
        # Few, small tensor ops per layer call (each is a kernel launch on a GPU, ~3 us of dispatch on a CPU): metrics
        # and EMA sums are reduced once per step (`step_metrics`, `EMAStatistics.end_step`), the stored EMA values
        # are read as Python floats.
        override = None if self.weight_override is None else self.weight_override(name, A)
        out = isopo_linear_grad(
            X, call.G, mb.mask, A, s, sample=sample, stat_scale=mb.stat_scale_as(dt, X.device),
            history=self.history(name), coefficients=override, has_bias=call.has_bias, scratch=self.scratch,
            step_sequences=mb.step_sequences, shared_input=call.shared_input,
        )  # fmt: skip
        self.keep(name, out.record, out.ema, out.lam)
        return LayerGrads(out.grad_weight, out.grad_bias)

    def head_provider(self, name: str, mb: MicroBatch) -> ISOPOHead:
        return ISOPOHead(self, name, mb)

    def history(self, name: str) -> dict[str, float]:
        """The stored EMA values of module `name` by statistic (those that exist)."""
        found = {k: self.ema.ema.get(f"{name}/{k}") for k in _HISTORY_KEYS}
        return {k: v for k, v in found.items() if v is not None}

    def keep(self, name: str, record: torch.Tensor, ema: list, lam) -> None:
        """Fold one module call's EMA entries and keep its metrics record (and lambda) for the step."""
        for key, values, weights in ema:
            self.ema.accumulate(name, key, values, weights)
        self.metrics.keep(record, lam)

    def reference_point(self, name: str, stat: str, x2: torch.Tensor) -> torch.Tensor | float:
        """mu for statistic `stat` of layer `name` from this micro-batch's x^2 (B,) under `isopo_reg_reference`
        (`layer.reference_point`), folding this micro-batch's values into the EMA as a layer call does."""
        prefix = f"{name}/{stat}"
        mu, entries = reference_point(
            self.settings.reg_reference, x2, self.ema.ema.get(prefix), self.ema.ema.get(prefix + "@median")
        )
        for suffix, values, weights in entries:
            self.ema.accumulate(name, stat + suffix, values, weights)
        return mu

    def step_metrics(self) -> dict[str, tuple[float, float]]:
        """{metric: (sum over layer calls, number of layer calls)} of this step's records; clears them
        (`metrics.StepMetrics.reduce`)."""
        return self.metrics.reduce(self.settings)


# ------------------------------------------------------------------------------------------------------------------
# The Fisher token sample J: which positions of a micro-batch the Fisher norm estimate reads, per layer.


def fisher_token_sample(mask: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """A Fisher token sample of fixed size min(k, B*L) for mask (B, L) bool: flat indices (S,) into B*L.

    Its valid positions are a uniform sample without replacement of min(k, N_valid) of the N_valid valid positions
    (the k smallest of i.i.d. uniform keys, padding keyed +inf); when N_valid < k, the remaining picks are padding
    positions, whose zeroed operand row adds exactly 0 to the Fisher numerator and denominator. So the estimate has
    the distribution of a sample of the valid positions alone, while nothing reads N_valid on the host. float64
    keys: ties (whose order `topk` may break unevenly) have probability ~(B L)^2 / 2^53.
    """
    keys = torch.rand(mask.numel(), generator=generator, device=mask.device, dtype=torch.float64)
    keys.masked_fill_(~mask.reshape(-1), torch.inf)
    return keys.topk(min(k, keys.numel()), largest=False, sorted=False).indices


class FisherSampler:
    """Draws `fisher_token_sample`s from one generator per device, re-seeded per (micro-batch seed, layer index).

    `override`: {layer name: (S,) indices} used instead of drawing (tests: a fixed sample per layer), or None.
    """

    def __init__(self):
        self._generators: dict[torch.device, torch.Generator] = {}
        self.override: dict[str, torch.Tensor] | None = None

    def draw(self, name: str, index: int, k: int, mb: MicroBatch, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Flat indices (S,) into B*L of J, drawn on the mask's device (`fisher_token_sample`): uniform without
        replacement among the valid positions, |J| = min(k, N_valid), padded with padding positions to the fixed
        size S = min(k, B*L); all B*L positions (the exact estimate) for k <= 0 or k >= B*L.

        Fresh per layer and micro-batch, from a generator on the data's device seeded by (micro-batch seed, layer
        `index`): reproducible for a given seed and device type, independent of the global RNG, and no host-device
        copy. (CPU and CUDA generators give different, equally distributed, samples for one seed.)
        `mask`: another (B, L') pool than the micro-batch's positions (the LM head's scored positions).
        """
        if self.override is not None:
            return self.override[name].to(mb.mask.device)
        pool = mb.mask if mask is None else mask
        device = pool.device
        if k <= 0 or k >= pool.numel():
            return mb.positions(device) if mask is None else torch.arange(pool.numel(), device=device)
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        gen.manual_seed((mb.seed * 1_000_003 + 7919 * index) % (2**63))
        return fisher_token_sample(pool, k, gen)
