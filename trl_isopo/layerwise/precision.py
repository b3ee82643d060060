"""Precision policy of the per-layer statistics: their dtype, and which path bf16 / fp16 operands take.

X and G are float64, float32, or both bf16 / fp16 (the layer's own dtype). Every statistic and the materialized V is a
float32 sum of exact products (float64 for float64 operands, `stat_dtype`). Half operands enter the GEMMs as they are
where the device returns their products in float32 (`half_gemm_kernel`: CUDA, XPU), else (CPU) they are upcast once per
layer for the statistics (`keeps_half_operands`). The choice is made by device; `force_half` (a settings field, used by
tests) takes the half-operand path on a device without such GEMMs, where every product then upcasts its operands
(`matmul_f32`), which gives the same float32 sums.
"""

from __future__ import annotations

import functools

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the statistics, coefficients and GEMM accumulations for operands of `dtype`: float64 for float64,
    float32 for everything else (float32, bf16, fp16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=None)
def half_gemm_kernel(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch.mm` / `torch.bmm` accept `out_dtype=torch.float32` for `dtype` operands on this device type:
    bf16 / fp16 products accumulated and returned in float32 by the GEMM itself (CUDA and XPU kernels since torch
    2.8; torch 2.13 has none on CPU). Probed once per (device type, dtype)."""
    try:
        a = torch.ones(1, 1, dtype=dtype, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
        torch.bmm(a[None], a[None], out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # NotImplementedError is a RuntimeError
        return False
    return True


def keeps_half_operands(dtype: torch.dtype, device: torch.device, force_half: bool = False) -> bool:
    """Whether half X and G of `dtype` enter the statistics' GEMMs as they are: where the device multiplies them
    into float32 (`half_gemm_kernel`; ~15x the float32 GEMM rate on recent GPUs). Otherwise (CPU) they are upcast
    once per layer; the upcast is exact (every bf16 / fp16 value is a float32 value), so both give float32-accumulated
    products of the same operands. `force_half`: keep them on any device (tests: the GPU's path on a CPU)."""
    return dtype in HALF_DTYPES and (force_half or half_gemm_kernel(device.type, dtype))

def matmul_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b for (m, k) @ (k, n), (B, m, k) @ (B, k, n) or (B, m, k) @ (k, n), optionally into `out`.

    bf16 / fp16 operands (both of one dtype) give a float32 result accumulated in float32: the device's
    `out_dtype=torch.float32` GEMM, else (CPU) the float32 GEMM of the exactly upcast operands. Not a half GEMM
    followed by `.float()`: that rounds every product sum to ~3 significant digits. Other dtypes: plain `a @ b`.
    """
    if a.dtype not in HALF_DTYPES:
        if a.dim() == 3 and b.dim() == 3:
            return torch.bmm(a, b, out=out)
        return a @ b if out is None else torch.mm(a, b, out=out)
    if a.dim() == 3 and b.dim() == 2:  # fold the batch into the rows, as `matmul` does
        flat = None if out is None else out.view(-1, b.shape[-1])
        return matmul_f32(a.reshape(-1, a.shape[-1]), b, flat).view(*a.shape[:2], b.shape[-1])
    op = torch.bmm if a.dim() == 3 else torch.mm
    kw = {} if out is None else {"out": out}
    if half_gemm_kernel(a.device.type, a.dtype):
        return op(a, b, out_dtype=torch.float32, **kw)
    return op(a.float(), b.float(), **kw)

