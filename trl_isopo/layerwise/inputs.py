"""What depends only on a covered layer's input, computed once for all the layers that read the same input tensor.

In Llama / Qwen blocks q/k/v read one input and gate/up another; LoRA's A matrices on those layers read it too (with
`lora_dropout=0`). `InputCache` keeps one `SharedInput` per distinct input tensor and micro-batch: the masked, cast
copy of the input (`masked`) and the input-only statistics a rule asks for (`SharedInput.statistic`), e.g. PROMA's
input range finder. What a statistic depends on besides the input and the micro-batch (sizes, dtype, a random draw's
owner) is the rule's part of the key.

An input is recognized by its storage address, version, shape, strides, dtype and device, with the micro-batch's
identity. The entry keeps the input tensor alive: a freed input's address may be reused at once by another layer's
input (one recomputed by gradient checkpointing, with a fresh version counter), which must not hit a stale entry.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch

from .micro_batch import MicroBatch

# Entries kept: LoRA's backward alternates a B matrix (its own input) and an A matrix (the shared one), v_B v_A k_B
# k_A q_B q_A, so the shared entry must survive one other in between. Older entries are dropped (and their inputs
# freed) as new ones arrive.
ENTRIES = 2


class SharedInput:
    """One distinct layer input x (B, L, d) in one micro-batch: its masked copies by dtype and its statistics."""

    __slots__ = ("x", "mb", "masked", "statistics")

    def __init__(self, x: torch.Tensor, mb: MicroBatch):
        self.x, self.mb = x, mb
        self.masked: dict[torch.dtype, torch.Tensor] = {}
        self.statistics: dict[tuple, object] = {}

    def statistic(self, key: tuple, compute: Callable[[], object]) -> object:
        """The statistic named `key` of this input: `compute()` at the first layer that asks, the same object for
        every later one. `key` must hold everything the value depends on besides the input and the micro-batch."""
        if key not in self.statistics:
            self.statistics[key] = compute()
        return self.statistics[key]

    def masked_as(self, dt: torch.dtype) -> torch.Tensor:
        """x as `dt` with padding rows zeroed (`MicroBatch.zero_padding`), made once per dtype."""
        X = self.masked.get(dt)
        if X is None:
            X = self.masked[dt] = self.mb.zero_padding(self.x, dt)
        return X

    def peek(self, key: tuple) -> object | None:
        """The statistic named `key` if a layer already computed it, else None (nothing is computed)."""
        return self.statistics.get(key)


class InputCache:
    """The `ENTRIES` most recent distinct layer inputs of the open micro-batch (module docstring)."""

    def __init__(self, entries: int = ENTRIES):
        self.entries = entries
        self._entries: OrderedDict[tuple, SharedInput] = OrderedDict()

    def entry(self, x: torch.Tensor, mb: MicroBatch) -> SharedInput:
        """The entry of input x in micro-batch `mb` (a new one if x was not seen among the recent inputs)."""
        key = (x.data_ptr(), x._version, tuple(x.shape), x.stride(), x.dtype, x.device, id(mb))
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit
        for older in self._entries.values():  # one activation-sized masked copy at a time, as before sharing
            older.masked.clear()
        new = self._entries[key] = SharedInput(x, mb)
        while len(self._entries) > self.entries:
            self._entries.popitem(last=False)
        return new

    def masked(self, x: torch.Tensor, mb: MicroBatch, dt: torch.dtype) -> torch.Tensor:
        """x as `dt` with padding rows zeroed (`MicroBatch.zero_padding`), one copy per input."""
        return self.entry(x, mb).masked_as(dt)

    def clear(self) -> None:
        self._entries.clear()
