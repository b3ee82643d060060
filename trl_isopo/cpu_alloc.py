"""glibc malloc settings for training on CPU: keep freed memory in the process instead of handing it back to the OS.

PyTorch's CPU allocator takes every tensor from `posix_memalign` and frees it when the tensor dies. Stock glibc serves
each request above its mmap threshold (dynamic, at most 32 MiB on 64-bit) with a fresh `mmap` and unmaps it on free,
and gives the top of the heap back once more than the trim threshold of it is free. A training step's large temporaries
(logits, log-softmax, MLP activations, gradients, optimizer temporaries: tens to hundreds of MiB each) are so mapped,
faulted in 4 KiB at a time (each page zeroed by the kernel) and unmapped again at every step: millions of minor page
faults and a tenth of the process's CPU time in the kernel, with the `mmap`/`munmap` calls serialised on the address
space lock.

`keep_freed_memory` turns both off (`M_MMAP_MAX=0`: no request is mmapped, it comes from the heap; trim threshold
"never"), so the second step onwards reuses the first step's pages, as CUDA's caching allocator does on a GPU. The
process then holds on to its peak heap; fragmentation can add to it (measure `maxrss`). It only affects allocations
made after the call (memory mapped before stays mapped until freed), so call it once at startup, before the model is
loaded. `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<bytes>` in the environment of a fresh process does the same.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from dataclasses import dataclass

__all__ = ["MallocStats", "keep_freed_memory", "limit_arenas", "malloc_stats", "release_free_memory"]

# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8


def _glibc():
    """libc as a ctypes library when it is glibc (mallopt and its parameters are glibc's), else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


def keep_freed_memory(arena_max: int | None = None, only_cpu: bool = True) -> bool:
    """Tell glibc malloc to keep freed memory for reuse (no mmapped chunks, no trimming); True if it took effect.

    Args:
        arena_max: also cap the number of malloc arenas (`limit_arenas`); None leaves glibc's default.
        only_cpu: do nothing when CUDA is available (the training tensors then live in CUDA's caching allocator, and
            a host process that keeps its peak heap only costs memory).

    A no-op (False) where libc is not glibc (macOS, musl, Windows).
    """
    if only_cpu:
        import torch

        if torch.cuda.is_available():
            return False
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_MAX, 0))
    # mallopt's value is an int; -1 converts to SIZE_MAX, which glibc documents as "never trim".
    ok &= bool(libc.mallopt(_M_TRIM_THRESHOLD, -1))
    if arena_max is not None:
        ok &= limit_arenas(arena_max)
    return ok


def limit_arenas(arena_max: int) -> bool:
    """Cap glibc's malloc arenas (`M_ARENA_MAX`); True if it took effect. glibc gives threads their own arenas, each
    holding its own peak; 1 makes threads that allocate in turn (e.g. one trainer per thread) share one heap."""
    libc = _glibc()
    return libc is not None and bool(libc.mallopt(_M_ARENA_MAX, int(arena_max)))


def release_free_memory() -> bool:
    """Hand every free page of the heaps back to the OS now (`malloc_trim(0)`); True if glibc released any."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


@dataclass(frozen=True)
class MallocStats:
    """glibc's `mallinfo2` totals, in bytes."""

    heap: int  # bytes in the arenas' heaps (sbrk and per-thread heaps), used or free
    mmapped: int  # bytes in chunks mmapped on their own (unmapped again on free)
    in_use: int  # bytes allocated and not freed, heaps and mmapped chunks
    free: int  # free bytes held in the heaps


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def malloc_stats() -> MallocStats | None:
    """The process's glibc heap totals (`mallinfo2`, glibc >= 2.33), or None where unavailable."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return MallocStats(heap=info.arena, mmapped=info.hblkhd, in_use=info.uordblks + info.hblkhd, free=info.fordblks)
