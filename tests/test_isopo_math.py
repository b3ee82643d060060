"""Pure-function tests: routes vs explicit per-sequence gradients, regularizer, interacting limits, EMA closed form."""

import math

import pytest
import torch

from trl_isopo.isopo.ema import EMAStatistics
from trl_isopo.isopo.reweight import (
    interacting_coefficients,
    isopo_sequence_scales,
    regularized_magnitude,
)
from trl_isopo.layerwise import costs, statistics
from trl_isopo.layerwise.costs import route_costs
from trl_isopo.layerwise.statistics import sequence_statistics
from trl_isopo.layerwise.weight_grad import reweighted_weight_grad


def random_layer(B, L, d_in, d_out, seed, single_token_row=True):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) > 0.3
    if single_token_row:
        mask[0] = False
        mask[0, L // 2] = True  # a sequence with a single valid token
    mask[-1] = True
    X = torch.randn(B, L, d_in, generator=g, dtype=torch.float64) * mask[..., None]
    G = torch.randn(B, L, d_out, generator=g, dtype=torch.float64) * mask[..., None]
    return X, G, mask


def explicit(X, G, sample):
    V = torch.einsum("blo,bli->boi", G, X)  # V_i = G_i^T X_i, one per sequence
    Xf, Gf = X.reshape(-1, X.shape[-1]), G.reshape(-1, G.shape[-1])
    u = torch.einsum("jo,boi,ji->bj", Gf[sample], V, Xf[sample])
    K = V.reshape(V.shape[0], -1) @ V.reshape(V.shape[0], -1).T
    return V, (u * u).sum(1), K


@pytest.mark.parametrize("shape", [(4, 9, 5, 7), (3, 6, 11, 2), (5, 4, 3, 13), (2, 12, 8, 8)])
@pytest.mark.parametrize("route", ["gram", "mat"])
# 256 bytes forces chunking everywhere; "mid": chunks of d_in + 1 output rows of V, which on layers with d_out > d_in + 1
# takes the transposed V layout of the Fisher contraction through several chunks and a remainder.
@pytest.mark.parametrize("budget", [2**30, 256, "mid"])
@pytest.mark.parametrize("tiny_blocks", [False, True])
def test_routes_match_explicit(shape, route, budget, tiny_blocks, monkeypatch):
    if tiny_blocks:  # several triangular Gram row blocks and blocked V V^T sums, with remainders, at test sizes
        monkeypatch.setattr(statistics, "TRI_ROWS", 2)
        monkeypatch.setattr(statistics, "ROW_GRAM_BLOCK", 4)
    B, L, d_in, d_out = shape
    S = -(-5 // costs.SAMPLE_MULTIPLE) * costs.SAMPLE_MULTIPLE  # the 5-token sample, zero-padded
    if budget == "mid":
        budget = B * (d_in + S) * 8 * (d_in + 1)  # `_mat`'s bytes per output row of V, times d_in + 1 rows
    X, G, mask = random_layer(B, L, d_in, d_out, seed=sum(shape))
    valid = mask.reshape(-1).nonzero().squeeze(1)
    sample = valid[torch.randperm(valid.numel(), generator=torch.Generator().manual_seed(0))[:5]]
    V, num, K = explicit(X, G, sample)
    st = sequence_statistics(X, G, sample, fisher=True, ntk=True, route=route, budget_bytes=budget, bias=True)
    assert torch.allclose(st.e2, V.pow(2).sum((1, 2)), rtol=1e-12, atol=1e-12)
    assert torch.allclose(st.fisher_num, num, rtol=1e-12, atol=1e-12)
    assert torch.allclose(st.ntk, K, rtol=1e-12, atol=1e-12)
    st2 = sequence_statistics(X, G, sample, fisher=True, ntk=False, route=route, budget_bytes=budget, bias=True)
    assert torch.allclose(st2.e2, V.pow(2).sum((1, 2)), rtol=1e-12, atol=1e-12)
    w = torch.randn(B, dtype=torch.float64)
    gw, gb = reweighted_weight_grad(X, G, w, st2)
    assert torch.allclose(gw, torch.einsum("b,boi->oi", w, V), rtol=1e-12, atol=1e-12)
    assert torch.allclose(gb, torch.einsum("b,blo->o", w, G), rtol=1e-12, atol=1e-12)
    # The materialized route keeps V only when it fits the budget; the result is the same either way.
    assert (st2.V is not None) == (route == "mat" and B * d_out * (d_in + S) * 8 <= budget)



@pytest.mark.parametrize("masked", ["X", "G"])
@pytest.mark.parametrize("route", ["gram", "mat"])
@pytest.mark.parametrize("budget", [2**30, 256])
def test_routes_need_only_one_masked_operand(masked, route, budget):
    """The trainer zeroes padding in one operand only; the other carries finite garbage there (never NaN: autograd's
    own G^T X would be NaN too). Reused scratch storage (a buffer from an earlier, larger layer) changes nothing."""
    from trl_isopo.layerwise.scratch import Scratch

    B, L, d_in, d_out = 4, 9, 6, 10
    X, G, mask = random_layer(B, L, d_in, d_out, seed=3)
    sample = mask.reshape(-1).nonzero().squeeze(1)[:7]
    V, num, K = explicit(X, G, sample)
    g = torch.Generator().manual_seed(9)
    pad = ~mask[..., None]
    Xg = X + pad * 1e3 * torch.randn(X.shape, generator=g, dtype=X.dtype) if masked == "G" else X
    Gg = G + pad * 1e3 * torch.randn(G.shape, generator=g, dtype=G.dtype) if masked == "X" else G
    scratch = Scratch()
    scratch.get("V", (B, 3 * d_out, d_in), X.dtype, X.device).fill_(float("nan"))  # stale, larger
    for ntk in (True, False):
        st = sequence_statistics(Xg, Gg, sample, fisher=True, ntk=ntk, route=route, budget_bytes=budget, bias=True,
                                 mask=mask, scratch=scratch)
        assert torch.allclose(st.e2, V.pow(2).sum((1, 2)), rtol=1e-12, atol=1e-12)
        assert torch.allclose(st.fisher_num, num, rtol=1e-12, atol=1e-12)
        if ntk:
            assert torch.allclose(st.ntk, K, rtol=1e-12, atol=1e-12)
        w = torch.randn(B, dtype=torch.float64, generator=g)
        gw, gb = reweighted_weight_grad(Xg, Gg, w, st)
        assert torch.allclose(gw, torch.einsum("b,boi->oi", w, V), rtol=1e-12, atol=1e-12)
        assert torch.allclose(gb, torch.einsum("b,blo->o", w, G), rtol=1e-12, atol=1e-12)
    # Negative control: without the mask the bias sums pick up the padding garbage of G.
    if masked == "X":
        st = sequence_statistics(Xg, Gg, sample, fisher=False, ntk=False, route=route, bias=True)
        assert not torch.allclose(st.bias_per_seq, G.sum(1))

def test_route_costs_pick_mat_for_lora_and_gram_for_wide_layers():
    # LoRA A (896 -> 16): materializing is tiny; a 896 -> 4864 MLP at 8 x 256 tokens: Gram blocks are cheaper.
    assert route_costs(8, 256, 896, 16, 250, fisher=True, ntk=False).best == "mat"
    assert route_costs(8, 256, 896, 4864, 250, fisher=True, ntk=False).best == "gram"
    # Interacting needs only K: B^2 d_in d_out is far below the (B L)^2 token Gram.
    assert route_costs(8, 256, 896, 4864, 0, fisher=False, ntk=True).best == "mat"


@pytest.mark.parametrize("variant", ["p", "q", "pqr", "interacting"])
@pytest.mark.parametrize("route", ["gram", "mat", "mat_chunked"])
@pytest.mark.parametrize("shape", [(48, 8, False), (8, 48, True), (40, 56, False)])
def test_route_costs_count_the_gemms_layer_grads_runs(variant, route, shape):
    """The benchmark's analytic floor is route_costs: it must price the multiply-accumulates ISOPO really runs.
    torch's FlopCounterMode counts every mm / bmm of one `layer_grads` call; minus autograd's own weight GEMM (which
    ISOPO replaces) that is `gemm_macs`: route_costs' arithmetic (no per-float streaming charge) less its one
    non-GEMM term, the e^2 reduction over V on "mat", plus the bias products."""
    from dataclasses import replace

    from torch.utils.flop_counter import FlopCounterMode

    from math_settings import isopo_settings
    from trl_isopo.isopo.isopo_backward import ISOPOBackward
    from trl_isopo.layerwise.micro_batch import MicroBatch

    d_in, d_out, bias = shape
    B, L, k = 8, 64, 50
    settings = {"p": isopo_settings(p=-1.0), "q": isopo_settings(p=0.0, q=-1.0),
                "pqr": isopo_settings(p=-1.0, q=-0.5, r=-0.5), "interacting": isopo_settings(interacting=True)}[variant]
    S = costs.gathered_rows(k) if settings.needs_fisher else 0  # the sample as gathered (zero-padded)
    budget = B * d_out * (d_in + S) * 4 - 1 if route == "mat_chunked" else costs.DEFAULT_BUDGET_BYTES  # V won't fit
    settings = replace(settings, fisher_tokens=k, route=route.split("_")[0], budget_bytes=budget)
    g = torch.Generator().manual_seed(d_in + d_out)
    mask = torch.rand(B, L, generator=g) > 0.1
    x, gr = torch.randn(B, L, d_in, generator=g), torch.randn(B, L, d_out, generator=g)
    ctx = ISOPOBackward(settings)
    with FlopCounterMode(display=False) as counter:
        ctx.layer_grads("layer", x, gr, MicroBatch(mask=mask, advantages=torch.randn(B, generator=g)), bias)
    counted = counter.get_total_flops() / 2 - B * L * d_in * d_out
    assert counted == costs.gemm_macs(B, L, d_in, d_out, S, settings.needs_fisher, settings.interacting, budget,
                                       settings.route, euclidean=settings.needs_euclidean, bias=bias)
    # Closed forms, the bias products aside: the Fisher contraction and the final sum over sequences (V kept), or
    # the final sum as a second weight-gradient GEMM (V chunked); the Fisher numerator's token Gram blocks ("gram").
    counted -= B * (L + 1) * d_out if bias else 0
    if variant == "p":
        assert counted == {"mat": B * S * d_in * d_out + B * d_in * d_out,
                           "mat_chunked": B * S * d_in * d_out + B * L * d_in * d_out,
                           "gram": B * L * S * (d_in + d_out)}[route]


def test_regularized_magnitude():
    x = torch.tensor([0.0, 1e-6, 3.0, 100.0], dtype=torch.float64)
    assert torch.equal(regularized_magnitude(x, 4.0, 0.0), x)
    R = regularized_magnitude(x, 4.0, 1.0)
    assert torch.allclose(R, torch.sqrt(x**2 / (4.0 + 1e-8) + 1))
    assert R[0] == 1.0 and abs(R[1] - 1.0) < 1e-12  # small norms untouched ("keep small invariant")
    assert R[3] == pytest.approx(100.0 / 2.0, rel=1e-3)  # large norms normalized by sqrt(c mu)
    with pytest.raises(ValueError):
        regularized_magnitude(x, 1.0, -1.0)


def test_scales_closed_forms():
    e = torch.tensor([2.0, 4.0], dtype=torch.float64)
    f = torch.tensor([1.0, 0.5], dtype=torch.float64)
    rho = f / e
    mu = {"e": 1.0, "f": 1.0, "rho": 1.0}
    # p=-1, c=0: 1/f
    assert torch.allclose(isopo_sequence_scales(e, f, rho, mu, -1.0, 0.0, 0.0, 0.0), 1 / (f + 1e-8))
    # q=-1, c=0: 1/e
    assert torch.allclose(isopo_sequence_scales(e, None, None, mu, 0.0, -1.0, 0.0, 0.0), 1 / (e + 1e-8))
    # Fig. 6: p=0, q=-1, r=-2, c=0 -> e / f^2
    s = isopo_sequence_scales(e, f, rho, mu, 0.0, -1.0, -2.0, 0.0)
    assert torch.allclose(s, e / f**2, rtol=1e-6)  # up to the +1e-8 guard
    # all exponents zero: scales are 1
    assert torch.allclose(isopo_sequence_scales(e, f, rho, mu, 0.0, 0.0, 0.0, 1.0), torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError):
        isopo_sequence_scales(e, None, None, mu, -1.0, 0.0, 0.0, 0.0)


def test_interacting_limits():
    g = torch.Generator().manual_seed(0)
    J = torch.randn(5, 40, generator=g, dtype=torch.float64)
    K = J @ J.T
    A = torch.randn(5, generator=g, dtype=torch.float64)
    # lam -> infinity: REINFORCE (all coefficients A)
    assert torch.allclose(interacting_coefficients(K, A, 1e12), A, rtol=1e-8)
    # alpha / lam -> K^-1 A as lam -> 0
    lam = 1e-9
    assert torch.allclose(interacting_coefficients(K, A, lam) / lam, torch.linalg.solve(K, A), rtol=1e-5)
    # generic lam: the reference's eigendecomposition form U diag(lam / (D + lam + 1e-8)) U^T A (an independent
    # route: the implementation solves by Cholesky), with lam as a float and as a 0-dim tensor
    lam = 3.7
    D, U = torch.linalg.eigh(K)
    want = U @ (lam / (D + lam + 1e-8) * (U.T @ A))
    assert torch.allclose(interacting_coefficients(K, A, lam), want, rtol=1e-12)
    assert torch.allclose(interacting_coefficients(K.float(), A.float(), torch.tensor(lam)), want, rtol=1e-5)
    # zero kernel (e.g. LoRA's lora_A at step 0): finite coefficients, also for lam = 0 (no history, trace K = 0):
    # the REINFORCE limit alpha = A (they multiply zero gradients); no absolute guard, so degree 0 in (K, lam)
    Z = torch.zeros(5, 5, dtype=torch.float64)
    assert torch.equal(interacting_coefficients(Z, A, 0.0), A)
    assert torch.equal(interacting_coefficients(Z, A, torch.tensor(0.0)), A)
    base = interacting_coefficients(K, A, lam)
    for k in (1e-8, 1e4):
        torch.testing.assert_close(interacting_coefficients(K * k * k, A, lam * k * k), base, rtol=1e-10, atol=0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_interacting_coefficients_non_finite_kernel_gives_nan_not_an_error(bad):
    # eigh raises on such input; the Cholesky solve reports failure through `info`, without a host sync, and the
    # coefficients come back NaN (the layer then drops them, see test_isopo_trainer).
    K = torch.eye(4, dtype=torch.float64)
    K[1, 2] = K[2, 1] = bad
    alpha = interacting_coefficients(K, torch.ones(4, dtype=torch.float64), 1.0)
    assert alpha.shape == (4,) and torch.isnan(alpha).all()
    # not positive definite even after the shift (an eigenvalue below -lam): NaN, not an unbounded solve
    alpha = interacting_coefficients(-3 * torch.eye(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64), 1.0)
    assert torch.isnan(alpha).all()


def test_ema_closed_form_over_steps():
    ema = EMAStatistics(decay=0.9)
    steps = [[1.0, 3.0], [2.0, 2.0, 8.0], [0.5]]  # values appended over (possibly several) micro-batches
    assert torch.equal(torch.as_tensor(ema.mu("l", "f", torch.tensor([7.0]))), torch.tensor([7.0]))  # no history
    expected = None
    for vals in steps:
        half = len(vals) // 2  # two micro-batches per step
        ema.accumulate("l", "f", torch.tensor(vals[:half]))
        ema.accumulate("l", "f", torch.tensor(vals[half:]))
        cur = sum(vals) / len(vals)
        expected = cur if expected is None else 0.9 * expected + 0.1 * cur
        ema.end_step()
        assert ema.ema["l/f"] == pytest.approx(expected, rel=1e-15)
        assert ema.mu("l", "f", torch.tensor([123.0])) == pytest.approx(expected, rel=1e-15)
    state = ema.state_dict()
    other = EMAStatistics(0.5)
    other.load_state_dict(state)
    assert other.ema == ema.ema and other.decay == 0.5  # the configured decay wins over the checkpoint's


def test_ema_skips_zero_and_nonfinite_step_means():
    """A zero step mean (e.g. lora_A while lora_B = 0) or an overflow must not poison the regularizer."""
    ema = EMAStatistics(0.9)
    ema.accumulate("l", "f", torch.zeros(4))
    ema.end_step()
    assert "l/f" not in ema.ema and ema.skipped == 1  # still "no history": the next step self-normalizes
    ema.accumulate("l", "f", torch.tensor([2.0, 4.0]))
    ema.end_step()
    assert ema.ema["l/f"] == 3.0
    for bad in (float("inf"), float("nan")):
        ema.accumulate("l", "f", torch.tensor([1.0, bad]))
        ema.end_step()
        assert ema.ema["l/f"] == 3.0
    assert ema.skipped == 3


def test_ema_all_reduce_averages_over_processes():
    ema = EMAStatistics(0.9)
    ema.accumulate("l", "e", torch.tensor([1.0, 3.0]))  # this rank: sum 4 over 2

    calls = []

    def fake_all_reduce(t):  # the other rank covers the same keys and holds sum 10 over 3 for this one
        calls.append(t.numel())
        return 2 * t if len(calls) == 1 else t + torch.tensor([10.0, 3.0], dtype=torch.float64)

    ema.end_step(fake_all_reduce, world_size=2)
    assert ema.ema["l/e"] == pytest.approx(14.0 / 5.0)
    assert calls == [3, 2]  # the fixed-size key check, then the sums and counts


@pytest.mark.parametrize("other", [["l/e"], ["l/e", "l/f"], ["m/e"]], ids=["fewer", "more", "renamed"])
def test_ema_key_mismatch_across_processes_raises_before_the_sums_are_reduced(other):
    """A rank covering other layers must fail on the fixed-size probe: reducing sums of different lengths would hang
    a real collective first."""
    ema = EMAStatistics(0.9)
    ema.accumulate("l", "e", torch.tensor([1.0]))
    ema.accumulate("m", "f", torch.tensor([2.0]))
    peer = EMAStatistics(0.9)
    for key in other:
        layer, stat = key.split("/")
        peer.accumulate(layer, stat, torch.tensor([1.0]))
    peer_probe = []
    peer.end_step(lambda t: peer_probe.append(t.clone()) or (2 * t if len(peer_probe) == 1 else 2 * t), world_size=2)
    calls = []

    def fake_all_reduce(t):
        calls.append(t.numel())
        return t + peer_probe[0]

    with pytest.raises(RuntimeError, match="differ in layers"):
        ema.end_step(fake_all_reduce, world_size=2)
    assert calls == [3]


def test_kernel_of_materialized_gradients_is_accurate_in_float32():
    """K = V V^T over d_in * d_out ~ millions of entries: the blocked sum keeps float32 K close to float64 (one long
    GEMM reduction measured 5e-4 relative error at 896 x 4864)."""
    Vf = torch.randn(4, 3_000_000, generator=torch.Generator().manual_seed(0))
    K = statistics.row_gram(Vf)
    ref = Vf.double() @ Vf.double().T
    assert ((K.double() - ref).abs().max() / ref.abs().max()).item() < 3e-7  # measured 7.5e-8 at 896 x 4864


@pytest.mark.parametrize("variant", ["p,q,r", "p alone", "interacting"])
def test_step_metrics_match_dense_statistics(variant):
    """The per-step metrics (reduced once per step from per-layer-call records) against dense per-sequence V_i:
    two layers x two micro-batches of different sizes, a sequence with a zero layer gradient, a zero advantage and
    a forced non-finite coefficient. p alone does not compute e (nor report euclidean_norm)."""
    from math_settings import isopo_settings
    from trl_isopo.isopo.isopo_backward import ISOPOBackward
    from trl_isopo.layerwise.micro_batch import MicroBatch

    interacting = variant == "interacting"
    knobs = {
        "p,q,r": dict(p=-1.0, q=0.3, r=0.5, reg=0.8),
        "p alone": dict(p=-1.0, reg=0.8),
        "interacting": dict(interacting=True, interacting_reg=0.7),
    }[variant]
    q, r = knobs.get("q", 0.0), knobs.get("r", 0.0)
    ctx = ISOPOBackward(isopo_settings(**knobs))
    mu = {"e": 2.0, "f": 0.5, "rho": 0.3, "ntk": 1.5}
    expected = {
        k: [] for k in ("euclidean_norm", "fisher_norm", "rel_overlap", "scale_mean", "scale_std", "scale_spread", "ntk_lambda")
    }
    bad = 0
    for call, (B, L, d_in, d_out) in enumerate([(4, 6, 5, 3), (3, 5, 5, 3), (4, 6, 3, 7), (3, 5, 3, 7)]):
        name = f"layer{call % 2}"
        X, G, mask = random_layer(B, L, d_in, d_out, seed=call)
        X[1] = 0.0  # sequence 1: zero gradient in this layer
        A = torch.tensor([1.0, -0.5, 0.0, 2.0][:B], dtype=torch.float64)
        valid = mask.reshape(-1).nonzero().squeeze(1)
        sample = valid[torch.randperm(valid.numel(), generator=torch.Generator().manual_seed(call))[:7]]
        ctx.sampler.override = {name: sample}
        ctx.ema.ema = {f"{name}/{k}": v for k, v in mu.items()}
        force_inf = call == 2
        ctx.weight_override = (lambda n, a: torch.where(torch.arange(a.numel()) == 0, torch.inf, a)) if force_inf else None
        ctx.layer_grads(name, X, G, MicroBatch(mask=mask, advantages=A), False)
        ctx.clear()

        V, num, K = explicit(X, G, sample)
        e = V.reshape(B, -1).norm(dim=1)
        live = e > 0
        if interacting:
            lam = knobs["interacting_reg"] * mu["ntk"]
            alpha = lam * torch.linalg.solve(K + lam * torch.eye(B, dtype=K.dtype), A)  # no absolute guard
            keep = live & (A != 0)
            scale = alpha[keep] / A[keep]
            expected["ntk_lambda"].append(lam)
        else:
            Xf, Gf = X.reshape(-1, d_in), G.reshape(-1, d_out)
            den = ((Gf[sample].norm(dim=1) * Xf[sample].norm(dim=1)) ** 2).sum().sqrt()
            f = num.sqrt() / den
            rho = torch.where(e > 0, f / e, 0.0)
            R = {k: torch.sqrt(v**2 / (knobs["reg"] * mu[k]) + 1) for k, v in (("e", e), ("f", f), ("rho", rho))}
            scale = (1 / (R["e"] ** -q * R["f"] ** 1.0 * R["rho"] ** -r))[live]
            expected["fisher_norm"].append(f.mean().item())
            if r:
                expected["rel_overlap"].append(rho.mean().item())
        if variant != "p alone":
            expected["euclidean_norm"].append(e.mean().item())
        expected["scale_mean"].append(scale.mean().item())
        expected["scale_std"].append(scale.std(unbiased=False).item())
        cv = abs(scale.std(unbiased=False).item() / scale.mean().item()) if scale.numel() >= 2 else math.nan
        if math.isfinite(cv):  # a layer call with fewer than 2 sequences (or a non-finite coefficient) is left out
            expected["scale_spread"].append(cv)
        bad += int(force_inf)
    got = ctx.step_metrics()
    for k, values in expected.items():
        if values:
            total, count = got.pop(k)
            assert count == len(values), k
            assert total / count == pytest.approx(sum(values) / len(values), rel=1e-10, abs=1e-12), k
    assert got.pop("nonfinite_coefficients") == (float(bad), 4.0)
    assert not got, f"unexpected metrics {sorted(got)}"
    assert not ctx.records and ctx.step_metrics() == {}  # cleared


@pytest.mark.parametrize("route", ["gram", "mat"])
def test_statistics_without_euclidean_norm(route):
    """euclidean=False skips e^2 (None) and leaves every other statistic unchanged; route_costs drops its work."""
    X, G, mask = random_layer(3, 10, 6, 9, seed=5)
    sample = mask.reshape(-1).nonzero().squeeze(1)[:7]
    full = sequence_statistics(X, G, sample, fisher=True, ntk=False, route=route, bias=True)
    lean = sequence_statistics(X, G, sample, fisher=True, ntk=False, route=route, bias=True, euclidean=False)
    assert lean.e2 is None and full.e2 is not None
    for a, b in ((full.fisher_num, lean.fisher_num), (full.fisher_den, lean.fisher_den),
                 (full.bias_per_seq, lean.bias_per_seq)):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=0)
    w = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    for a, b in zip(reweighted_weight_grad(X, G, w, full), reweighted_weight_grad(X, G, w, lean)):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=0)
    with_e = route_costs(8, 256, 896, 4864, 256, fisher=True, ntk=False)
    without = route_costs(8, 256, 896, 4864, 256, fisher=True, ntk=False, euclidean=False)
    dd = 896 + 4864
    assert with_e.gram - without.gram == 8 * costs.tri_work(256, costs.TRI_ROWS) * dd
    assert without.gram == 8 * 256 * 256 * dd  # the Fisher numerator alone
    assert with_e.mat - without.mat == (1 + costs.MAT_MACS_PER_FLOAT) * 8 * 896 * 4864
