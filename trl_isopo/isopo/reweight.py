"""ISOPO per-sequence coefficients from per-layer statistics (pure tensor functions).

Notation (paper arXiv 2512.23353; `isopo-spec.md` §2): for one covered layer and one micro-batch of B sequences,
V_i is sequence i's gradient of the advantage-free surrogate, and

- e_i = ||V_i||_F (Euclidean norm),
- f_i ~ ||V_i||_Fisher, estimated on a token sample J (Fisher norm),
- rho_i = f_i / e_i (relative overlap).

The non-interacting update is sum_i A_i * R(e_i)^q * R(f_i)^p * R(rho_i)^r * V_i (paper exponents p, q, r), with the
regularized magnitude R below. The interacting (MinSR-like) update is sum_i alpha_i V_i with
alpha = lam (K + lam I)^-1 A, K_ik = <V_i, V_k>.
"""

from __future__ import annotations

import torch

# Same guards as the reference implementation: they only matter for exactly-zero statistics.
_REG_EPS = 1e-8
_WEIGHT_EPS = 1e-8
_RHO_EPS = 1e-12


def regularized_magnitude(x: torch.Tensor, mu: torch.Tensor | float, c: float) -> torch.Tensor:
    """R(x) = sqrt(x^2 / (c * mu + 1e-8) + 1) for c > 0 ("keep small invariant"), |x| for c = 0.

    Args:
        x: (B,) non-negative statistic (e, f or rho) per sequence.
        mu: scalar or (B,): the EMA of the batch mean of x^2 (the reference uses each sequence's own x^2 before any
            history exists).
        c: regularization factor (`isopo_reg`).

    Returns:
        (B,) tensor. Small statistics give R ~ 1 (left untouched), large ones R ~ x / sqrt(c mu) (normalized).
    """
    if c < 0:
        raise ValueError(f"regularization factor c must be >= 0, got {c}")
    if c == 0:
        return x.abs()
    return torch.sqrt(x * x / (c * mu + _REG_EPS) + 1.0)


def isopo_sequence_scales(
    e: torch.Tensor | None,
    f: torch.Tensor | None,
    rho: torch.Tensor | None,
    mu: dict[str, torch.Tensor | float],
    p: float,
    q: float,
    r: float,
    c: float,
) -> torch.Tensor:
    """Per-sequence scale s_i = 1 / (R(e_i)^-q * R(f_i)^-p * R(rho_i)^-r + 1e-8) (advantages not applied).

    Args:
        e, f, rho: (B,) statistics; a statistic whose exponent is 0 may be None (it is not computed).
        mu: {"e": mu_e, "f": mu_f, "rho": mu_rho}, each scalar or (B,), for the statistics that are used.
        p, q, r: the paper's exponents (Fisher, Euclidean, ratio).
        c: regularization factor.

    Returns:
        (B,) scales, in the dtype of the first statistic given.
    """
    denom = None
    for name, stat, exponent in (("e", e, q), ("f", f, p), ("rho", rho, r)):
        if exponent == 0:
            continue
        if stat is None:
            raise ValueError(f"statistic {name!r} is required for a nonzero exponent")
        factor = regularized_magnitude(stat, mu[name], c)
        factor = factor if exponent == -1 else factor.pow(-exponent)  # the common exponent -1 needs no pow
        denom = factor if denom is None else denom * factor
    if denom is None:
        denom = torch.ones_like(next(t for t in (e, f, rho) if t is not None))
    return (denom + _WEIGHT_EPS).reciprocal_()


def isopo_sequence_weights(advantages: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w_i = A_i * s_i: the coefficient of V_i in the layer's ISOPO gradient. Shapes (B,), (B,) -> (B,)."""
    return advantages.to(scales.dtype) * scales


def fisher_norm(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """f_i = sqrt(sum_j (g_j^T V_i a_j)^2) / ||(|g_j| |a_j| + 1e-12)_j||; (B,), scalar -> (B,).

    Degree 1 in V_i and degree 0 in the scale of the output gradients (paper §2.0.2, eq. 6).
    """
    return numerator.clamp_min(0).sqrt() / denominator


def relative_overlap(f: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """rho_i = f_i / (e_i + 1e-12): dimensionless, ~ RMS cosine between V_i and the token gradients. (B,) -> (B,)."""
    return f / (e + _RHO_EPS)


def interacting_coefficients(ntk: torch.Tensor, advantages: torch.Tensor, lam: torch.Tensor | float) -> torch.Tensor:
    """alpha = lam (K + (lam + 1e-8) I)^-1 A, solved in float64 (the reference's `U diag(lam/(D+lam+1e-8)) U^T A`).

    The paper writes the interacting step as J^T (K + c I)^-1 A; multiplying by lam keeps the step equal to
    REINFORCE when K << lam (all alpha_i -> A_i) and gives alpha / lam -> K^-1 A as lam -> 0.

    A Cholesky solve, not the reference's eigendecomposition: on CUDA `torch.linalg.eigh` synchronizes with the
    host (here once per covered layer and micro-batch, inside the backward) and cuSOLVER's eigh can fail on an
    all-zero K (PEFT's lora_A on the first step); `cholesky_ex` (failure reported in `info`, not checked on the
    host) and triangular solves do neither. If K + (lam + 1e-8) I is not positive definite in float64 (a K far from
    PSD: non-finite entries, or rounding beyond lam), the coefficients are NaN and the caller drops them like any
    non-finite coefficient, instead of raising or returning an unbounded solve.

    Args:
        ntk: (B, B) symmetric PSD kernel K_ik = <V_i, V_k>_F.
        advantages: (B,).
        lam: non-negative scalar (tensor or float).

    Returns:
        (B,) float64 coefficients.
    """
    M = ntk.to(torch.float64, copy=True)
    if isinstance(lam, torch.Tensor):
        lam = lam.to(torch.float64)
    M.diagonal().add_(lam + _REG_EPS)
    L, info = torch.linalg.cholesky_ex(M)
    # Two triangular solves (BLAS trsm: no error flag to check, so no host sync either).
    y = torch.linalg.solve_triangular(L, (advantages.to(torch.float64) * lam).unsqueeze(1), upper=False)
    alpha = torch.linalg.solve_triangular(L.mT, y, upper=True).squeeze(1)
    return torch.where(info == 0, alpha, torch.nan)
