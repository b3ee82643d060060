"""Intra-micro-batch PROMA (arXiv 2601.10498 v4, abstract: "a factored projection using dominant subspaces of
activations and gradient outputs ... applied independently within each microbatch") as pure tensor functions.

One covered linear layer and one micro-batch, valid token rows only: X (n, d_in) inputs a_t, D (n, d_out) output
gradients delta_t of the advantage-free surrogate. A randomized range finder gives orthonormal bases of the
approximate top-k right-singular subspaces of X and of D:

    k = min(dim, n, d_in, d_out);   Omega_a, Omega_g ~ N(0, 1)^{n x k}, independent
    Y_a = X^T Omega_a, then q times Y_a <- X^T orth(X Y_a)  (orthonormalized after every product)   Q_a = basis(Y_a)
    Y_g = D^T Omega_g, likewise with D                                                               Q_g = basis(Y_g)
    Pi(M) = Q_g (Q_g^T M Q_a) Q_a^T         the orthogonal projector (Q_a Q_a^T) (x) (Q_g Q_g^T) on (d_out, d_in)

and the projected gradient is M - s_i Pi(M). Orthonormalizing after every product (after X and after X^T) spans the
same subspace as the reference's single QR of (X^T X)^q X^T Omega in exact arithmetic; in float32 every sketch then
scales like the singular values themselves (not their squares), so each direction above `rank_rtol` of the largest
stays resolvable whatever q. Columns the sketch cannot resolve (fewer valid rows than k, rank(X) < k, or a direction
below `rank_rtol` of the largest) are dropped, i.e. set to zero, instead of the arbitrary columns a QR returns for them:
Q Q^T stays the orthogonal projector onto the resolved subspace.

Padding: the row of X or of D at a padding position is zero and the other finite (ISOPO's contract); every product
here masks its (n, k) side, so padding rows never enter X^T X or D^T D and no masked copy of X or D is made. Half
operands are upcast chunk by chunk (float32 bases and products). No host reads: the rank decision is a device mask.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..layerwise.costs import DEFAULT_BUDGET_BYTES
from ..layerwise.precision import stat_dtype

INTRA_TARGETS = ("microbatch", "accumulated", "accumulated_after")


def rank_rtol(dtype: torch.dtype) -> float:
    """Relative threshold on |R_jj| / max_l |R_ll| below which a sketch column counts as unresolved: 1e3 machine
    epsilons of the basis dtype (float32: 1.2e-4; float64: 2.2e-13), above the rounding of the sketch GEMMs."""
    return 1e3 * torch.finfo(dtype).eps


def sketch_size(dim: int, num_rows: int, d_in: int, d_out: int) -> int:
    """k = min(dim, rows, d_in, d_out): the number of sketch columns. `num_rows` is B * L (a static bound on the
    valid rows n; the columns beyond n are dropped on the device)."""
    return max(0, min(dim, num_rows, d_in, d_out))


def draw_sketches(
    num_rows: int, k: int, generator: torch.Generator, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Omega_a, Omega_g), each (num_rows, k) standard normal, drawn in this order from `generator` (never the
    global RNG; a CUDA generator for CUDA tensors). Rows follow the flattened (B, L) positions."""
    Oa = torch.randn(num_rows, k, generator=generator, dtype=dtype, device=device)
    Og = torch.randn(num_rows, k, generator=generator, dtype=dtype, device=device)
    return Oa, Og


def _flat_rows(T: torch.Tensor, k: int, dtype: torch.dtype, budget_bytes: int) -> tuple[torch.Tensor, int]:
    """(T as (B L, d), rows per chunk): chunks of the flat row axis are contiguous views of a contiguous T (a chunk
    of the L axis of (B, L, d) is not, and its reshape copied every chunk). Only rows that are upcast need chunks
    (their float32 copy is bounded by the budget); rows already in `dtype` go in one product."""
    d = T.shape[-1]
    rows = T.shape[0] * T.shape[1]
    if T.dtype == dtype:
        return T.reshape(rows, d), max(1, rows)
    item = torch.finfo(dtype).bits // 8
    return T.reshape(rows, d), max(1, min(rows, budget_bytes // max(1, (d + k) * item)))


def masked_rows_times(
    T: torch.Tensor, Q: torch.Tensor, mask: torch.Tensor, budget_bytes: int = DEFAULT_BUDGET_BYTES
) -> torch.Tensor:
    """(B, L, k) rows t_t^T Q at valid positions, exact zeros at padding; T (B, L, d), Q (d, k), mask (B, L).
    Computed in Q's dtype (half T is upcast chunk by chunk)."""
    B, L, _ = T.shape
    k = Q.shape[1]
    Tf, step = _flat_rows(T, k, Q.dtype, budget_bytes)
    out = torch.empty(B * L, k, dtype=Q.dtype, device=Q.device)
    Qt = Q.T.contiguous()
    for r0 in range(0, B * L, step):
        # (Q^T Tc^T)^T: the CPU GEMM runs this faster than Tc @ Q when k is not a multiple of 16
        out[r0 : r0 + step] = (Qt @ Tf[r0 : r0 + step].to(Q.dtype).T).T
    return torch.where(mask.unsqueeze(-1), out.view(B, L, k), 0.0)


def rows_transpose_times(T: torch.Tensor, Z: torch.Tensor, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> torch.Tensor:
    """sum_t t_t z_t^T (d, k) for T (B, L, d) and Z (B, L, k) zero at every padding position, in Z's dtype."""
    d, k = T.shape[-1], Z.shape[-1]
    Tf, step = _flat_rows(T, k, Z.dtype, budget_bytes)
    Zf = Z.reshape(-1, k)
    out = torch.zeros(k, d, dtype=Z.dtype, device=Z.device)
    for r0 in range(0, Tf.shape[0], step):
        out += Zf[r0 : r0 + step].T @ Tf[r0 : r0 + step].to(Z.dtype)  # (k, d): faster on CPU than Tc^T @ Z
    return out.T


def orthonormal_columns(Y: torch.Tensor, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q (d, k), kept (k,) bool): an orthonormal basis of range(Y) for Y (d, k), d >= k, with the unresolved
    columns set to zero and placed last.

    Two Householder QRs. The first only decides: column j is resolved if |R_jj| > `rank_rtol` * max_l |R_ll| (and
    `keep[j]`, the previous step's decision: a dropped column stays dropped); R_jj is the distance of y_j from the
    span of the earlier basis vectors, so (for data in general position) the resolved columns form a basis of
    range(Y). The second QR runs on the resolved columns moved first (a stable device sort, no host read): a QR
    meeting a dependent column in the middle returns an arbitrary direction there that later columns may lean on,
    so dropping it could lose part of range(Y); dependent columns placed last cannot.
    """
    r = torch.diagonal(torch.linalg.qr(Y, mode="r")[1]).abs()
    resolved = r > rank_rtol(Y.dtype) * r.amax()
    if keep is not None:
        resolved &= keep
    order = torch.sort((~resolved).to(torch.uint8), stable=True).indices
    resolved = resolved[order]
    Q = torch.linalg.qr(Y[:, order])[0]  # the first columns of a QR span the first columns of its input
    return torch.where(resolved, Q, 0.0), resolved  # where, not a product: NaN columns become 0 too


def range_basis(
    T: torch.Tensor,
    mask: torch.Tensor,
    omega: torch.Tensor,
    power_iters: int,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q (d, k), kept (k,) bool): orthonormal basis of the approximate top-k right-singular subspace of T's valid
    rows (the range of (T^T T)^q T^T Omega restricted to valid rows), dropped columns zero.

    Args:
        T: (B, L, d) rows (layer inputs or output gradients), any float dtype.
        mask: (B, L) valid positions.
        omega: (B * L, k) Gaussian sketch in the basis dtype (`draw_sketches`); padding rows are ignored.
        power_iters: q >= 0.
    """
    B, L, _ = T.shape
    om = torch.where(mask.reshape(-1, 1), omega, 0.0).view(B, L, -1)
    Q, kept = orthonormal_columns(rows_transpose_times(T, om, budget_bytes))
    valid = mask.reshape(B, L, 1)
    for _ in range(power_iters):
        Z = masked_rows_times(T, Q, mask, budget_bytes)  # (B, L, k), zero at padding
        # Orthonormalize T Q before the product with T^T, so that the next sketch scales like sigma (as the first),
        # not sigma^2: the column-drop rule then keeps every direction above `rank_rtol` of the largest singular
        # value in float32 too. Same span in exact arithmetic. The dropped (zero, last) columns of Q get arbitrary
        # columns here, masked to the valid rows; `kept` keeps them dropped.
        W = torch.where(valid, torch.linalg.qr(Z.reshape(B * L, -1))[0].view_as(Z), 0.0)
        Q, kept = orthonormal_columns(rows_transpose_times(T, W, budget_bytes), kept)
    return Q, kept


class IntraBasis(NamedTuple):
    """Q_a (d_in, k), Q_g (d_out, k) orthonormal (dropped columns zero); xq (B, L, k) = X Q_a and dq (B, L, k) =
    D Q_g at valid positions (zero at padding), None unless asked for (`sequence_cores` needs them); rank: scalar
    tensor, min of the two resolved column counts."""

    Q_a: torch.Tensor
    Q_g: torch.Tensor
    xq: torch.Tensor | None
    dq: torch.Tensor | None
    rank: torch.Tensor


def factored_basis(
    X: torch.Tensor,
    D: torch.Tensor,
    mask: torch.Tensor,
    dim: int,
    power_iters: int,
    generator: torch.Generator | None = None,
    *,
    sketches: tuple[torch.Tensor, torch.Tensor] | None = None,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    rows: bool = True,
    shared_input=None,
) -> IntraBasis:
    """The two range finders of one layer and micro-batch (module docstring). X (B, L, d_in), D (B, L, d_out),
    mask (B, L); k = `sketch_size(dim, B * L, d_in, d_out)`; the sketches come from `generator` (`draw_sketches`)
    unless given as `sketches` ((B L, k) each, tests). Bases in `stat_dtype(X.dtype)` (float32 for half layers).
    `rows=False` skips xq and dq (a pass over X and one over D): the projection of a materialized matrix
    (`core_of`) does not need them, only the per-sequence cores do.

    `shared_input` (`layerwise.inputs.SharedInput` of X, or None): Q_a and xq depend only on X, the mask and Omega_a,
    so the layers reading one input compute them once, from the Omega_a of the first of them to run (both sketches
    are still drawn from every layer's own generator, so its Q_g is what it would be alone). Each layer's Q_a keeps
    its distribution (a basis from a standard normal sketch independent of the layer's data and of its Omega_g);
    what changes is only that q/k/v (gate/up) now share one draw. docs/proma.md, "Shared input range finder"."""
    B, L, d_in = X.shape
    d_out = D.shape[-1]
    dt = stat_dtype(X.dtype)
    k = sketch_size(dim, B * L, d_in, d_out)
    if sketches is None:
        if generator is None:
            raise ValueError("intra PROMA needs an explicit torch.Generator for its Gaussian sketches")
        sketches = draw_sketches(B * L, k, generator, dt, X.device)

    def input_basis():
        return range_basis(X, mask, sketches[0].to(dt), power_iters, budget_bytes)

    key = ("proma_intra_input", k, power_iters, dt, budget_bytes)
    Q_a, kept_a = input_basis() if shared_input is None else shared_input.statistic(key, input_basis)
    Q_g, kept_g = range_basis(D, mask, sketches[1].to(dt), power_iters, budget_bytes)
    xq = dq = None
    if rows:
        def input_rows():
            return masked_rows_times(X, Q_a, mask, budget_bytes)

        xq = input_rows() if shared_input is None else shared_input.statistic(key + ("rows",), input_rows)
        dq = masked_rows_times(D, Q_g, mask, budget_bytes)
    rank = torch.minimum(kept_a.sum(), kept_g.sum())
    return IntraBasis(Q_a, Q_g, xq, dq, rank)


def sequence_cores(basis: IntraBasis) -> torch.Tensor:
    """C_i = Q_g^T V_i Q_a = sum_{t in T_i} (Q_g^T delta_t)(Q_a^T a_t)^T for every sequence: (B, k, k).

    Every projected quantity follows from them: Q_g^T (sum_i c_i V_i) Q_a = sum_i c_i C_i and
    <V_i, Pi(M)> = <C_i, Q_g^T M Q_a>. Cost B L k^2."""
    return basis.dq.transpose(1, 2) @ basis.xq


def core_of(basis: IntraBasis, M: torch.Tensor) -> torch.Tensor:
    """Q_g^T M Q_a (k, k) for a materialized M (d_out, d_in) (the running gradient)."""
    return basis.Q_g.T @ (M.to(basis.Q_a.dtype) @ basis.Q_a)


def expand_core(basis: IntraBasis, core: torch.Tensor) -> torch.Tensor:
    """Pi(M) = Q_g core Q_a^T (d_out, d_in) for core = Q_g^T M Q_a."""
    return (basis.Q_g @ core) @ basis.Q_a.T


def project(basis: IntraBasis, M: torch.Tensor) -> torch.Tensor:
    """Pi(M) (d_out, d_in): the orthogonal projection of M onto span{q_g q_a^T}."""
    return expand_core(basis, core_of(basis, M))


def intra_macs(
    n: int, d_in: int, d_out: int, dim: int, power_iters: int, macs_per_float: int = 0, input_shared: bool = False
) -> tuple[float, float]:
    """(products, other): multiply-accumulates of the intra variant (default target) for one layer and micro-batch of
    n padded rows, k = `sketch_size`. Products: (2q+1) n k (d_in + d_out) for the range finders (padding rows
    included: the chunks are not compacted), Q_g^T G_m Q_a and the rank-k update Q_g M Q_a^T (2 d_in d_out k +
    2 d_out k^2). QRs (Householder, m k^2 - k^3/3 MACs for R, as much again to form Q): two of (d x k) per
    `orthonormal_columns` ((q+1) per side) and one of (n x k) per power step and side. Other: the QRs, plus
    `macs_per_float` per float of X and D each range-finder pass streams, (2q+1) n (d_in + d_out): a k-column
    product reads the whole operand for k MACs per float, so it runs at memory speed, not GEMM speed.
    `input_shared`: a layer whose input basis an earlier layer computed (`factored_basis`' shared_input): the input
    side's range finder and QRs are not paid again."""
    k = sketch_size(dim, n, d_in, d_out)
    q = power_iters
    sides = (d_out,) if input_shared else (d_in, d_out)
    products = (2 * q + 1) * n * k * sum(sides) + 2 * d_in * d_out * k + 2 * d_out * k * k

    def qr(m: int, with_q: bool) -> float:
        return (2 if with_q else 1) * (m * k * k - k**3 / 3)

    # per side: (q+1) x (R only + R and Q) of the (d x k) sketch, q x (R and Q) of the (n x k) rows
    qrs = sum((q + 1) * (qr(d, False) + qr(d, True)) + q * qr(n, True) for d in sides)
    stream = (2 * q + 1) * n * sum(sides) * macs_per_float
    return float(products), float(qrs + stream)
