"""A pool of reusable storage for the large per-layer temporaries of one backward pass."""

from __future__ import annotations

import math

import torch


class Scratch:
    """Reusable storage for the large per-layer temporaries (materialized V, Fisher sample rows) of one backward pass.

    Every layer of a model asks for buffers of the same few shapes. On CPU each fresh allocation above glibc's mmap
    threshold comes from new pages, and faulting them in costs a sizeable part of the GEMM that fills them (timings
    in docs/isopo.md, "Cost"), so layers share one buffer per slot. The owner drops it (`clear`) when the backward
    pass ends.
    """

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._buffers[slot] = buf
        return buf[:n].view(shape)

    def clear(self) -> None:
        self._buffers.clear()

