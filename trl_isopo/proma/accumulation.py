"""Accumulation-based PROMA (arXiv 2601.10498 v4, §2; Algorithm 1) as pure tensor functions.

One covered linear layer W (d_out, d_in), one micro-batch m of B sequences. V_i is sequence i's weight gradient of
the advantage-free surrogate, G_m = sum_i A_i V_i the micro-batch policy gradient, S_{m-1} the gradient accumulated
over the earlier micro-batches of the optimizer step (S_0 = 0). With e_i = ||V_i|| and U_i = V_i / e_i:

    K^_ij = <U_i, U_j>  (B, B, unit diagonal)        b^_i = <U_i, S_{m-1}>
    w     = (K^ + lam I)^-1 b^      (exact solve)  or  sequential Gram-Schmidt sweeps (see `gram_schmidt_coefficients`)
    P_m   = sum_i w_i U_i                              the ridge least-squares fit of S_{m-1} by the U_i
    kappa = min(1, beta ||G_m|| / ||P_m||)             relative bound (kappa = 1 when off)
    dS_m  = G_m - s kappa P_m = sum_i (A_i - s kappa w_i / e_i) V_i          S_m = S_{m-1} + dS_m

The increment is one re-weighted GEMM with per-sequence coefficients c_i = A_i - s kappa w_i / e_i, so no V_i is
ever formed: K = <V_i, V_j> comes from ISOPO's statistics routes and b_i = <V_i, S> from one GEMM
(`running_overlaps`). The ridge lam is relative (K^ is dimensionless with unit diagonal). Exact zeros: a sequence
with V_i = 0 has e_i = 0, U_i := 0, w_i = 0 and c_i = A_i (it multiplies a zero gradient); S = 0 gives w = 0. There
is no absolute epsilon anywhere (the reference's "+1e-8" guards are dropped), so every quantity is homogeneous:
V -> k V and S -> k S give dS -> k dS.

No function here reads a tensor on the host: the ridge solve is a Cholesky factorization whose failure flag is
turned into NaN coefficients on the device (`ridge_coefficients`), never checked in Python.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..layerwise.costs import DEFAULT_BUDGET_BYTES
from ..layerwise.precision import stat_dtype

SOLVERS = ("solve", "gram_schmidt")


def normalized_kernel(K: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e, K^) in float64 from the kernel K_ij = <V_i, V_j> (B, B).

    e_i = sqrt(K_ii) (B,); K^_ij = K_ij / (e_i e_j) (B, B), symmetric, with unit diagonal (up to rounding) where
    e_i > 0 and row and column i zero where e_i = 0. Float64 so that tiny (but nonzero) norms cannot underflow.
    """
    K64 = K.to(torch.float64)
    e = torch.diagonal(K64).clamp_min(0).sqrt()
    nonzero = e > 0
    inv = torch.where(nonzero, e.reciprocal(), 0.0)
    Kh = K64 * inv.unsqueeze(1) * inv.unsqueeze(0)
    return e, 0.5 * (Kh + Kh.T)


def unit_overlaps(b_raw: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """b^_i = <U_i, S> = <V_i, S> / e_i (0 where e_i = 0); (B,), (B,) -> (B,) float64."""
    b64, e64 = b_raw.to(torch.float64), e.to(torch.float64)
    return torch.where(e64 > 0, b64 / torch.where(e64 > 0, e64, 1.0), 0.0)


def running_overlaps(
    X: torch.Tensor,
    G: torch.Tensor,
    S: torch.Tensor,
    V: torch.Tensor | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> torch.Tensor:
    """b_i = <V_i, S> = sum_{t in T_i} g_t^T S a_t for every sequence, without forming V_i.

    Args:
        X: (B, L, d_in) layer inputs; G: (B, L, d_out) output gradients of the advantage-free surrogate. At every
            padding position the row of X or of G is zero and the other finite (ISOPO's contract).
        S: (d_out, d_in) the running gradient.
        V: (B, d_out, d_in) the materialized per-sequence gradients if a statistics route kept them (then one pass
            over V instead of the GEMM).
        budget_bytes: bound on the chunked (B, c, d) intermediates.

    Returns:
        (B,) in `stat_dtype(X.dtype)`. Cost: one weight-gradient-sized GEMM, X S^T or G S (the narrower output),
        on operands upcast chunk by chunk to the statistics dtype (half X, G) so that b keeps float32 precision.
    """
    sdt = stat_dtype(X.dtype)
    S = S.to(sdt)
    if V is not None:
        return (V.to(sdt) * S).sum((1, 2))
    B, L, d_in = X.shape
    d_out = G.shape[-1]
    item = torch.finfo(sdt).bits // 8
    step = max(1, min(L, budget_bytes // max(1, B * (d_in + d_out + min(d_in, d_out)) * item)))
    b = torch.zeros(B, dtype=sdt, device=X.device)
    for l0 in range(0, L, step):
        Xc, Gc = X[:, l0 : l0 + step].to(sdt), G[:, l0 : l0 + step].to(sdt)
        if d_out <= d_in:
            b += ((Xc @ S.T) * Gc).sum((1, 2))  # z_t = S a_t, then g_t . z_t
        else:
            b += ((Gc @ S) * Xc).sum((1, 2))  # z_t = S^T g_t, then a_t . z_t
    return b


def ridge_coefficients(Kh: torch.Tensor, b: torch.Tensor, ridge: float) -> torch.Tensor:
    """w = (K^ + lam I)^-1 b^ in float64; (B, B), (B,) -> (B,).

    The ridge fit of S by the unit gradients: along a K^-eigenvector of eigenvalue mu, P keeps the fraction
    mu / (mu + lam) of S's component in the span (lam -> 0: the orthogonal projection; lam -> inf: nothing).
    `cholesky_ex` reports failure in `info` without a host read; a failed factorization (K^ + lam I not positive
    definite in float64: lam = 0 with dependent or zero U_i, or non-finite entries) gives NaN coefficients, which
    the caller turns into "no projection" for this layer and micro-batch.
    """
    M = Kh.to(torch.float64, copy=True)
    M.diagonal().add_(ridge)
    L, info = torch.linalg.cholesky_ex(M)
    y = torch.linalg.solve_triangular(L, b.to(torch.float64).unsqueeze(1), upper=False)
    w = torch.linalg.solve_triangular(L.mT, y, upper=True).squeeze(1)
    return torch.where(info == 0, w, torch.nan)


def gram_schmidt_coefficients(Kh: torch.Tensor, b: torch.Tensor, sweeps: int) -> torch.Tensor:
    """Coefficients w of P = S - c after `sweeps` sequential Gram-Schmidt sweeps c <- c - <c, U_i> U_i (i = 1..B
    in order, starting from c = S): the reference's first "quick" form (arXiv 2601.10498 v1 code, January runs).

    In coefficients, c = S - sum_j w_j U_j and <c, U_i> = b^_i - (K^ w)_i, so one sweep is one Gauss-Seidel sweep
    on K^ w = b^ (unit diagonal): w <- w + (D + L)^-1 (b^ - K^ w), D + L the lower triangle of K^ (a zero sequence
    gets D_ii = 1 and a zero residual). A product of rank-1 orthogonal projectors: ||S - P|| never exceeds ||S||, and
    with more sweeps P tends to the orthogonal projection of S onto span{U_i} (lam = 0). It depends on the order of
    the sequences. Not the later "vectorized" form c <- c - sum_i <c, U_i> U_i, which is no projection once K^ has
    an eigenvalue above 2.
    """
    Kh = Kh.to(torch.float64)
    lower = torch.tril(Kh, diagonal=-1)
    lower.diagonal().fill_(1.0)
    b = b.to(torch.float64)
    w = torch.zeros_like(b)
    for _ in range(sweeps):
        r = (b - Kh @ w).unsqueeze(1)
        w = w + torch.linalg.solve_triangular(lower, r, upper=False).squeeze(1)
    return w


def relative_bound_factor(p_norm: torch.Tensor, g_norm: torch.Tensor, bound: float | None) -> torch.Tensor:
    """kappa = beta ||G|| / ||P|| where ||P|| > beta ||G||, else 1 (scalars -> scalar); 1 when `bound` is None."""
    if bound is None:
        return torch.ones_like(p_norm)
    limit = bound * g_norm
    return torch.where(p_norm > limit, limit / torch.where(p_norm > 0, p_norm, 1.0), 1.0)


class AccumulationCoefficients(NamedTuple):
    """What `accumulation_coefficients` returns, all float64 on the kernel's device.

    coefficients: (B,) c_i = A_i - s kappa w_i / e_i (dS = sum_i c_i V_i); a non-finite c_i is replaced by A_i.
    w: (B,) the fit's coefficients on the unit gradients (NaN where the solve failed).
    kappa: scalar relative-bound factor. p_norm: ||P|| before the bound. p_dot_s: <P, S> = w . b^.
    g_norm: ||G_m|| (or the value passed as `g_sq_norm`, square-rooted).
    """

    coefficients: torch.Tensor
    w: torch.Tensor
    kappa: torch.Tensor
    p_norm: torch.Tensor
    p_dot_s: torch.Tensor
    g_norm: torch.Tensor


def accumulation_coefficients(
    K: torch.Tensor,
    b_raw: torch.Tensor,
    advantages: torch.Tensor,
    *,
    shrinkage: float,
    ridge: float,
    solver: str = "solve",
    sweeps: int = 2,
    relative_bound: float | None = None,
    g_sq_norm: torch.Tensor | None = None,
) -> AccumulationCoefficients:
    """Per-sequence coefficients of the increment dS_m = G_m - s kappa P_m (module docstring).

    Args:
        K: (B, B) kernel <V_i, V_j> of the micro-batch's per-sequence gradients (any float dtype).
        b_raw: (B,) <V_i, S_{m-1}> (`running_overlaps`).
        advantages: (B,) A_i.
        shrinkage: s. ridge: lam (relative, on K^). solver: "solve" (exact ridge) or "gram_schmidt" (`sweeps`
            sequential sweeps, no ridge). relative_bound: beta, or None (off).
        g_sq_norm: ||G||^2 the bound compares with, if not A^T K A (e.g. the micro-batch gradient after an intra
            projection).
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    e, Kh = normalized_kernel(K)
    bh = unit_overlaps(b_raw, e)
    w = ridge_coefficients(Kh, bh, ridge) if solver == "solve" else gram_schmidt_coefficients(Kh, bh, sweeps)
    p_norm = (w @ Kh @ w).clamp_min(0).sqrt()
    A = advantages.to(device=Kh.device, dtype=torch.float64)
    if g_sq_norm is None:
        g_sq_norm = A @ K.to(torch.float64) @ A
    g_norm = g_sq_norm.to(torch.float64).clamp_min(0).sqrt()
    kappa = relative_bound_factor(p_norm, g_norm, relative_bound)
    per_grad = torch.where(e > 0, w / torch.where(e > 0, e, 1.0), 0.0)  # coefficient of V_i in P
    c = A - (shrinkage * kappa) * per_grad
    c = torch.where(torch.isfinite(c), c, A)  # a failed solve (NaN w) leaves the micro-batch unprojected
    return AccumulationCoefficients(c, w, kappa, p_norm, w @ bh, g_norm)


def dense_accumulation_step(
    per_sequence: torch.Tensor,
    advantages: torch.Tensor,
    running: torch.Tensor | None,
    **knobs,
) -> tuple[torch.Tensor, AccumulationCoefficients | None]:
    """Accumulation PROMA for a parameter tensor whose per-sequence gradients are materialized (a covered layer's
    bias, (B, d_out)): (dS (*shape), coefficients or None when `running` is None).

    Args:
        per_sequence: (B, *shape) gradients of the advantage-free surrogate per sequence.
        advantages: (B,).
        running: (*shape) S_{m-1}, or None on the first micro-batch (dS = G_m).
        knobs: `accumulation_coefficients`' keyword arguments.
    """
    B = per_sequence.shape[0]
    Vf = per_sequence.reshape(B, -1)
    A = advantages.to(Vf.dtype)
    if running is None:
        return (A @ Vf).view(per_sequence.shape[1:]), None
    co = accumulation_coefficients(Vf @ Vf.T, Vf @ running.reshape(-1).to(Vf.dtype), advantages, **knobs)
    return (co.coefficients.to(Vf.dtype) @ Vf).view(per_sequence.shape[1:]), co
