"""`MicroBatch`: what one micro-batch's backward needs, passed to the backward object's window and bound into every
autograd Function call made inside it (so a backward never reads mutable state)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Same-size integer views of the operand dtypes, for the bitwise padding fill (`MicroBatch.zero_padding`).
_BITS = {
    torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16
}


@dataclass(frozen=True)
class MicroBatch:
    """What one micro-batch's backward needs, bound to each Function call at forward time (immutable).

    mask: (B, L) bool, valid (non-padding) positions of prompt + completion: a sequence's tokens T_i.
    advantages: (B,) per-sequence advantages A_i.
    seed: seeds the Fisher token samples of this micro-batch (one stream per layer).
    logits_to_keep: completion length C (the fused LM head scores the last C positions).
    stat_scale: (B,) or None: the loss normalizer n_i of each sequence, i.e. the backward seed of sequence i is
        -mask / n_i (bnpo: completion tokens x GA; see `SurrogateLossMixin._loss_normalizer`). The regularizer's
        statistics are multiplied by it (K by n_i n_k), so that they are those of the un-normalized per-sequence
        gradient -grad sum_t log pi: the reference point mu (an EMA over steps) is then comparable across steps
        whose token count, accumulation or loss_type differ. None = 1.
    step_sequences: N, the sequences of this process's optimizer step (B x gradient accumulation): the c = 0
        coefficients are multiplied by N^(p+q) (`layer.isopo_coefficients`). None = 1.
    """

    mask: torch.Tensor
    advantages: torch.Tensor
    seed: int = 0
    logits_to_keep: int = 0
    stat_scale: torch.Tensor | None = None
    step_sequences: float | None = None
    # Tensors derived from the fields (cast advantages, row masks), made by the first layer that needs them. Nothing
    # here reads a tensor on the host: the backward stays free of device-host synchronizations.
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    def _cached(self, key: tuple, make):
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def zero_padding(self, t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        """t (B, L, d) as a new contiguous `dt` tensor with its padding rows set to +0.

        A bitwise AND of the values' bits with a per-row mask of all ones (valid) or zeros (padding), not a product
        with the mask: padding rows may hold NaN, and valid rows keep their exact bits. Always a copy, from the
        mask alone: an index list of the padding rows (`nonzero`) or a "no padding" shortcut would read the mask on
        the host. On CPU it is faster than a copy with an index fill or a broadcast `masked_fill` (timings in
        docs/isopo.md, "Cost").
        """
        bits = _BITS[dt]
        keep = self._cached(  # (B, L, 1): -1 (every bit set) at valid positions, 0 at padding
            ("keep", bits, t.device), lambda: torch.where(self.mask.to(t.device), -1, 0).to(bits).unsqueeze(-1)
        )
        if t.dtype != dt:  # the cast copy is masked in place
            out = t.to(dt, memory_format=torch.contiguous_format)
            out.view(bits).bitwise_and_(keep)
            return out
        out = torch.empty(t.shape, dtype=dt, device=t.device)
        torch.bitwise_and(t.view(bits), keep, out=out.view(bits))
        return out

    def advantages_as(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The advantages (B,) in `dtype` on `device`."""
        return self._cached(("A", device, dtype), lambda: self.advantages.to(device=device, dtype=dtype))

    def stat_scale_as(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """`stat_scale` (B,) in `dtype` on `device`, or None."""
        if self.stat_scale is None:
            return None
        return self._cached(("n", device, dtype), lambda: self.stat_scale.to(device=device, dtype=dtype).reshape(-1))

    def positions(self, device: torch.device) -> torch.Tensor:
        """All B*L flat positions (B*L,): the exact Fisher estimate's "sample" (padding rows add exactly 0)."""
        return self._cached(("pos", device), lambda: torch.arange(self.mask.numel(), device=device))
