"""The final GEMM of a covered layer: its weight and bias gradients as the coefficient-weighted sum over sequences."""

from __future__ import annotations

import torch

from .precision import keeps_half_operands, matmul_f32, stat_dtype
from .scratch import Scratch
from .statistics import SequenceStats


def reweighted_weight_grad(
    X: torch.Tensor,
    G: torch.Tensor,
    w: torch.Tensor,
    stats: SequenceStats | None = None,
    force_half: bool = False,
    bias: bool = True,
    scratch: Scratch | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(sum_i w_i V_i, sum_i w_i b_i): the layer's weight and bias gradients, shapes (d_out, d_in), (d_out,) or None,
    in `stat_dtype(X.dtype)`. w: (B,).

    Uses the materialized V when the "mat" route kept it (B d_in d_out MACs), else one GEMM of the row-scaled output
    gradients, (w_seq(t) g_t)^T a_t, in place of autograd's weight-gradient GEMM. Without `stats` the bias gradient
    is summed over all positions (G must then be the masked operand) unless `bias` is False (a pass over G saved).
    `force_half`: as in `precision.py`. `scratch`: storage for the row-scaled operand, so that the covered layers
    of one backward reuse one buffer (a fresh activation-sized tensor per layer faults its pages in on CPU).
    """
    sdt = stat_dtype(X.dtype)
    w = w.to(sdt)
    if stats is not None and stats.V is not None:
        B, d_out, d_in = stats.V.shape
        if stats.V.is_contiguous():
            gw = (w @ stats.V.view(B, -1)).view(d_out, d_in)  # one pass over V
        else:  # V stored transposed (`materialized_statistics`): the (d_in, d_out) sum, then one d_out x d_in copy
            gw = (w @ stats.V.transpose(1, 2).reshape(B, -1)).view(d_in, d_out).T.contiguous()
    elif X.dtype == torch.bfloat16 or keeps_half_operands(X.dtype, X.device, force_half):
        gw = _half_reweighted_gemm(X, G, w, force_half)
    else:  # float32 / float64, or fp16 without a float32-output half GEMM (CPU): float32 GEMM of upcast operands
        X, G = X.to(sdt), G.to(sdt)
        narrow = G if G.shape[-1] <= X.shape[-1] else X  # scale the narrower operand's rows by w_s(t)
        out = None if scratch is None else scratch.get("scaled", tuple(narrow.shape), sdt, narrow.device)
        scaled = torch.mul(narrow, w.view(-1, 1, 1), out=out).reshape(-1, narrow.shape[-1])
        if narrow is G:
            gw = scaled.T @ X.reshape(-1, X.shape[-1])
        else:
            gw = G.reshape(-1, G.shape[-1]).T @ scaled
    if stats is not None:  # the bias gradient only when the statistics were asked for it (no extra pass over G)
        gb = None if stats.bias_per_seq is None else w @ stats.bias_per_seq
    elif bias:
        gb = (G.to(sdt) * w.view(-1, 1, 1)).sum((0, 1))
    else:
        gb = None
    return gw, gb


def _half_reweighted_gemm(X: torch.Tensor, G: torch.Tensor, w: torch.Tensor, force_half: bool) -> torch.Tensor:
    """sum_t w_s(t) g_t a_t^T (d_out, d_in) float32 for half X (B, L, d_in), G (B, L, d_out) and float32 w (B,).

    The narrower operand's rows are scaled in float32 and rounded once to the half dtype (the GEMM needs one dtype),
    by w / max|w|, multiplied back on the float32 result: fp16 cannot overflow (|scaled row| <= |row|), and the
    sequences with the largest coefficients keep the operand's full precision. The GEMM accumulates in float32; where
    the device has no float32 output for it (CPU) its result is rounded once to the half dtype, as autograd's own
    weight gradient of a half layer is (and as the gradient is anyway when stored in a half parameter's .grad).
    """
    top = w.abs().amax()
    top = torch.where(top > 0, top, 1.0)
    wn = (w / top).view(-1, 1, 1)
    # Without a float32-output half GEMM only bf16 comes here (float32's range: its half output cannot overflow)
    mm = matmul_f32 if keeps_half_operands(X.dtype, X.device, force_half) else _half_mm
    if G.shape[-1] <= X.shape[-1]:
        Gs = (G.float() * wn).to(G.dtype)
        gw = mm(Gs.reshape(-1, G.shape[-1]).T, X.reshape(-1, X.shape[-1]))
    else:
        Xs = (X.float() * wn).to(X.dtype)
        gw = mm(G.reshape(-1, G.shape[-1]).T, Xs.reshape(-1, X.shape[-1]))
    return gw.mul_(top)


def _half_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of half operands: float32-accumulated, rounded once to the half dtype, returned in float32."""
    return (a @ b).float()
