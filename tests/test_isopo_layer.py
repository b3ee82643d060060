"""`isopo_linear_grad`, the pure per-layer function, against dense float64 formulas on explicit V_i (no trainer).

The oracle builds every V_i = sum_{t in T_i} g_t x_t^T by an einsum, the statistics and coefficients by
`isopo_oracle.dense_weights` (or `torch.linalg.solve` for the interacting variant), and the gradient as sum_i w_i V_i.
"""

import pytest
import torch
from isopo_oracle import dense_weights, rel_err

from trl_isopo.isopo.layer import isopo_linear_grad
from math_settings import isopo_settings

TOL = 1e-10
SETTINGS = [
    pytest.param(dict(p=-1.0, reg=0.0), None, id="p=-1,c=0"),
    pytest.param(dict(p=-1.0, reg=1.0), None, id="p=-1,c=1,first-step"),
    pytest.param(dict(p=-1.0, reg=1.0), {"f": 0.37}, id="p=-1,c=1,history"),
    pytest.param(dict(p=0.0, q=-1.0, reg=0.5), {"e": 2.3}, id="q=-1,c=0.5,history"),
    pytest.param(dict(p=0.0, q=-1.0, r=-2.0, reg=0.0), None, id="fig6"),
    pytest.param(dict(p=-1.0, q=-0.5, r=-1.0, reg=2.0), {"e": 1.1, "f": 0.2, "rho": 0.05}, id="p+q+r,c=2"),
]


def layer_case(B=4, L=6, d_in=5, d_out=7, seed=0):
    """Random float64 X, G with padding (X's padding rows zero, G's hold garbage), mask, A, a Fisher sample."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, :2] = False
    mask[1, -3:] = False
    mask[3, 1:] = False  # one valid token
    X = torch.randn(B, L, d_in, generator=g, dtype=torch.float64) * mask.unsqueeze(-1)
    G = torch.randn(B, L, d_out, generator=g, dtype=torch.float64)  # finite garbage at padding: X's rows are 0
    A = torch.tensor([1.0, -0.5, 0.0, 2.0], dtype=torch.float64)[:B]
    valid = mask.reshape(-1).nonzero().squeeze(1)
    sample = valid[torch.randperm(valid.numel(), generator=g)[:7]]
    return X, G, mask, A, sample


def explicit(X, G, mask):
    Gm = G * mask.unsqueeze(-1)
    return torch.einsum("blo,bli->boi", Gm, X), Gm.sum(1)  # V (B, d_out, d_in), per-sequence bias grads (B, d_out)


@pytest.mark.parametrize("route", ["gram", "mat"])
@pytest.mark.parametrize("knobs,history", SETTINGS)
@pytest.mark.parametrize("dims", [(5, 7), (9, 3)], ids=["wide-out", "wide-in"])
def test_isopo_linear_grad_matches_dense_oracle(knobs, history, route, dims):
    X, G, mask, A, sample = layer_case(d_in=dims[0], d_out=dims[1])
    if dims[0] > dims[1]:  # the narrower operand carries the zero padding rows
        X, G = X + 0.0, G * mask.unsqueeze(-1)
        X[~mask] = 3.0
    settings = isopo_settings(**knobs, route=route, fisher_tokens=7)
    out = isopo_linear_grad(X, G, mask, A, settings, sample=sample, history=history, has_bias=True)
    V, b = explicit(X * mask.unsqueeze(-1), G, mask)
    full = {"e": 1.0, "f": 1.0, "rho": 1.0}  # statistics with exponent 0 do not use their mu
    mu = None if history is None else {**full, **history}
    p, q, r, c = settings.p, settings.q, settings.r, settings.reg
    w, stats = dense_weights(V, X * mask.unsqueeze(-1), G * mask.unsqueeze(-1), sample, A, p, q, r, c, mu)
    assert rel_err(out.grad_weight, torch.einsum("b,boi->oi", w, V)) < TOL
    assert rel_err(out.grad_bias, torch.einsum("b,bo->o", w, b)) < TOL
    assert torch.allclose(out.record[5], w, rtol=1e-10, atol=0)  # the coefficients in the metrics record
    # What the caller folds into the EMA: each used statistic's x^2 (ema_mean), nothing for c = 0.
    folded = {key: values for key, values, _ in out.ema}
    used = {k for k, ex in (("e", q), ("f", p), ("rho", r)) if ex != 0} if c > 0 else set()
    assert set(folded) == used
    for k in used:
        assert torch.allclose(folded[k], stats[k] ** 2, rtol=1e-10)


def test_interacting_matches_dense_solve():
    X, G, mask, A, _ = layer_case(seed=3)
    V, b = explicit(X, G, mask)
    K = torch.einsum("boi,coi->bc", V, V)
    for history in (None, {"ntk": 0.8}):
        lam = 1.5 * (torch.diagonal(K).mean() if history is None else history["ntk"])
        w = lam * torch.linalg.solve(K + lam * torch.eye(len(A), dtype=K.dtype), A)
        for route in ("gram", "mat"):
            settings = isopo_settings(p=0.0, interacting=True, interacting_reg=1.5, route=route)
            out = isopo_linear_grad(X, G, mask, A, settings, history=history, has_bias=True)
            assert rel_err(out.grad_weight, torch.einsum("b,boi->oi", w, V)) < TOL
            assert rel_err(out.grad_bias, torch.einsum("b,bo->o", w, b)) < TOL
            assert float(out.lam) == pytest.approx(float(lam), rel=1e-12)
            assert [key for key, _, _ in out.ema] == ["ntk"]


def test_stat_scale_moves_only_the_reference_point_units():
    """With c > 0 the coefficients see n_i-scaled statistics: scaling every n by s equals scaling the history by s^2;
    with c = 0 n is ignored (degree-0 normalization)."""
    X, G, mask, A, sample = layer_case(seed=5)
    n = torch.full((4,), 3.0, dtype=torch.float64)
    s1 = isopo_settings(p=-1.0, reg=1.0, fisher_tokens=7)
    a = isopo_linear_grad(X, G, mask, A, s1, sample=sample, stat_scale=n, history={"f": 0.4 * 9.0})
    b = isopo_linear_grad(X, G, mask, A, s1, sample=sample, history={"f": 0.4})
    assert rel_err(a.grad_weight, b.grad_weight) < TOL
    c0 = isopo_settings(p=-1.0, reg=0.0, fisher_tokens=7)
    a = isopo_linear_grad(X, G, mask, A, c0, sample=sample, stat_scale=n)
    b = isopo_linear_grad(X, G, mask, A, c0, sample=sample)
    assert rel_err(a.grad_weight, b.grad_weight) < TOL


def test_coefficients_argument_gives_plain_autograd():
    """coefficients = A (the test hook as an argument): the REINFORCE gradient sum_i A_i V_i, i.e. autograd's."""
    X, G, mask, A, sample = layer_case(seed=7)
    W = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    Xr = X.clone()
    y = Xr @ W.T
    (y * (G * mask.unsqueeze(-1) * A.view(-1, 1, 1))).sum().backward()
    out = isopo_linear_grad(X, G, mask, A, isopo_settings(p=-1.0, reg=0.0, fisher_tokens=7), sample=sample,
                            coefficients=A)
    assert rel_err(out.grad_weight, W.grad) < TOL


@pytest.mark.parametrize(
    "knobs,degree",
    [
        pytest.param(dict(p=-1.0, reg=0.0), -1.0, id="p=-1,c=0"),
        pytest.param(dict(p=0.0, q=-1.0, r=-2.0, reg=0.0), -1.0, id="fig6"),
        pytest.param(dict(p=-0.5, q=0.0, reg=0.0), -0.5, id="p=-0.5,c=0"),
        pytest.param(dict(p=0.0, q=0.0, reg=0.0), 0.0, id="plain"),
        pytest.param(dict(p=-1.0, reg=1.0), 0.0, id="p=-1,c=1"),
        pytest.param(dict(p=-1.0, interacting=True, interacting_reg=1.0), 0.0, id="interacting"),
    ],
)
def test_step_normalization_is_n_to_the_p_plus_q_for_c0_only(knobs, degree):
    """step_sequences = N multiplies the coefficients by N^(p+q) for c = 0 (the mean over the step's sequences for
    the named settings) and leaves c > 0, the interacting variant and p = q = 0 alone (their update already carries
    the loss normalization); the dense oracle with n_step agrees."""
    X, G, mask, A, sample = layer_case()
    settings = isopo_settings(**knobs, fisher_tokens=7)
    base = isopo_linear_grad(X, G, mask, A, settings, sample=sample)
    scaled = isopo_linear_grad(X, G, mask, A, settings, sample=sample, step_sequences=12.0)
    assert rel_err(scaled.grad_weight, 12.0**degree * base.grad_weight) < TOL
    if not knobs.get("interacting") and knobs["reg"] == 0.0:
        V, _ = explicit(X, G, mask)
        w, _ = dense_weights(V, X, G * mask.unsqueeze(-1), sample, A, knobs["p"], knobs.get("q", 0.0), knobs.get("r", 0.0), 0.0,
                             n_step=12)
        assert rel_err(scaled.grad_weight, torch.einsum("b,boi->oi", w, V)) < TOL
