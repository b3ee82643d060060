"""The installed backward's hook into TRL's fused LM-head log-prob kernel.

Why a process-wide kernel is replaced: TRL's fused head forward looks its kernel up at every call and reads
`lm_head.weight` inside it, so the head's weight gradient cannot be reached through the head module
(`compat.logprob_kernel`). `FusedHeadInterception` is that kernel while a backward
object is installed (`engine.LayerBackward.install(..., head_mode=...)`), and is removed with it. It is a
pass-through to the kernel it replaced for every call that is not inside its owner's micro-batch window with
gradients on a trainable head (reference-model and no-grad forwards, other trainers' windows); inside, it runs
`kernel.RowScaledChunkedLogProb` with the window's row scale:

- "advantage_weighted": each token row of the head's weight gradient scaled by its sequence's advantage A_i;
- "method": the owner's `head_provider(name, mb)` (ISOPO: `isopo.ISOPOHead`, the head's own ISOPO coefficients).

The owner is held weakly: several trainers in one process stack their interceptions, and a dropped trainer's becomes
a pass-through instead of keeping its model alive.
"""

from __future__ import annotations

import weakref

import torch

from ... import compat
from .kernel import RowScaledChunkedLogProb
from .rows import head_row_values

HEAD_MODES = ("advantage_weighted", "method")


class RowValues:
    """Row-scale provider holding per-row values (N,) fixed at forward time; None (unscaled) in `owner`'s plain mode."""

    def __init__(self, owner, values: torch.Tensor):
        self.owner, self.values = owner, values

    def __call__(self, *saved) -> torch.Tensor | None:
        return None if self.owner.plain_active else self.values


class FusedHeadInterception:
    """Stand-in for TRL's fused head kernel (TRL only calls `.apply`); see the module docstring."""

    def __init__(self, owner, mode: str, name: str = "lm_head"):
        if mode not in HEAD_MODES:
            raise ValueError(f"head mode must be one of {HEAD_MODES}, got {mode!r}")
        self._owner = weakref.ref(owner)
        self.mode, self.name = mode, name
        self.original = None  # the kernel this one replaced (set by `install`)

    def install(self) -> None:
        self.original = compat.logprob_kernel()
        compat.set_logprob_kernel(self)

    def remove(self) -> None:
        """Restore the replaced kernel if this is still the installed one; else (a later interception sits on top)
        stay in the chain as a pass-through."""
        if compat.logprob_kernel() is self:
            compat.set_logprob_kernel(self.original)
        self._owner = lambda: None

    def apply(self, hidden, weight, bias, targets, *rest):
        owner = self._owner()
        mb = None if owner is None else owner.current
        trainable = weight.requires_grad or (bias is not None and bias.requires_grad)
        if mb is None or not trainable or not torch.is_grad_enabled():
            return self.original.apply(hidden, weight, bias, targets, *rest)
        if self.mode == "method":
            scale = owner.head_provider(self.name, mb)
        else:
            values = head_row_values(hidden.shape[0], mb, mb.advantages).to(device=hidden.device, dtype=torch.float32)
            scale = RowValues(owner, values)
        return RowScaledChunkedLogProb.apply(hidden, weight, bias, targets, scale, *rest)
