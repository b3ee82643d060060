"""ISOPO per-sequence coefficients from per-layer statistics (pure tensor functions).

Notation (paper arXiv 2512.23353, §2): for one covered layer and one micro-batch of B sequences,
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

# No absolute guards (deviation from the reference, docs/isopo.md "Scale-free coefficients"): V_i carries the loss
# normalization 1/(tokens * GA), so f_i^2 is ~1e-10..1e-9 at the reference's own scale, below its "+1e-8" guards,
# which then silently turned every variant into REINFORCE. Every rule below is homogeneous in the statistics; exact
# zeros are handled explicitly instead.

REG_REFERENCES = ("ema_mean", "ema_median", "batch_median")


def nonzero_median(x2: torch.Tensor) -> torch.Tensor:
    """Median of the positive entries of x2 (B,) -> scalar tensor (the lower median for an even count; NaN if none).

    Sequences without a gradient in the layer (x = 0, e.g. fully masked completions) are left out, so they cannot
    drag the reference point to 0. On-device, no host synchronization: a sort and a gather at the on-device count,
    not `torch.nanmedian`, whose CUDA kernel reads the NaN count on the host in some torch versions.
    """
    keep = x2 > 0
    ordered = torch.sort(torch.where(keep, x2, torch.inf)).values  # the positive entries first, ascending
    k = ((keep.sum() - 1).clamp_min(0) // 2).reshape(1)
    return torch.where(keep.any(), ordered.gather(0, k), torch.nan).reshape(())


def regularized_magnitude(x: torch.Tensor, mu: torch.Tensor | float, c: float) -> torch.Tensor:
    """R(x) = sqrt(x^2 / (c * mu) + 1) for c > 0 ("keep small invariant"), |x| for c = 0.

    Homogeneous of degree 0 in (x, sqrt(mu)) for c > 0 (no absolute guard): R(k x, k^2 mu) = R(x, mu) for every k > 0.
    An exact x = 0 gives R = 1 whatever mu is (also mu = 0 or NaN, e.g. a layer whose every x is 0); a positive x
    against mu = 0 gives R = inf (its coefficient is then 0, see `isopo_sequence_scales`).

    Args:
        x: (B,) non-negative statistic (e, f or rho) per sequence.
        mu: scalar or (B,): the reference point of x^2 (`isopo_reg_reference`: an EMA over previous optimizer steps of
            the step mean or median of x^2, or the current micro-batch's median; the reference implementation's own
            rule uses each sequence's own x^2 before any history exists), in the same units as x^2.
        c: regularization factor (`isopo_reg`).

    Returns:
        (B,) tensor. Small statistics give R ~ 1 (left untouched), large ones R ~ x / sqrt(c mu) (normalized).
    """
    if c < 0:
        raise ValueError(f"regularization factor c must be >= 0, got {c}")
    if c == 0:
        return x.abs()
    x2 = x * x
    return torch.sqrt(torch.where(x2 > 0, x2 / (c * mu), 0.0) + 1.0)


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
    """Per-sequence scale s_i = 1 / (R(e_i)^-q * R(f_i)^-p * R(rho_i)^-r) (advantages not applied).

    Scale behaviour (a constant factor k on every V_i multiplies e and f by k, rho not at all):
    - c > 0: s is unchanged when mu is in the units of the statistics (mu -> k^2 mu): degree 0, no absolute guard.
    - c = 0: s is homogeneous of degree p + q in k; the update sum_i A_i s_i V_i is homogeneous of degree 1 + p + q,
      i.e. invariant for the named settings (p = -1; q = -1; p = 0, q = -1, r = -2).

    Exact zeros (c = 0 only; for c > 0, R(0) = 1): a sequence with a used statistic equal to 0 gets s_i = 0. Its V_i
    is zero (e_i = 0), or its Fisher estimate on the token sample saw none of its gradient (f_i = 0 with e_i > 0, where
    the reference would return 1e8 V_i). A zero or infinite product of R-powers likewise gives s_i = 0. Non-finite
    statistics give non-finite scales (the caller drops and counts those).

    Args:
        e, f, rho: (B,) statistics; a statistic whose exponent is 0 may be None (it is not computed).
        mu: {"e": mu_e, "f": mu_f, "rho": mu_rho}, each scalar or (B,), for the statistics that are used (c > 0).
        p, q, r: the paper's exponents (Fisher, Euclidean, ratio).
        c: regularization factor.

    Returns:
        (B,) scales, in the dtype of the first statistic given.
    """
    denom = None
    zero = None
    for name, stat, exponent in (("e", e, q), ("f", f, p), ("rho", rho, r)):
        if exponent == 0:
            continue
        if stat is None:
            raise ValueError(f"statistic {name!r} is required for a nonzero exponent")
        factor = regularized_magnitude(stat, mu.get(name, 0.0) if c > 0 else 0.0, c)
        if c == 0:
            zero = (stat == 0) if zero is None else zero | (stat == 0)
        factor = factor if exponent == -1 else factor.pow(-exponent)  # the common exponent -1 needs no pow
        denom = factor if denom is None else denom * factor
    if denom is None:
        return torch.ones_like(next(t for t in (e, f, rho) if t is not None))
    if zero is not None:
        denom = torch.where(zero, torch.inf, denom)
    return torch.where(denom == 0, torch.inf, denom).reciprocal_()


def isopo_sequence_weights(advantages: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w_i = A_i * s_i: the coefficient of V_i in the layer's ISOPO gradient. Shapes (B,), (B,) -> (B,)."""
    return advantages.to(scales.dtype) * scales


def fisher_norm(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """f_i = sqrt(sum_j (g_j^T V_i a_j)^2) / ||(|g_j| |a_j|)_j||; (B,), scalar -> (B,).

    Degree 1 in V_i and degree 0 in the scale of the output gradients (paper arXiv 2512.23353, §2.0.2, eq. 6). A zero
    denominator (every sampled token has g_j = 0 or a_j = 0, so every numerator is 0 too) gives f = 0, not NaN. The
    reference's absolute "+ 1e-12" inside the norm is dropped: |g_j| carries the loss normalization.
    """
    return torch.where(denominator > 0, numerator.clamp_min(0).sqrt() / denominator, 0.0)


def relative_overlap(f: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """rho_i = f_i / e_i: dimensionless, ~ RMS cosine between V_i and the token gradients. (B,) -> (B,).

    Degree 0 in V_i; e_i = 0 (no gradient in the layer) gives rho_i = 0 (the reference: f / (e + 1e-12)).
    """
    return torch.where(e > 0, f / e, 0.0)


def interacting_coefficients(ntk: torch.Tensor, advantages: torch.Tensor, lam: torch.Tensor | float) -> torch.Tensor:
    """alpha = lam (K + lam I)^-1 A, solved in float64 (the reference's `U diag(lam/(D+lam+1e-8)) U^T A`, without
    its absolute 1e-8).

    The paper writes the interacting step as J^T (K + c I)^-1 A; multiplying by lam keeps the step equal to
    REINFORCE when K << lam (all alpha_i -> A_i) and gives alpha / lam -> K^-1 A as lam -> 0. Homogeneous of degree
    0 in (K, lam): alpha(k^2 K, k^2 lam) = alpha(K, lam). lam = 0 (no history and trace K = 0, i.e. K = 0: every V_i
    of the layer is zero, e.g. PEFT's lora_A while lora_B = 0) gives alpha = A, finite, multiplying zero gradients.

    A Cholesky solve, not the reference's eigendecomposition: on CUDA `torch.linalg.eigh` synchronizes with the
    host (here once per covered layer and micro-batch, inside the backward) and cuSOLVER's eigh can fail on an
    all-zero K; `cholesky_ex` (failure reported in `info`, not checked on the host) and triangular solves do
    neither. If K + lam I is not positive definite in float64 (a K far from PSD: non-finite entries, or rounding
    beyond lam), the coefficients are NaN and the caller drops them like any non-finite coefficient, instead of
    raising or returning an unbounded solve.

    Args:
        ntk: (B, B) symmetric PSD kernel K_ik = <V_i, V_k>_F.
        advantages: (B,).
        lam: non-negative scalar (tensor or float), in the units of K.

    Returns:
        (B,) float64 coefficients.
    """
    M = ntk.to(torch.float64, copy=True)
    if isinstance(lam, torch.Tensor):
        lam = lam.to(device=M.device, dtype=torch.float64)
        lam = torch.where(lam > 0, lam, 1.0)
    else:
        lam = float(lam) if lam > 0 else 1.0
    M.diagonal().add_(lam)
    L, info = torch.linalg.cholesky_ex(M)
    # Two triangular solves (BLAS trsm: no error flag to check, so no host sync either).
    y = torch.linalg.solve_triangular(L, (advantages.to(torch.float64) * lam).unsqueeze(1), upper=False)
    alpha = torch.linalg.solve_triangular(L.mT, y, upper=True).squeeze(1)
    return torch.where(info == 0, alpha, torch.nan)
