"""EMA of per-layer batch statistics, with the reference's fixed (non-cumulative) semantics (`isopo-spec.md` §2.2).

For each (layer, statistic) the regularizer uses mu = EMA over *previous* optimizer steps of the step's mean of x^2.
Before any history exists, each sequence is regularized by its own x^2. At the end of every optimizer step the values
accumulated during that step (over all micro-batches and, after an all-reduce, all processes) are averaged into
`cur`; then `ema = cur` the first time, else `decay * ema + (1 - decay) * cur`; the accumulators are cleared.

Deviation from the reference (documented in docs/isopo.md): a step mean that is zero or not finite carries no
scale information (all-zero gradients, e.g. PEFT's lora_A while lora_B = 0, or an overflow), so it is not folded:
folding a 0 would make R(x) = sqrt(x^2 / 1e-8 + 1) on the next step (and lam = 0, i.e. a zero gradient, in the
interacting variant); folding inf / NaN would poison the EMA for good. Skipped folds are counted in `skipped`.
"""

from __future__ import annotations

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
        self._pending: list[tuple[str, torch.Tensor]] = []
        self.skipped = 0

    @staticmethod
    def key(layer: str, stat: str) -> str:
        return f"{layer}/{stat}"

    def mu(self, layer: str, stat: str, current: torch.Tensor) -> torch.Tensor | float:
        """The stored EMA, or the current per-sequence values `current` (B,) if this key has no history yet."""
        value = self.ema.get(self.key(layer, stat))
        return current if value is None else value

    def accumulate(self, layer: str, stat: str, values: torch.Tensor) -> None:
        """Add the (B,) values of one micro-batch (x^2 per sequence, or one value per micro-batch)."""
        self._pending.append((self.key(layer, stat), values.detach().reshape(-1)))

    def step_sums(self) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """(sorted keys, float64 sums, float64 counts) of this step's accumulated values, one segment sum for all."""
        keys = sorted({k for k, _ in self._pending})
        if not keys:
            return [], torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
        slot = {k: i for i, k in enumerate(keys)}
        slots = torch.tensor([slot[k] for k, _ in self._pending])
        sizes = torch.tensor([v.numel() for _, v in self._pending], dtype=torch.float64)
        values = torch.cat([v for _, v in self._pending]).to("cpu", torch.float64)
        sums = torch.zeros(len(keys), dtype=torch.float64).index_add_(
            0, torch.repeat_interleave(slots, sizes.long()), values
        )
        counts = torch.zeros(len(keys), dtype=torch.float64).index_add_(0, slots, sizes)
        return keys, sums, counts

    def discard_step(self) -> None:
        """Drop this step's accumulated values without folding them."""
        self._pending.clear()

    def end_step(self, all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, world_size: int = 1) -> None:
        """Fold this step's means into the EMA. `all_reduce` sums a float64 tensor over the `world_size` processes
        (same key order on every rank: keys are sorted; their number is reduced too and checked)."""
        keys, sums, counts = self.step_sums()
        sums = torch.cat([sums, torch.tensor([float(len(keys))], dtype=torch.float64)])
        if all_reduce is not None:
            both = all_reduce(torch.cat([sums, counts]))
            n = len(keys)
            if both[n].item() != world_size * n:
                raise RuntimeError("ISOPO statistics differ in layers across processes; cannot average them")
            sums, counts = both[:n], both[n + 1 :]
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
