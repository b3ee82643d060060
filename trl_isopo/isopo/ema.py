"""EMA of per-layer batch statistics, with the reference's fixed (non-cumulative) semantics: the regularization
reg_l of paper arXiv 2512.23353, §2.0.1 (docs/isopo.md, "Reference point of the regularizer").

For each (layer, statistic) the regularizer uses mu = EMA over *previous* optimizer steps of the step's mean of x^2
(`isopo_reg_reference="ema_mean"`; with "ema_median" the per-micro-batch medians of x^2 are averaged instead, under
their own keys "<stat>@median").
Before any history exists, each sequence is regularized by its own x^2. At the end of every optimizer step the values
accumulated during that step (over all micro-batches and, after an all-reduce, all processes) are averaged into
`cur`; then `ema = cur` the first time, else `decay * ema + (1 - decay) * cur`; the accumulators are cleared.

Deviation from the reference (documented in docs/isopo.md): a step mean that is zero or not finite carries no
scale information (all-zero gradients, e.g. PEFT's lora_A while lora_B = 0, or an overflow), so it is not folded:
folding a 0 would make mu = 0 on the next step (every nonzero x would then get R = inf, i.e. coefficient 0; the
reference's absolute guard made it R(x) = sqrt(x^2 / 1e-8 + 1)); folding inf / NaN would poison the EMA for good.
Skipped folds are counted in `skipped`. Entries with weight 0 (`accumulate`) are left out of the step mean.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch


class EMAStatistics:
    """Per-(layer, statistic) EMA state. Values are Python floats (float64), so checkpoints round-trip exactly."""

    def __init__(self, decay: float = 0.9):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay = decay
        self.ema: dict[str, float] = {}
        # This step's values, reduced once in `end_step`: the backward only appends (no tensor ops, no host sync).
        self._pending: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
        self.skipped = 0

    @staticmethod
    def key(layer: str, stat: str) -> str:
        return f"{layer}/{stat}"

    def mu(self, layer: str, stat: str, current: torch.Tensor) -> torch.Tensor | float:
        """The stored EMA, or the current per-sequence values `current` (B,) if this key has no history yet."""
        value = self.ema.get(self.key(layer, stat))
        return current if value is None else value

    def accumulate(self, layer: str, stat: str, values: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Add the (B,) values of one micro-batch (x^2 per sequence, or one value per micro-batch).

        `weights` (same shape, 0 or 1; default all 1) leave entries out of the step mean without a host sync, e.g. the
        median of a micro-batch whose every x is 0 (NaN, passed as value 0 with weight 0).
        """
        values = values.detach().reshape(-1)
        self._pending.append((self.key(layer, stat), values, None if weights is None else weights.detach().reshape(-1)))

    def step_sums(self) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """(sorted keys, float64 sums, float64 counts) of this step's accumulated values, one segment sum for all."""
        keys = sorted({k for k, _, _ in self._pending})
        if not keys:
            return [], torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
        slot = {k: i for i, k in enumerate(keys)}
        sizes = torch.tensor([v.numel() for _, v, _ in self._pending])
        slots = torch.repeat_interleave(torch.tensor([slot[k] for k, _, _ in self._pending]), sizes)
        # One device-to-host copy for all values and weights (each copy is a host sync on accelerators).
        both = torch.cat(
            [torch.stack([v.double(), torch.ones_like(v, dtype=torch.float64) if w is None else w.double()]) for _, v, w in self._pending],
            dim=1,
        ).cpu()
        values, weights = both[0], both[1]
        sums = torch.zeros(len(keys), dtype=torch.float64).index_add_(0, slots, values * weights)
        counts = torch.zeros(len(keys), dtype=torch.float64).index_add_(0, slots, weights)
        return keys, sums, counts

    def discard_step(self) -> None:
        """Drop this step's accumulated values without folding them."""
        self._pending.clear()

    def end_step(self, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, world_size: int = 1) -> None:
        """Fold this step's means into the EMA. `all_reduce` sums a float64 tensor over the `world_size` processes
        (same key order on every rank: keys are sorted; their number is reduced too and checked)."""
        keys, sums, counts = self.step_sums()
        if all_reduce is not None:
            # The key lists must agree before the sums are reduced (tensors of different lengths would hang or
            # fail the collective): a fixed-size check first. Equal sums of h and h^2 over the ranks mean equal h;
            # a 20-bit h keeps every sum exact in float64 for up to 2^12 processes.
            h = float(int.from_bytes(hashlib.sha256("\n".join(keys).encode()).digest()[:4], "big") % (1 << 20))
            n = float(len(keys))
            probe = all_reduce(torch.tensor([n, h, h * h], dtype=torch.float64)).tolist()
            if probe != [world_size * n, world_size * h, world_size * h * h]:
                raise RuntimeError(
                    "ISOPO statistics differ in layers across processes (each process must cover the same layers "
                    "with the same settings); cannot average them"
                )
            both = all_reduce(torch.cat([sums, counts]))
            sums, counts = both[: len(keys)], both[len(keys) :]
        for k, s, n in zip(keys, sums.tolist(), counts.tolist()):
            if n <= 0:
                continue
            cur = s / n
            if not math.isfinite(cur) or cur <= 0.0:
                self.skipped += 1
                continue
            old = self.ema.get(k)
            self.ema[k] = cur if old is None else self.decay * old + (1.0 - self.decay) * cur
        self._pending.clear()

    def state_dict(self) -> dict:
        return {"decay": self.decay, "ema": dict(self.ema)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the EMA values; the decay stays the configured one (a resumed run may change it on purpose)."""
        self.ema = {str(k): float(v) for k, v in state["ema"].items()}
        self._pending.clear()
