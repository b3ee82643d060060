"""Unit tests of the TPO math (docs/tpo.md): oracles are closed forms, float64 brute force and limits."""

import math
import random

import pytest
import torch

from trl_isopo.tpo.target import (
    sequence_logps,
    standardize_group_scores,
    tpo_group_stats,
    tpo_loss,
    tpo_target,
)

F64 = torch.float64


# ----------------------------------------------------------------------------------------------- brute-force oracles
def oracle_standardize(scores, valid=None):
    """Plain-Python population z-score of one group; invalid entries -> 0; std <= 1e-6 -> centred."""
    idx = [i for i, s in enumerate(scores) if (valid is None or valid[i]) and math.isfinite(s)]
    out = [0.0] * len(scores)
    if not idx:
        return out
    vals = [scores[i] for i in idx]
    mean = math.fsum(vals) / len(vals)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in vals) / len(vals))
    for i in idx:
        out[i] = (scores[i] - mean) / std if std > 1e-6 else scores[i] - mean
    return out


def oracle_target(old_logps, u, eta=1.0, anchor=True, valid=None):
    """q_i = p_old_i exp(u_i/eta) / sum_j (...), via a max-shifted exp in plain Python."""
    idx = [i for i in range(len(u)) if valid is None or valid[i]]
    if not idx:
        return [0.0] * len(u)
    z = {i: (old_logps[i] if anchor else 0.0) + u[i] / eta for i in idx}
    m = max(z.values())
    w = {i: math.exp(z[i] - m) for i in idx}
    tot = math.fsum(w.values())
    return [w[i] / tot if i in w else 0.0 for i in range(len(u))]


def oracle_softmax(x, valid=None):
    return oracle_target(x, [0.0] * len(x), valid=valid)


# ----------------------------------------------------------------------------------------------- 1. standardization
def test_standardize_two_values():
    u = standardize_group_scores(torch.tensor([[0.0, 1.0]]))
    assert torch.allclose(u, torch.tensor([[-1.0, 1.0]]), atol=1e-7)


def test_standardize_one_success_population_std():
    u = standardize_group_scores(torch.tensor([[0.0, 1.0, 0.0, 0.0]], dtype=F64))
    s3 = math.sqrt(3.0)
    assert torch.allclose(u, torch.tensor([[-1 / s3, s3, -1 / s3, -1 / s3]], dtype=F64), atol=1e-12)
    # the sqrt(K-1) bound is attained by a single success; K = 10 gives (3, -1/3 x 9)
    u10 = standardize_group_scores(torch.eye(10, dtype=F64)[:1])
    assert torch.allclose(u10, torch.tensor([[3.0] + [-1 / 3] * 9], dtype=F64), atol=1e-12)


def test_standardize_constant_is_exactly_zero():
    for c in (0.0, 1.0, -3.25, 1e6):
        u = standardize_group_scores(torch.full((2, 5), c))
        assert torch.equal(u, torch.zeros(2, 5))


def test_standardize_tiny_std_gives_centred_scores():
    s = torch.tensor([[0.0, 1e-7, 0.0, 0.0]], dtype=F64)  # std = 4.3e-8 <= 1e-6
    u = standardize_group_scores(s)
    assert torch.allclose(u, s - s.mean(), atol=1e-20)
    # just above the threshold it is z-scored again
    s2 = torch.tensor([[0.0, 1e-5, 0.0, 0.0]], dtype=F64)
    assert torch.allclose(standardize_group_scores(s2), torch.tensor([oracle_standardize(s2[0].tolist())], dtype=F64))


def test_standardize_matches_bruteforce_and_moments():
    g = torch.Generator().manual_seed(0)
    s = torch.randn(50, 7, generator=g, dtype=F64) * 3 + 1
    u = standardize_group_scores(s)
    ref = torch.tensor([oracle_standardize(row) for row in s.tolist()], dtype=F64)
    assert torch.allclose(u, ref, atol=1e-12)
    assert torch.allclose(u.mean(-1), torch.zeros(50, dtype=F64), atol=1e-12)
    assert torch.allclose((u**2).mean(-1), torch.ones(50, dtype=F64), atol=1e-12)
    assert (u.abs() <= math.sqrt(6) + 1e-12).all()


def test_standardize_affine_invariance():
    g = torch.Generator().manual_seed(1)
    s = torch.randn(20, 6, generator=g, dtype=F64)
    for a, b in [(2.0, 5.0), (1e-3, -7.0), (1e3, 0.0)]:
        assert torch.allclose(standardize_group_scores(a * s + b), standardize_group_scores(s), atol=1e-9)
    # a < 0 flips the sign (sanity check that the test can fail)
    assert torch.allclose(standardize_group_scores(-s), -standardize_group_scores(s), atol=1e-12)


def test_standardize_excludes_invalid_members():
    s = torch.tensor([[0.0, 123.0, 1.0]])
    valid = torch.tensor([[True, False, True]])
    assert torch.allclose(standardize_group_scores(s, valid), torch.tensor([[-1.0, 0.0, 1.0]]), atol=1e-7)
    # NaN scores are excluded even without a mask
    s_nan = torch.tensor([[0.0, float("nan"), 1.0]])
    assert torch.allclose(standardize_group_scores(s_nan), torch.tensor([[-1.0, 0.0, 1.0]]), atol=1e-7)
    # random masks vs brute force
    rng = random.Random(0)
    for _ in range(20):
        k = rng.randint(2, 6)
        row = [rng.gauss(0, 1) for _ in range(k)]
        v = [rng.random() < 0.7 for _ in range(k)]
        out = standardize_group_scores(torch.tensor([row], dtype=F64), torch.tensor([v]))
        assert torch.allclose(out, torch.tensor([oracle_standardize(row, v)], dtype=F64), atol=1e-12)


def test_standardize_degenerate_groups_are_zero_and_finite():
    s = torch.tensor([[float("nan")] * 4, [1.0, float("nan"), float("nan"), float("nan")]])
    u, std = standardize_group_scores(s, return_std=True)
    assert torch.equal(u, torch.zeros(2, 4))
    assert torch.equal(std, torch.zeros(2))


# ----------------------------------------------------------------------------------------------- 2. target
def test_target_closed_form():
    q = tpo_target(torch.log(torch.tensor([[0.7, 0.3]], dtype=F64)), torch.tensor([[1.0, -1.0]], dtype=F64))
    e = math.e
    expected = [0.7 * e / (0.7 * e + 0.3 / e), 0.3 / e / (0.7 * e + 0.3 / e)]
    assert torch.allclose(q, torch.tensor([expected], dtype=F64), atol=1e-15)
    assert torch.allclose(q, torch.tensor([[0.94518, 0.05482]], dtype=F64), atol=5e-6)


def test_target_uniform_one_success_k4():
    s = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=F64)
    q = tpo_target(torch.zeros(1, 4, dtype=F64), standardize_group_scores(s))
    r3 = math.sqrt(3)
    d = math.exp(r3) + 3 * math.exp(-1 / r3)
    assert torch.allclose(q, torch.tensor([[math.exp(r3) / d] + [math.exp(-1 / r3) / d] * 3], dtype=F64), atol=1e-14)
    assert torch.allclose(q, torch.tensor([[0.7704, 0.0765, 0.0765, 0.0765]], dtype=F64), atol=1e-4)


def test_target_matches_bruteforce():
    g = torch.Generator().manual_seed(2)
    lo = torch.randn(30, 5, generator=g, dtype=F64) * 4
    u = standardize_group_scores(torch.randn(30, 5, generator=g, dtype=F64))
    for eta in (0.25, 1.0, 3.0):
        for anchor in (True, False):
            q = tpo_target(lo, u, eta=eta, anchor=anchor)
            ref = [oracle_target(a, b, eta, anchor) for a, b in zip(lo.tolist(), u.tolist())]
            assert torch.allclose(q, torch.tensor(ref, dtype=F64), atol=1e-14)
            assert torch.allclose(q.sum(-1), torch.ones(30, dtype=F64), atol=1e-14)


def test_target_zero_variance_is_p_old():
    lo = torch.log_softmax(torch.randn(3, 6, dtype=F64), -1)
    u = standardize_group_scores(torch.ones(3, 6, dtype=F64))
    assert torch.allclose(tpo_target(lo, u), lo.exp(), atol=1e-15)


def test_target_invariances_and_limits():
    g = torch.Generator().manual_seed(3)
    lo = torch.randn(4, 5, generator=g, dtype=F64)
    u = standardize_group_scores(torch.randn(4, 5, generator=g, dtype=F64))
    q = tpo_target(lo, u, eta=0.7)
    # a per-group constant on l_old cancels
    shift = torch.tensor([[5.0], [-300.0], [0.0], [1e4]], dtype=F64)
    assert torch.allclose(tpo_target(lo + shift, u, eta=0.7), q, atol=1e-12)
    # q(u, eta) = q(u / eta, 1)
    assert torch.allclose(tpo_target(lo, u / 0.7, eta=1.0), q, atol=1e-14)
    # eta -> inf gives p_old
    p_old = torch.softmax(lo, -1)
    assert torch.allclose(tpo_target(lo, u, eta=1e12), p_old, atol=1e-10)
    assert torch.allclose(tpo_target(lo, u, eta=float("inf")), p_old, atol=1e-15)
    # no anchor gives softmax(u / eta)
    assert torch.allclose(tpo_target(lo, u, eta=0.7, anchor=False), torch.softmax(u / 0.7, -1), atol=1e-15)
    assert torch.allclose(tpo_target(None, u, anchor=False), torch.softmax(u, -1), atol=1e-15)


@pytest.mark.parametrize("eta", [0.0, -1.0, float("nan")])
def test_target_rejects_nonpositive_eta(eta):
    with pytest.raises(ValueError, match="eta"):
        tpo_target(torch.zeros(1, 2), torch.zeros(1, 2), eta=eta)


def test_target_invalid_members_get_zero_mass():
    lo = torch.tensor([[-1.0, -2.0, -3.0, -4.0]], dtype=F64)
    u = torch.tensor([[0.5, 2.0, -1.0, -1.5]], dtype=F64)
    valid = torch.tensor([[True, False, True, True]])
    q = tpo_target(lo, u, valid)
    assert q[0, 1] == 0
    ref = oracle_target(lo[0].tolist(), u[0].tolist(), valid=valid[0].tolist())
    assert torch.allclose(q, torch.tensor([ref], dtype=F64), atol=1e-15)
    # non-finite old log-probs are treated as invalid, never NaN
    q2 = tpo_target(torch.tensor([[0.0, float("-inf"), float("nan")]]), torch.zeros(1, 3))
    assert torch.equal(q2, torch.tensor([[1.0, 0.0, 0.0]]))


# ----------------------------------------------------------------------------------------------- 3. gradient = p - q
def test_gradient_wrt_sequence_logps_is_p_minus_q():
    g = torch.Generator().manual_seed(4)
    lo = torch.randn(6, 5, generator=g, dtype=F64) * 3
    q = tpo_target(lo, standardize_group_scores(torch.randn(6, 5, generator=g, dtype=F64)))
    lt = (lo + 0.3 * torch.randn(6, 5, generator=g, dtype=F64)).requires_grad_(True)
    tpo_loss(lt, q, reduction="sum").backward()
    p = torch.tensor([oracle_softmax(row) for row in lt.detach().tolist()], dtype=F64)
    assert torch.allclose(lt.grad, p - q, atol=1e-14)
    # mean reduction divides by the number of groups
    lt.grad = None
    tpo_loss(lt, q, reduction="mean").backward()
    assert torch.allclose(lt.grad, (p - q) / 6, atol=1e-14)
    # loss value vs brute force cross-entropy
    ce = [-sum(qi * math.log(pi) for qi, pi in zip(qr, pr)) for qr, pr in zip(q.tolist(), p.tolist())]
    assert torch.allclose(tpo_loss(lt, q, reduction="none"), torch.tensor(ce, dtype=F64), atol=1e-12)


@pytest.mark.parametrize("length_normalize", [False, True])
def test_gradient_per_token(length_normalize):
    g = torch.Generator().manual_seed(5)
    K, T = 4, 6
    tok = (torch.randn(K, T, generator=g, dtype=F64) - 2).requires_grad_(True)
    lengths = [1, 3, 6, 4]
    mask = torch.tensor([[1] * n + [0] * (T - n) for n in lengths])
    q = torch.softmax(torch.randn(1, K, generator=g, dtype=F64), -1)
    seq = sequence_logps(tok, mask, length_normalize)
    ref_seq = [sum(tok[i, :n].tolist()) / (n if length_normalize else 1) for i, n in enumerate(lengths)]
    assert torch.allclose(seq, torch.tensor(ref_seq, dtype=F64), atol=1e-14)
    tpo_loss(seq.view(1, K), q).backward()
    c = torch.softmax(seq.detach(), -1) - q[0]
    scale = torch.tensor(lengths, dtype=F64) if length_normalize else torch.ones(K, dtype=F64)
    expected = (c / scale)[:, None] * mask
    assert torch.allclose(tok.grad, expected, atol=1e-14)


def test_sequence_logps_ignores_masked_garbage():
    tok = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, float("-inf"), float("inf")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert torch.equal(sequence_logps(tok, mask), torch.tensor([-3.0, -0.5]))
    assert torch.equal(sequence_logps(tok, mask, True), torch.tensor([-1.5, -0.5]))
    assert torch.equal(sequence_logps(tok, torch.zeros_like(mask), True), torch.zeros(2))


def test_gradient_invalid_members_and_all_invalid_group():
    lt = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]], dtype=F64, requires_grad=True)
    valid = torch.tensor([[True, False, True], [False, False, False]])
    q = tpo_target(lt.detach(), torch.tensor([[1.0, 0.0, -1.0], [0.0, 0.0, 0.0]], dtype=F64), valid)
    assert torch.equal(q[1], torch.zeros(3, dtype=F64))
    per_group = tpo_loss(lt, q, valid, reduction="none")
    assert per_group[1] == 0
    per_group.sum().backward()
    p_valid = torch.tensor(oracle_softmax(lt[0].tolist(), valid[0].tolist()), dtype=F64)
    assert torch.allclose(lt.grad[0], p_valid - q[0], atol=1e-14)
    assert lt.grad[0, 1] == 0
    assert torch.equal(lt.grad[1], torch.zeros(3, dtype=F64))


# ----------------------------------------------------------------------------------------------- a tiny policy
class TinyPolicy(torch.nn.Module):
    """Autoregressive toy policy: logits_t = W[prev_token] + b. Sequence log-probs of given completions."""

    def __init__(self, vocab=5, dtype=torch.float32, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.W = torch.nn.Parameter(torch.randn(vocab, vocab, generator=g, dtype=dtype))
        self.b = torch.nn.Parameter(torch.randn(vocab, generator=g, dtype=dtype))

    def per_token_logps(self, tokens):  # tokens (B, T+1): column 0 is the prompt token
        logits = self.W[tokens[:, :-1]] + self.b
        return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _toy_batch(groups=3, K=4, T=5, vocab=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (groups * K, T + 1), generator=g)
    lengths = torch.randint(1, T + 1, (groups * K,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return tokens, mask


# ----------------------------------------------------------------------------------------------- 4. fixed point
@pytest.mark.parametrize("length_normalize", [False, True])
def test_fixed_point_gives_zero_parameter_gradient(length_normalize):
    policy = TinyPolicy(dtype=F64)
    tokens, mask = _toy_batch()
    l = sequence_logps(policy.per_token_logps(tokens), mask, length_normalize).view(3, 4)
    q = torch.softmax(l.detach(), -1)  # p_theta = q
    tpo_loss(l, q).backward()
    assert policy.W.grad.abs().max() < 1e-7 and policy.b.grad.abs().max() < 1e-7
    # control: a different target gives a clearly nonzero gradient
    policy.zero_grad()
    l = sequence_logps(policy.per_token_logps(tokens), mask, length_normalize).view(3, 4)
    tpo_loss(l, torch.softmax(l.detach() + torch.tensor([1.0, 0, 0, 0], dtype=F64), -1)).backward()
    assert policy.W.grad.abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------- 5. zero variance
def test_zero_variance_first_epoch_gives_zero_gradient_and_no_move():
    policy = TinyPolicy(dtype=torch.float32, seed=1)
    tokens, mask = _toy_batch(seed=1)
    with torch.no_grad():
        l_old = sequence_logps(policy.per_token_logps(tokens), mask).view(3, 4)
    scores = torch.zeros(3, 4)  # all-fail groups
    q = tpo_target(l_old, standardize_group_scores(scores))
    before = [p.detach().clone() for p in policy.parameters()]
    opt = torch.optim.SGD(policy.parameters(), lr=1.0)
    l = sequence_logps(policy.per_token_logps(tokens), mask).view(3, 4)
    tpo_loss(l, q).backward()
    assert max(p.grad.abs().max().item() for p in policy.parameters()) < 1e-7
    opt.step()
    assert max((p.detach() - b).abs().max().item() for p, b in zip(policy.parameters(), before)) < 1e-7


# ----------------------------------------------------------------------------------------------- 6. whole groups
def test_subset_softmax_differs_from_whole_group():
    """Negative control: a group split over two micro-batches with a per-subset log_softmax gives another update."""
    g = torch.Generator().manual_seed(6)
    l = torch.randn(1, 6, generator=g, dtype=F64, requires_grad=True)
    q = tpo_target(l.detach(), standardize_group_scores(torch.tensor([[1.0, 0, 0, 0, 1, 0]], dtype=F64)))
    tpo_loss(l, q).backward()
    whole = l.grad.clone()
    l.grad = None
    (tpo_loss(l[:, :3], q[:, :3]) + tpo_loss(l[:, 3:], q[:, 3:])).backward()
    p = torch.softmax(l.detach(), -1)
    assert not torch.isclose(p[0, :3].sum(), q[0, :3].sum())  # P_S != Q_S
    assert (l.grad - whole).abs().max() > 1e-3
    # the subset coefficient is (Q_S / P_S) p_i - q_i
    ps, qs = p[0, :3].sum(), q[0, :3].sum()
    assert torch.allclose(l.grad[0, :3], qs / ps * p[0, :3] - q[0, :3], atol=1e-14)


def test_mean_over_groups_is_invariant_to_equal_micro_batches():
    """Loss scale: mean over equal-size chunks of groups / number of chunks = mean over all groups."""
    g = torch.Generator().manual_seed(7)
    l = torch.randn(8, 4, generator=g, dtype=F64, requires_grad=True)
    q = tpo_target(l.detach(), standardize_group_scores(torch.randn(8, 4, generator=g, dtype=F64)))
    tpo_loss(l, q).backward()
    full = l.grad.clone()
    for chunks in (2, 4, 8):
        l.grad = None
        for part in torch.arange(8).chunk(chunks):
            (tpo_loss(l[part], q[part]) / chunks).backward()
        assert torch.allclose(l.grad, full, atol=1e-15)


# ----------------------------------------------------------------------------------------------- 10. stability
def test_stability_large_negative_sequence_logps():
    l = torch.tensor([[-5000.0, -5300.0, -5100.0]], requires_grad=True)
    u = standardize_group_scores(torch.tensor([[0.0, 1.0, 0.5]]))
    q = tpo_target(l.detach(), u)
    ref = oracle_target([-5000.0, -5300.0, -5100.0], u[0].tolist())
    assert torch.isfinite(q).all() and torch.allclose(q.double(), torch.tensor([ref], dtype=F64), atol=1e-7)
    loss = tpo_loss(l, q)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(l.grad).all()
    assert torch.allclose(l.grad, torch.softmax(l.detach(), -1) - q, atol=1e-7)


def test_bf16_inputs_use_fp32_math():
    l = torch.tensor([[-50.0, -51.0, -52.5, -50.5]], dtype=torch.bfloat16, requires_grad=True)
    u = standardize_group_scores(torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.bfloat16))
    assert u.dtype == torch.float32
    q = tpo_target(l.detach(), u)
    assert q.dtype == torch.float32
    loss = tpo_loss(l, q)
    assert loss.dtype == torch.float32
    ref = tpo_loss(l.detach().float(), q)
    assert torch.equal(loss.detach(), ref)
    loss.backward()
    assert l.grad.dtype == torch.bfloat16 and torch.isfinite(l.grad.float()).all()


def test_all_invalid_group_gives_no_nan():
    l = torch.full((2, 4), -7.0, requires_grad=True)
    valid = torch.tensor([[False] * 4, [True, True, False, True]])
    u = standardize_group_scores(torch.tensor([[float("nan")] * 4, [1.0, 0.0, float("nan"), 2.0]]), valid)
    q = tpo_target(l.detach(), u, valid)
    loss = tpo_loss(l, q, valid, reduction="none")
    loss.sum().backward()
    assert torch.isfinite(q).all() and torch.isfinite(loss).all() and torch.isfinite(l.grad).all()
    assert loss[0] == 0 and torch.equal(l.grad[0], torch.zeros(4))
    stats = tpo_group_stats(l, q, valid)
    assert all(torch.isfinite(v) for v in stats.values()) and stats["num_groups"] == 1


# ----------------------------------------------------------------------------------------------- 11. tabular identity
def test_tabular_identity_q_minus_pi():
    """K = 10 one-hot scores: q - pi = beta_TPO(p) (e_y - pi), beta = p(l-1)/(1-p+l p), l = e^(10/3)."""
    lam = math.exp(10 / 3)
    g = torch.Generator().manual_seed(8)
    for p in (0.01, 0.1, 0.5, 0.9):
        rest = torch.rand(9, generator=g, dtype=F64)
        pi = torch.cat([torch.tensor([p], dtype=F64), (1 - p) * rest / rest.sum()])
        u = standardize_group_scores(torch.eye(10, dtype=F64)[:1])
        q = tpo_target(torch.log(pi)[None], u)[0]
        beta = p * (lam - 1) / (1 - p + lam * p)
        e_y = torch.eye(10, dtype=F64)[0]
        assert torch.allclose(q - pi, beta * (e_y - pi), atol=1e-14)
    assert abs(0.1 * (lam - 1) / (0.9 + lam * 0.1) - 0.73) < 0.005


# ----------------------------------------------------------------------------------------------- diagnostics
def test_group_stats_against_bruteforce():
    g = torch.Generator().manual_seed(9)
    l = torch.randn(5, 4, generator=g, dtype=F64)
    u = standardize_group_scores(torch.randn(5, 4, generator=g, dtype=F64))
    q = tpo_target(l + 0.5 * torch.randn(5, 4, generator=g, dtype=F64), u)
    stats = tpo_group_stats(l, q)
    p = [oracle_softmax(r) for r in l.tolist()]
    ent = sum(-sum(x * math.log(x) for x in qr if x > 0) for qr in q.tolist())
    kl = sum(sum(x * (math.log(x) - math.log(y)) for x, y in zip(qr, pr) if x > 0) for qr, pr in zip(q.tolist(), p))
    mx = max(abs(x - y) for qr, pr in zip(q.tolist(), p) for x, y in zip(qr, pr))
    assert math.isclose(stats["target_entropy_sum"].item(), ent, rel_tol=1e-12)
    assert math.isclose(stats["kl_q_p_sum"].item(), kl, rel_tol=1e-10)
    assert math.isclose(stats["max_abs_p_minus_q"].item(), mx, rel_tol=1e-12)
    assert math.isclose(stats["cross_entropy_sum"].item(), tpo_loss(l, q, reduction="sum").item(), rel_tol=1e-12)
    # KL(q||p) = CE - H(q)
    assert math.isclose(kl, stats["cross_entropy_sum"].item() - ent, rel_tol=1e-10)
