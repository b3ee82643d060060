"""Intra-micro-batch PROMA (arXiv 2601.10498 v4, abstract; the factored projection) against the float64 oracle
of tests/proma_oracle.py, alone and combined with accumulation, plus the projector's algebra and limits."""

import pytest
import torch
from proma_oracle import F64, SHAPES, assert_matches, chain_batches, micro_batch, oracle_basis, oracle_fit, oracle_step

from trl_isopo.proma import factored_basis, proma_layer_step
from math_settings import proma_settings
from trl_isopo.proma.intra import draw_sketches, project, sketch_size

TARGETS = ["microbatch", "accumulated", "accumulated_after"]


def sketches_for(X, G, dim, seed):
    B, L, d_in = X.shape
    k = sketch_size(dim, B * L, d_in, G.shape[-1])
    return draw_sketches(B * L, k, torch.Generator().manual_seed(seed), F64, X.device)


def oracle_projectors(X, G, mask, sketches, q):
    Qa, Qg = oracle_basis(X, mask, sketches[0], q), oracle_basis(G, mask, sketches[1], q)
    return Qa @ Qa.T, Qg @ Qg.T


@pytest.mark.parametrize("q", [0, 1, 2, 4])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_bases_span_the_oracle_subspaces(q, shape):
    X, G, mask, A, V = micro_batch(d_in=shape[0], d_out=shape[1], seed=q, pad="g_zero")
    sk = sketches_for(X, G, 3, seed=1)
    basis = factored_basis(X, G, mask, 3, q, sketches=sk)
    Pa, Pg = oracle_projectors(X, G, mask, sk, q)
    assert_matches(basis.Q_a @ basis.Q_a.T, Pa)
    assert_matches(basis.Q_g @ basis.Q_g.T, Pg)
    assert basis.rank.item() == min(torch.linalg.matrix_rank(Pa).item(), torch.linalg.matrix_rank(Pg).item())


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("mode,knobs", [
    ("intra", dict()),
    ("intra", dict(intra_shrinkage=0.5, intra_power_iters=2)),
    ("both", dict()),
    ("both", dict(shrinkage=0.7, relative_bound=0.3, intra_shrinkage=0.6)),
    ("both", dict(solver="gram_schmidt", intra_power_iters=0)),
], ids=["intra", "intra,si=0.5,q=2", "both", "both,s,beta,si", "both,gs,q=0"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_chain_matches_oracle(target, mode, knobs, shape):
    batches = chain_batches(M=3, seed=21, d_in=shape[0], d_out=shape[1])
    settings = proma_settings(mode=mode, intra_target=target, intra_dim=3, **knobs)
    S = S_want = None
    for j, (X, G, mask, A, V) in enumerate(batches):
        sk = sketches_for(X, G, 3, seed=100 + j)
        step = proma_layer_step(X, G, mask, A, settings, running=S, sketches=sk)
        if S is not None:
            assert_matches(step.running, S + step.grad_weight, 1e-13)
        S = step.running
        Pa, Pg = oracle_projectors(X, G, mask, sk, settings.intra_power_iters)
        S_want = oracle_step(V, A, S_want, mode=mode, target=target, Pa=Pa, Pg=Pg, s=settings.shrinkage,
                             solver=settings.solver, bound=settings.relative_bound, si=settings.intra_shrinkage)
        assert_matches(S, S_want)
    plain = sum(torch.einsum("b,boi->oi", A, V) for _, _, _, A, V in batches)
    with pytest.raises(AssertionError):  # negative control: the plain sum fails the same oracle
        assert_matches(plain, S_want)


def test_projector_is_idempotent_and_symmetric():
    X, G, mask, A, V = micro_batch(d_in=8, d_out=9, L=9, seed=2)
    basis = factored_basis(X, G, mask, 4, 1, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    M, N = torch.randn(2, 9, 8, generator=g, dtype=F64)
    PM = project(basis, M)
    assert_matches(project(basis, PM), PM, 1e-12)
    assert abs((PM * N).sum() - (M * project(basis, N)).sum()) < 1e-12 * M.norm() * N.norm()
    assert (M - PM).norm() <= M.norm()
    eye = torch.eye(basis.Q_a.shape[1], dtype=F64)
    assert_matches(basis.Q_a.T @ basis.Q_a, eye, 1e-12)
    assert_matches(basis.Q_g.T @ basis.Q_g, eye, 1e-12)


def test_full_rank_sketch_keeps_the_micro_batch_gradient():
    """k = d_in = d_out <= valid rows: Q_a, Q_g are complete bases, Pi(G_m) = G_m, and s_i = 1 removes it all."""
    X, G, mask, A, V = micro_batch(d_in=6, d_out=6, L=8, seed=4)
    basis = factored_basis(X, G, mask, 10, 1, torch.Generator().manual_seed(3))
    Gm = torch.einsum("b,boi->oi", A, V)
    assert basis.rank.item() == 6
    assert_matches(project(basis, Gm), Gm, 1e-12)
    step = proma_layer_step(X, G, mask, A, proma_settings(mode="intra", intra_dim=10),
                            generator=torch.Generator().manual_seed(3))
    assert step.grad_weight.abs().max() < 1e-12 * Gm.abs().max()


def test_unresolved_columns_are_dropped():
    """Fewer valid rows than k, and X of rank 2: the dropped columns are zero (not arbitrary), Q^T Q is the
    0/1 diagonal of the kept ones, and Pi(G_m) = G_m because G_m lies inside the resolved subspaces."""
    B, L, d_in, d_out = 2, 3, 8, 7
    g = torch.Generator().manual_seed(5)
    mask = torch.tensor([[False, True, True], [False, False, True]])  # 3 valid rows
    X = (torch.randn(B, L, 2, generator=g, dtype=F64) @ torch.randn(2, d_in, generator=g, dtype=F64))  # rank 2
    X = torch.where(mask.unsqueeze(-1), X, 0.0)
    G = torch.randn(B, L, d_out, generator=g, dtype=F64)
    A = torch.tensor([0.7, -1.2], dtype=F64)
    basis = factored_basis(X, G, mask, 5, 2, torch.Generator().manual_seed(0))
    assert basis.Q_a.shape == (d_in, 5)
    ka = torch.diagonal(basis.Q_a.T @ basis.Q_a)
    kg = torch.diagonal(basis.Q_g.T @ basis.Q_g)
    assert torch.allclose(ka, torch.tensor([1.0, 1, 0, 0, 0], dtype=F64), atol=1e-12)
    assert torch.allclose(kg, torch.tensor([1.0, 1, 1, 0, 0], dtype=F64), atol=1e-12)
    assert basis.rank.item() == 2
    Gm = torch.einsum("blo,bli->oi", torch.where(mask.unsqueeze(-1), G, 0.0) * A.view(-1, 1, 1), X)
    assert_matches(project(basis, Gm), Gm, 1e-12)
    S = torch.randn(d_out, d_in, generator=g, dtype=F64)  # a running gradient outside the span keeps that part
    PS = project(basis, S)
    Ta = oracle_basis(X, mask, torch.randn(B * L, 5, generator=g, dtype=F64), 0)  # rank 2: the row space of X
    Tg = oracle_basis(G, mask, torch.randn(B * L, 5, generator=g, dtype=F64), 0)
    assert_matches(PS, (Tg @ Tg.T) @ S @ (Ta @ Ta.T))


def test_a_dependent_sketch_column_in_the_middle_is_dropped_without_losing_the_span():
    """Omega with a repeated column: the dependent column sits between independent ones. The basis must still
    span the oracle subspace (rank 2 of 3 columns) at every power step."""
    X, G, mask, A, V = micro_batch(d_in=8, d_out=9, L=9, seed=15)
    g = torch.Generator().manual_seed(4)
    Oa, Og = (torch.randn(X.shape[0] * X.shape[1], 3, generator=g, dtype=F64) for _ in range(2))
    Oa[:, 1] = Oa[:, 0]
    Og[:, 1] = 2 * Og[:, 0]
    for q in (0, 1, 3):
        basis = factored_basis(X, G, mask, 3, q, sketches=(Oa, Og))
        Pa, Pg = oracle_projectors(X, G, mask, (Oa, Og), q)
        assert basis.rank.item() == 2
        assert_matches(basis.Q_a @ basis.Q_a.T, Pa, 1e-8)
        assert_matches(basis.Q_g @ basis.Q_g.T, Pg, 1e-8)


def test_power_iterations_recover_a_gapped_top_subspace():
    g = torch.Generator().manual_seed(7)
    B, L, d = 4, 16, 12
    U, _ = torch.linalg.qr(torch.randn(B * L, d, generator=g, dtype=F64))
    Vt, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=F64))
    sig = torch.tensor([10.0, 9, 8, 7] + [1.0] * (d - 4), dtype=F64)
    X = (U * sig) @ Vt.T
    mask = torch.ones(B, L, dtype=torch.bool)
    top = Vt[:, :4] @ Vt[:, :4].T
    errs = []
    for q in (0, 2, 8):
        b = factored_basis(X.view(B, L, d), X.view(B, L, d), mask, 4, q, torch.Generator().manual_seed(0))
        errs.append(((b.Q_a @ b.Q_a.T) - top).norm().item())
    assert errs[0] > errs[1] > errs[2] and errs[2] < 1e-6, errs


def test_generator_contract():
    X, G, mask, A, V = micro_batch(seed=8)
    settings = proma_settings(mode="intra", intra_dim=3)
    state = torch.get_rng_state()
    a = proma_layer_step(X, G, mask, A, settings, generator=torch.Generator().manual_seed(11))
    b = proma_layer_step(X, G, mask, A, settings, generator=torch.Generator().manual_seed(11))
    c = proma_layer_step(X, G, mask, A, settings, generator=torch.Generator().manual_seed(12))
    assert torch.equal(torch.get_rng_state(), state)  # the global RNG is never touched
    assert torch.equal(a.grad_weight, b.grad_weight) and not torch.equal(a.grad_weight, c.grad_weight)
    d = proma_layer_step(X, G, mask, A, settings, sketches=sketches_for(X, G, 3, seed=11))
    assert torch.equal(a.grad_weight, d.grad_weight)  # Omega_a then Omega_g, (B L, k) each
    with pytest.raises(ValueError, match="Generator"):
        proma_layer_step(X, G, mask, A, settings)


def test_sketch_seeds_are_fixed_and_distinct():
    from trl_isopo.proma import sketch_seed

    assert sketch_seed(42, 0, 7, 3, 11) == sketch_seed(42, 0, 7, 3, 11)
    seeds = {sketch_seed(42, p, 7, m, layer) for p in range(2) for m in range(4) for layer in range(30)}
    assert len(seeds) == 240 and all(0 <= s < 2**63 for s in seeds)


def test_micro_batch_target_is_order_independent():
    batches = chain_batches(M=3, seed=30)
    settings = proma_settings(mode="intra", intra_dim=2)

    def run(order):
        S = None
        for j in order:
            X, G, mask, A, _ = batches[j]
            S = proma_layer_step(X, G, mask, A, settings, running=S, generator=torch.Generator().manual_seed(j)).running
        return S

    assert_matches(run([2, 0, 1]), run([0, 1, 2]), 1e-12)
    zero = proma_settings(mode="intra", intra_dim=2, intra_shrinkage=0.0)
    X, G, mask, A, V = batches[0]
    plain = proma_layer_step(X, G, mask, A, zero, generator=torch.Generator().manual_seed(0)).grad_weight
    assert_matches(plain, torch.einsum("b,boi->oi", A, V), 1e-12)


def test_intra_metrics_match_dense_norms():
    X, G, mask, A, V = micro_batch(d_in=8, d_out=9, L=9, seed=13)
    sk = sketches_for(X, G, 3, seed=2)
    step = proma_layer_step(X, G, mask, A, proma_settings(mode="intra", intra_dim=3, intra_shrinkage=0.5), sketches=sk)
    Pa, Pg = oracle_projectors(X, G, mask, sk, 1)
    Gm = torch.einsum("b,boi->oi", A, V)
    PiG = Pg @ Gm @ Pa
    want = [3.0, (PiG.norm() / Gm.norm()).item(), 100 * (1 - ((Gm - 0.5 * PiG).norm() / Gm.norm()).item())]
    assert torch.allclose(step.metrics[5:].double(), torch.tensor(want, dtype=F64), rtol=1e-5)
    # intra on the running gradient before accumulation: the accumulation metrics describe S' = S - s_i Pi(S)
    S = torch.randn(9, 8, generator=torch.Generator().manual_seed(0), dtype=F64)
    both = proma_settings(mode="both", intra_dim=3, intra_shrinkage=0.5, intra_target="accumulated")
    step = proma_layer_step(X, G, mask, A, both, running=S, sketches=sk)
    S1 = S - 0.5 * (Pg @ S @ Pa)
    P = oracle_fit(V, S1, 1e-2).view_as(S)
    want = [1.0, S1.norm().item(), (P.norm() / S1.norm()).item(), 1.0, 100 * (1 - ((S1 - P).norm() / S1.norm()).item()),
            3.0, ((Pg @ S @ Pa).norm() / S.norm()).item(), 100 * (1 - (S1.norm() / S.norm()).item())]
    assert torch.allclose(step.metrics.double(), torch.tensor(want, dtype=F64), rtol=1e-5)
    # both, on the micro-batch gradient: the intra metrics describe G_m, not the increment G~_m - s kappa P
    both = proma_settings(mode="both", intra_dim=3, intra_shrinkage=0.5)
    step = proma_layer_step(X, G, mask, A, both, running=S, sketches=sk)
    want = [(PiG.norm() / Gm.norm()).item(), 100 * (1 - ((Gm - 0.5 * PiG).norm() / Gm.norm()).item())]
    assert torch.allclose(step.metrics[6:].double(), torch.tensor(want, dtype=F64), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_intra_against_the_float64_oracle(dtype):
    """Half operands are upcast chunk by chunk (budget of one row): float32 bases and cores."""
    X, G, mask, A, _ = micro_batch(d_in=16, d_out=24, L=10, seed=14)
    Xr, Gr = X.to(dtype), G.to(dtype)
    sk = sketches_for(X, G, 4, seed=3)
    basis = factored_basis(Xr, Gr, mask, 4, 1, sketches=sk, budget_bytes=1)
    Pa, Pg = oracle_projectors(Xr.double(), Gr.double(), mask, sk, 1)
    assert basis.Q_a.dtype == torch.float32
    assert_matches(basis.Q_a @ basis.Q_a.T, Pa, 1e-5)
    assert_matches(basis.Q_g @ basis.Q_g.T, Pg, 1e-5)


def test_intra_on_each_micro_batch_keeps_no_running_gradient():
    """The default intra target never reads S: the backward keeps no full-size copy per layer, the increments are
    unchanged, and every other setting still keeps S."""
    assert not proma_settings(mode="intra").needs_running
    assert all(proma_settings(mode=m, intra_target=t).needs_running
               for m, t in [("accumulation", "microbatch"), ("both", "microbatch"), ("intra", "accumulated"),
                            ("intra", "accumulated_after")])
    settings = proma_settings(mode="intra", intra_dim=3)
    S = None
    for j, (X, G, mask, A, _) in enumerate(chain_batches(M=3, seed=40)):
        sk = sketches_for(X, G, 3, seed=j)
        kept = proma_layer_step(X, G, mask, A, settings, running=S, sketches=sk, has_bias=True)
        light = proma_layer_step(X, G, mask, A, settings, running=None, sketches=sk, has_bias=True,
                                 keep_running=False)
        assert light.running is None and light.running_bias is None
        assert torch.equal(light.grad_weight, kept.grad_weight) and torch.equal(light.grad_bias, kept.grad_bias)
        S = kept.running


def test_core_from_the_materialized_gradient_equals_the_sequence_cores():
    """Intra alone projects G_m through Q_g^T G_m Q_a, computed from the GEMM's result instead of the per-sequence
    cores sum_i A_i C_i that accumulation needs: the same k x k core (float64)."""
    from trl_isopo.proma.intra import core_of, sequence_cores

    X, G, mask, A, V = micro_batch(d_in=7, d_out=5, seed=3, pad="g_zero")
    basis = factored_basis(X, G, mask, 3, 1, sketches=sketches_for(X, G, 3, seed=1))
    lean = factored_basis(X, G, mask, 3, 1, sketches=sketches_for(X, G, 3, seed=1), rows=False)
    assert lean.xq is None and lean.dq is None and torch.equal(lean.Q_a, basis.Q_a)
    G_m = torch.einsum("b,boi->oi", A, V)
    assert_matches(core_of(lean, G_m), torch.einsum("b,bij->ij", A, sequence_cores(basis)), 1e-12)


def graded_rows(n, d, rank, smallest, seed):
    """(n, d) float64 rows of rank `rank` with singular values log-spaced from 1 down to `smallest`."""
    g = torch.Generator().manual_seed(seed)
    U = torch.linalg.qr(torch.randn(n, rank, generator=g, dtype=F64))[0]
    W = torch.linalg.qr(torch.randn(d, rank, generator=g, dtype=F64))[0]
    return U @ torch.diag(torch.logspace(0, torch.log10(torch.tensor(smallest)), rank, dtype=F64)) @ W.T


@pytest.mark.parametrize("power_iters", [0, 1, 2])
def test_float32_bases_resolve_what_float64_does_at_full_rank(power_iters):
    """k >= rank(X), rank(D): the projector holds the whole micro-batch gradient, so G_m - Pi(G_m) = 0 up to
    rounding. Singular values down to 1e-3 of the largest, above the column-drop threshold (`rank_rtol`, 1.2e-4 in
    float32): the float32 residual stays within 1e-5 of G_m (float64: 1e-12) for any number of power iterations, as
    each power step re-orthonormalizes after X and after X^T (its sketch scales like sigma, not sigma^2). Without
    that, q >= 1 dropped every direction below about 1e-2 in float32."""
    B, L, rank = 4, 16, 10
    X = graded_rows(B * L, 24, rank, 1e-3, seed=0).reshape(B, L, 24)
    D = graded_rows(B * L, 20, rank, 1e-3, seed=1).reshape(B, L, 20)
    mask = torch.ones(B, L, dtype=torch.bool)
    Gm = torch.einsum("blo,bli->oi", D, X)
    sketches = draw_sketches(B * L, 12, torch.Generator().manual_seed(2), F64, X.device)
    for dtype, tol in ((F64, 1e-12), (torch.float32, 1e-5)):
        basis = factored_basis(X.to(dtype), D.to(dtype), mask, 12, power_iters, sketches=sketches, rows=False)
        assert basis.rank.item() == rank, dtype
        residual = Gm - project(basis, Gm.to(dtype)).to(F64)
        assert residual.norm() <= tol * Gm.norm(), (dtype, float(residual.norm() / Gm.norm()))
