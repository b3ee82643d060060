"""Accumulation PROMA (arXiv 2601.10498 v4 §2) against the float64 oracle, plus the limits and invariances that
follow from its math. The oracle and the micro-batch builder are in tests/proma_oracle.py."""

import pytest
import torch
from proma_oracle import F64, SHAPES, assert_matches, chain_batches, flat, micro_batch, oracle_fit, oracle_step, unit

from trl_isopo.proma import proma_layer_step
from math_settings import proma_settings
from trl_isopo.proma.accumulation import gram_schmidt_coefficients, normalized_kernel, running_overlaps

KNOBS = {
    "s=1": dict(),
    "s=0.5,beta=0.3": dict(shrinkage=0.5, relative_bound=0.3),
    "ridge=0.3": dict(ridge=0.3),
    "gram_schmidt": dict(solver="gram_schmidt", sweeps=2),
    "gram_schmidt,5": dict(solver="gram_schmidt", sweeps=5, shrinkage=0.7),
}


def run_chain(batches, settings, *, scale=1.0, adv_scale=1.0, order=None, **step_kw):
    """Feed micro-batches through proma_layer_step; returns [S_1, ..., S_M] and the metrics."""
    S, out, metrics = None, [], []
    for j in order or range(len(batches)):
        X, G, mask, A, _ = batches[j]
        step = proma_layer_step(X * scale, G, mask, A * adv_scale, settings, running=S, **step_kw)
        if S is not None:
            assert_matches(step.running, S + step.grad_weight, 1e-14)
        S = step.running
        out.append(S)
        metrics.append(step.metrics)
    return out, metrics


def oracle_chain(batches, order=None, **kw):
    S, out = None, []
    for j in order or range(len(batches)):
        S = oracle_step(batches[j][4], batches[j][3], S, **kw)
        out.append(S)
    return out


def oracle_knobs(knobs):
    return dict(s=knobs.get("shrinkage", 1.0), lam=knobs.get("ridge", 1e-2), solver=knobs.get("solver", "solve"),
                sweeps=knobs.get("sweeps", 2), bound=knobs.get("relative_bound"))


@pytest.mark.parametrize("knobs", KNOBS.values(), ids=KNOBS.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("route", ["gram", "mat"])
def test_chain_matches_oracle(knobs, shape, route):
    batches = chain_batches(M=4, d_in=shape[0], d_out=shape[1], pad="x_zero" if route == "gram" else "g_zero")
    got, metrics = run_chain(batches, proma_settings(route=route, **knobs))
    want = oracle_chain(batches, **oracle_knobs(knobs))
    for g, w in zip(got, want):
        assert_matches(g, w)
    if knobs.get("relative_bound") is not None:  # the bound must actually have clipped somewhere
        assert min(m[3].item() for m in metrics[1:]) < 1.0


def test_bias_is_projected_as_its_own_tensor():
    """Accumulation PROMA per parameter tensor: the bias on its per-sequence gradients sum_{t in T_i} delta_t."""
    batches = chain_batches(M=3)
    S = Sb = None
    Sb_want = None
    for X, G, mask, A, V in batches:
        step = proma_layer_step(X, G, mask, A, proma_settings(relative_bound=0.4), running=S, running_bias=Sb,
                                has_bias=True)
        S, Sb = step.running, step.running_bias
        vb = torch.where(mask.unsqueeze(-1), G, 0.0).sum(1)  # (B, d_out)
        Sb_want = oracle_step(vb.unsqueeze(-1), A, None if Sb_want is None else Sb_want.unsqueeze(-1),
                              bound=0.4).squeeze(-1)
        assert_matches(Sb, Sb_want)


def test_lambda_to_zero_gives_the_orthogonal_projection():
    batches = chain_batches(M=3, seed=5)
    got, _ = run_chain(batches, proma_settings(ridge=1e-13))
    for j in (1, 2):
        V = batches[j][4]
        G = torch.einsum("b,boi->oi", batches[j][3], V)
        kept = got[j] - G  # S_{j-1} - P_j
        assert_matches(kept.reshape(-1), got[j - 1].reshape(-1) - oracle_fit(V, got[j - 1], solver="exact"), 1e-8)
        cos = (flat(V) @ kept.reshape(-1)) / (flat(V).norm(dim=1) * kept.norm())
        assert cos.abs().max() < 1e-9  # S - P is orthogonal to every V_i of the micro-batch


@pytest.mark.parametrize("knobs", [dict(ridge=1e12), dict(shrinkage=0.0), dict(relative_bound=0.0)],
                         ids=["ridge->inf", "s=0", "beta=0"])
def test_limits_that_reduce_to_plain_accumulation(knobs):
    batches = chain_batches(M=3, seed=2)
    got, _ = run_chain(batches, proma_settings(**knobs))
    plain = sum(torch.einsum("b,boi->oi", A, V) for _, _, _, A, V in batches)
    assert_matches(got[-1], plain, 1e-10)


def test_gram_schmidt_never_increases_the_norm_and_tends_to_the_projection():
    """Equi-correlated sequences (K^ has an eigenvalue far above 2): sequential sweeps stay non-expansive and
    converge to the lam = 0 projection; the reference's later vectorized sweeps amplify S (the ported form's
    contrast)."""
    g = torch.Generator().manual_seed(0)
    B, d = 6, 40
    common = torch.randn(d, generator=g, dtype=F64)
    Vf = common + 0.6 * torch.randn(B, d, generator=g, dtype=F64)
    V = Vf.view(B, 5, 8)
    S = torch.randn(5, 8, generator=g, dtype=F64) + 2 * common.view(5, 8)
    e, Kh = normalized_kernel(flat(V) @ flat(V).T)
    assert torch.linalg.eigvalsh(Kh).max() > 2
    bh = (unit(V) @ S.reshape(-1))
    exact = oracle_fit(V, S, solver="exact")
    errors = []
    for sweeps in (1, 2, 3, 5, 10, 40, 400):
        w = gram_schmidt_coefficients(Kh, bh, sweeps)
        P = unit(V).T @ w
        assert_matches(P, oracle_fit(V, S, solver="gram_schmidt", sweeps=sweeps))
        assert (S.reshape(-1) - P).norm() <= S.norm() * (1 + 1e-12)
        errors.append(((P - exact).norm() / exact.norm()).item())
    assert all(b <= a * (1 + 1e-12) for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-8 < errors[0]
    assert (S.reshape(-1) - oracle_fit(V, S, solver="vectorized")).norm() > S.norm()


def test_permuting_sequences_within_a_micro_batch():
    batches = chain_batches(M=3, seed=9)
    perm = torch.tensor([2, 0, 3, 1])
    shuffled = [(X[perm], G[perm], mask[perm], A[perm], V[perm]) for X, G, mask, A, V in batches]
    got, _ = run_chain(batches, proma_settings())
    got_p, _ = run_chain(shuffled, proma_settings())
    assert_matches(got_p[-1], got[-1], 1e-12)  # the exact solve is order-free within a micro-batch
    gs = proma_settings(solver="gram_schmidt")
    got_gs, _ = run_chain(batches, gs)
    got_gs_p, _ = run_chain(shuffled, gs)
    assert ((got_gs_p[-1] - got_gs[-1]).norm() / got_gs[-1].norm()) > 1e-6  # sequential sweeps are not
    assert_matches(got_gs_p[-1], oracle_chain(shuffled, solver="gram_schmidt")[-1])


def test_micro_batch_order_matters_and_matches_the_oracle_for_each_order():
    batches = chain_batches(M=4, seed=4)
    order = [3, 1, 0, 2]
    got, _ = run_chain(batches, proma_settings(), order=order)
    assert_matches(got[-1], oracle_chain(batches, order=order)[-1])
    assert ((got[-1] - run_chain(batches, proma_settings())[0][-1]).norm() / got[-1].norm()) > 1e-6


@pytest.mark.parametrize("k", [1e-7, 3e5])
@pytest.mark.parametrize("solver", ["solve", "gram_schmidt"])
def test_common_scale_on_every_gradient_scales_the_result(k, solver):
    """No absolute epsilon: V -> k V (inputs scaled) gives S_m -> k S_m; so do advantages -> k A."""
    batches = chain_batches(M=3, seed=6)
    settings = proma_settings(solver=solver, relative_bound=0.5)
    base, _ = run_chain(batches, settings)
    scaled, _ = run_chain(batches, settings, scale=k)
    assert_matches(scaled[-1] / k, base[-1], 1e-12)
    adv, _ = run_chain(batches, settings, adv_scale=k)
    assert_matches(adv[-1] / k, base[-1], 1e-12)


def test_exact_zeros_give_no_nan():
    """An empty sequence (V_i = 0), S = 0, a zero-advantage micro-batch and an all-empty micro-batch."""
    X, G, mask, A, V = micro_batch(empty_row=True)
    zeroA = torch.zeros_like(A)
    for settings in (proma_settings(relative_bound=0.5), proma_settings(solver="gram_schmidt")):
        S = torch.zeros(V.shape[1:], dtype=F64)
        step = proma_layer_step(X, G, mask, A, settings, running=S, has_bias=True)
        assert torch.isfinite(step.metrics).all() and torch.isfinite(step.grad_weight).all()
        assert_matches(step.grad_weight, torch.einsum("b,boi->oi", A, V), 1e-12)
        step2 = proma_layer_step(X, G, mask, zeroA, settings, running=step.running)
        assert torch.isfinite(step2.running).all()
        nothing = proma_layer_step(X * 0, G, torch.zeros_like(mask), A, settings, running=step.running)
        assert nothing.grad_weight.abs().max() == 0 and torch.isfinite(nothing.metrics).all()
    # without the bound a zero-advantage micro-batch still projects S; with beta it adds nothing and projects nothing
    S1 = proma_layer_step(X, G, mask, A, proma_settings(), running=None).running
    free = proma_layer_step(X, G, mask, zeroA, proma_settings(), running=S1).running
    bounded = proma_layer_step(X, G, mask, zeroA, proma_settings(relative_bound=0.5), running=S1).running
    assert_matches(bounded, S1, 1e-14)
    assert_matches(free, S1 - oracle_fit(V, S1, 1e-2).view_as(S1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_failed_solve_leaves_the_micro_batch_unprojected(bad):
    """A non-finite kernel (overflowing statistics) makes the Cholesky solve fail on the device: the coefficients
    fall back to A (plain accumulation for this layer and micro-batch), never NaN."""
    from trl_isopo.proma import accumulation_coefficients

    K = torch.eye(3, dtype=F64)
    K[0, 1] = K[1, 0] = bad
    A = torch.tensor([0.5, -1.0, 2.0], dtype=F64)
    co = accumulation_coefficients(K, torch.ones(3, dtype=F64), A, shrinkage=1.0, ridge=1e-2)
    assert torch.equal(co.coefficients, A)


def test_negative_control_plain_accumulation_fails_the_oracle():
    batches = chain_batches(M=4)
    want = oracle_chain(batches)[-1]
    plain = sum(torch.einsum("b,boi->oi", A, V) for _, _, _, A, V in batches)
    with pytest.raises(AssertionError):
        assert_matches(plain, want)


def test_skip_gate_leaves_early_micro_batches_unprojected():
    from trl_isopo.proma import PROMALayerState, projection_active

    assert [projection_active(j, 4, 0.5) for j in range(4)] == [False, False, True, True]
    assert [projection_active(j, 3, 0.0) for j in range(3)] == [True] * 3
    batches = chain_batches(M=4, seed=8)
    state = PROMALayerState()
    for j, (X, G, mask, A, _) in enumerate(batches):
        step = proma_layer_step(X, G, mask, A, proma_settings(), running=state.weight, running_bias=state.bias,
                                has_bias=True, active=projection_active(j, 4, 0.5))
        state.update(step)
        assert step.metrics[0].item() == float(j >= 2)
    S = state.weight
    state.reset()
    assert state.weight is None and state.bias is None
    S_want = oracle_step(batches[0][4], batches[0][3], None)
    S_want = S_want + torch.einsum("b,boi->oi", batches[1][3], batches[1][4])
    for X, G, mask, A, V in batches[2:]:
        S_want = oracle_step(V, A, S_want)
    assert_matches(S, S_want)


def test_metrics_match_dense_norms():
    batches = chain_batches(M=2, seed=1)
    S1 = oracle_step(batches[0][4], batches[0][3], None)
    X, G, mask, A, V = batches[1]
    step = proma_layer_step(X, G, mask, A, proma_settings(shrinkage=0.6, relative_bound=0.2), running=S1)
    P = oracle_fit(V, S1, 1e-2)
    Gm = torch.einsum("b,boi->oi", A, V)
    kappa = min(1.0, (0.2 * Gm.norm() / P.norm()).item())
    reduction = 100 * (1 - (S1.reshape(-1) - 0.6 * kappa * P).norm() / S1.norm())
    want = [1.0, S1.norm().item(), kappa * (P.norm() / S1.norm()).item(), kappa, reduction.item()]
    assert kappa < 1
    assert torch.allclose(step.metrics[:5].double(), torch.tensor(want, dtype=F64), rtol=1e-5)


@pytest.mark.parametrize("budget", [1, 10**9])
def test_running_overlaps_without_materializing(budget):
    for d_in, d_out in SHAPES.values():
        X, G, mask, A, V = micro_batch(d_in=d_in, d_out=d_out, seed=11)
        S = torch.randn(d_out, d_in, dtype=F64)
        want = flat(V) @ S.reshape(-1)
        assert_matches(running_overlaps(X, G, S, budget_bytes=budget), want, 1e-12)
        assert_matches(running_overlaps(X, G, S, V=V), want, 1e-12)


@pytest.mark.parametrize("fisher", [False, True])  # with a Fisher sample and d_out > d_in, V is stored transposed
@pytest.mark.parametrize("budget", [1, 10**9])  # V in chunks of one output row / V kept whole
def test_overlaps_summed_in_the_statistics_loop(budget, fisher):
    """<V_i, S> from the "mat" route's chunk loop equals the per-sequence gradients' inner products; "gram" has none."""
    from trl_isopo.layerwise.statistics import sequence_statistics

    for d_in, d_out in SHAPES.values():
        X, G, mask, A, V = micro_batch(d_in=d_in, d_out=d_out, seed=12)
        S = torch.randn(d_out, d_in, dtype=F64)
        sample = torch.arange(5) if fisher else None
        st = sequence_statistics(X, G, sample, fisher, True, "mat", budget, overlap_with=S)
        assert (st.V is None) == (budget == 1)
        assert_matches(st.overlaps, flat(V) @ S.reshape(-1), 1e-12)
        assert sequence_statistics(X, G, sample, fisher, True, "gram", budget, overlap_with=S).overlaps is None


def test_chain_with_v_in_chunks_matches_oracle():
    """V too large for the budget (formed chunk by chunk, not kept): the overlaps come from the chunk loop."""
    for d_in, d_out in SHAPES.values():
        batches = chain_batches(M=3, d_in=d_in, d_out=d_out, pad="g_zero")
        got, _ = run_chain(batches, proma_settings(route="mat", budget_bytes=1))
        for g, w in zip(got, oracle_chain(batches, **oracle_knobs({}))):
            assert_matches(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_operands_against_the_float64_oracle(dtype):
    """Half / float32 operands: float32 statistics, running gradient and projections; the oracle gets the same
    rounded operands in float64. float32 agrees to 1e-5. For bf16 on CPU the final GEMM (as autograd's own weight
    gradient of a bf16 layer) is rounded to bf16 once per micro-batch: the error stays within 3x that of plain bf16
    accumulation of the same micro-batch gradients."""
    batches = chain_batches(M=3, seed=12, d_in=16, d_out=24)
    rounded = []
    for X, G, mask, A, V in batches:
        Xr, Gr = X.to(dtype), G.to(dtype)
        m = mask.unsqueeze(-1)
        Vr = torch.einsum("blo,bli->boi", torch.where(m, Gr.double(), 0.0), torch.where(m, Xr.double(), 0.0))
        rounded.append((Xr, Gr, mask, A, Vr))
    got, _ = run_chain(rounded, proma_settings(relative_bound=0.5))
    assert got[-1].dtype == torch.float32
    want = oracle_chain(rounded, bound=0.5)[-1]
    if dtype == torch.float32:
        assert_matches(got[-1], want, 1e-5)
        return
    plain = sum(proma_layer_step(X, G, mask, A, proma_settings(), active=False).grad_weight.double()
                for X, G, mask, A, _ in rounded)
    plain_want = sum(torch.einsum("b,boi->oi", A, V) for _, _, _, A, V in rounded)
    plain_err = ((plain - plain_want).norm() / plain_want.norm()).item()
    err = ((got[-1].double() - want).norm() / want.norm()).item()
    assert 0 < plain_err and err <= 3 * plain_err, (err, plain_err)
