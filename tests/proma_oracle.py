"""Float64 brute-force oracle for PROMA (arXiv 2601.10498), shared by the PROMA tests.

Per-sequence gradients V_i come from plain autograd of each sequence's surrogate on a small linear layer
y = x W^T that feeds a fixed nonlinearity and a log-softmax; the layer's inputs X and output gradients G (of the
summed surrogate) are captured for the implementation. The oracle's projections are dense: the ridge fit by
`torch.linalg.lstsq` on the stacked system [U^T; sqrt(lam) I] w = [S; 0] (not the normal equations the
implementation solves), the lam -> 0 projector from an SVD, Gram-Schmidt as literal rank-1 updates of a flattened
vector, and the intra bases from an SVD of (T^T T)^q T^T Omega (no QR, no intermediate orthonormalization).
The oracle's own checks are in tests/test_proma_oracle.py.
"""

import torch

F64 = torch.float64


def micro_batch(B=4, L=6, d_in=5, d_out=7, seed=0, pad="x_zero", empty_row=False, advantages=None):
    """(X, G, mask, A, V) of one micro-batch of the tiny layer, float64.

    X (B, L, d_in), G (B, L, d_out) = d(sum_i L_i)/dy, mask (B, L) with left and right padding, A (B,), V (B, d_out,
    d_in) = dL_i/dW by one autograd call per sequence. pad="x_zero": X's padding rows zero, G's hold finite garbage;
    "g_zero": the reverse (both satisfy the layer contract). empty_row: sequence 2 has no valid token (V_2 = 0).
    """
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(d_out, d_in, generator=g, dtype=F64) / d_in**0.5
    vocab = 11
    U = torch.randn(vocab, d_out, generator=g, dtype=F64)
    x = torch.randn(B, L, d_in, generator=g, dtype=F64)
    targets = torch.randint(0, vocab, (B, L), generator=g)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, :2] = False  # left padding
    if B > 1:
        mask[1, -3:] = False  # right padding
    if B > 3:
        mask[3, : L - 1] = False  # a single valid token
    if empty_row and B > 2:
        mask[2] = False
    W = W.requires_grad_(True)
    y = x @ W.T
    logp = torch.log_softmax(torch.tanh(y) @ U.T, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    n = mask.sum().clamp_min(1)
    per_seq = -(logp * mask).sum(1) / n  # advantage-free surrogate, token mean over the micro-batch
    V = torch.stack([torch.autograd.grad(per_seq[i], W, retain_graph=True)[0] for i in range(B)])
    (G,) = torch.autograd.grad(per_seq.sum(), y)
    X = x.detach().clone()
    m = mask.unsqueeze(-1)
    if pad == "x_zero":
        X = torch.where(m, X, 0.0)
        G = torch.where(m, G, 2.5)
    else:
        G = torch.where(m, G, 0.0)
        X = torch.where(m, X, -3.0)
    if advantages is None:
        A = torch.randn(B, generator=g, dtype=F64)
        A[B // 2] = 0.0
    else:
        A = torch.as_tensor(advantages, dtype=F64)
    return X, G, mask, A, V


def chain_batches(M=4, seed=0, **kw):
    """M micro-batches of the same layer shape with different data (different seeds and input scales)."""
    return [micro_batch(seed=seed + 17 * j, **kw) for j in range(M)]


def flat(V):
    return V.reshape(V.shape[0], -1)


def unit(V):
    Vf = flat(V)
    e = Vf.norm(dim=1, keepdim=True)
    return torch.where(e > 0, Vf / torch.where(e > 0, e, 1.0), 0.0)


def oracle_fit(V, S, lam=None, solver="solve", sweeps=2):
    """P (flattened): the fit of S by the unit gradients. solve: ridge lam via lstsq on the stacked system;
    exact: orthogonal projector from an SVD of the U_i; gram_schmidt: sequential rank-1 projections;
    vectorized: the reference's later simultaneous sweeps (not a projection; for contrast only)."""
    Uf = unit(V)
    s = S.reshape(-1)
    if solver == "solve":
        B = Uf.shape[0]
        lhs = torch.cat([Uf.T, lam**0.5 * torch.eye(B, dtype=F64)])
        rhs = torch.cat([s, torch.zeros(B, dtype=F64)])
        w = torch.linalg.lstsq(lhs, rhs.unsqueeze(1), driver="gelsd").solution.squeeze(1)
        return Uf.T @ w
    if solver == "exact":
        _, sig, Vh = torch.linalg.svd(Uf, full_matrices=False)
        basis = Vh[sig > 1e-12 * sig.max()]
        return basis.T @ (basis @ s)
    c = s.clone()
    for _ in range(sweeps):
        if solver == "gram_schmidt":
            for u in Uf:
                c = c - (c @ u) * u
        else:
            c = c - Uf.T @ (Uf @ c)
    return s - c


def oracle_basis(T, mask, omega, q):
    """Orthonormal basis (d, r) of range((T_v^T T_v)^q T_v^T Omega_v) on valid rows v, r its numerical rank."""
    Tv, Ov = T[mask], omega[mask.reshape(-1)]
    Y = Tv.T @ Ov
    for _ in range(q):
        Y = Tv.T @ (Tv @ Y)
    Uy, sig, _ = torch.linalg.svd(Y, full_matrices=False)
    return Uy[:, sig > 1e-9 * sig.max()] if sig.numel() else Uy[:, :0]


def oracle_step(V, A, S, *, mode="accumulation", s=1.0, lam=1e-2, solver="solve", sweeps=2, bound=None,
                si=1.0, target="microbatch", Pa=None, Pg=None):
    """S_m (d_out, d_in) from S_{m-1} (None = 0) by the literal update order of the reference: intra on S
    ("accumulated"), the accumulation fit of the result, + G_m (intra-projected for "microbatch"), then intra on
    the sum ("accumulated_after"). Pa, Pg: dense projectors (d_in, d_in), (d_out, d_out)."""
    acc, intra = mode in ("accumulation", "both"), mode in ("intra", "both")
    Pi = (lambda M: Pg @ M @ Pa) if intra else None
    G = torch.einsum("b,boi->oi", A, V)
    if intra and target == "microbatch":
        G = G - si * Pi(G)
    S = torch.zeros_like(G) if S is None else S.clone()
    first = not S.any()
    if intra and target == "accumulated":
        S = S - si * Pi(S)
    if acc and not first:
        P = oracle_fit(V, S, lam, solver, sweeps).view_as(S)
        if bound is not None and P.norm() > bound * G.norm():
            P = P * (bound * G.norm() / P.norm())
        S = S - s * P
    S = S + G
    if intra and target == "accumulated_after":
        S = S - si * Pi(S)
    return S


def assert_matches(got, want, tol=1e-9):
    """cosine >= 0.999999, equal norms (1e-6), and float64 agreement to `tol` (relative)."""
    got, want = got.to(F64).reshape(-1), want.to(F64).reshape(-1)
    scale = want.norm()
    assert scale > 0, "oracle value is zero: the comparison would be vacuous"
    cos = (got @ want) / (got.norm() * scale)
    assert cos >= 0.999999, f"cosine {cos.item()}"
    assert abs(got.norm() / scale - 1) <= 1e-6, f"norm ratio {(got.norm() / scale).item()}"
    err = ((got - want).norm() / scale).item()
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"


SHAPES = {  # (d_in, d_out)
    "full": (5, 7),
    "wide-in": (9, 3),
    "lora_A": (6, 2),  # rank-r adapter factors: d_out = r
    "lora_B": (2, 6),  # d_in = r
}
