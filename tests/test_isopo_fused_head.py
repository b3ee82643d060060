"""RowScaledChunkedLogProb against TRL's ChunkedLogProbFunction and a dense float64 autograd reference.

grad_hidden must equal TRL's; grad_weight / grad_bias must equal TRL's with the incoming per-token grads multiplied
by row_scale (the same thing computed another way) and the dense reference with the per-row loss scaled. Tensors
live on the test device (`TRL_ISOPO_TEST_DEVICE`, default CPU): on CUDA the backward folds with TRL's Triton kernel.
"""

import pytest
import torch
import trl.kernels.chunked_logprob as trl_kernel
from isopo_oracle import DEVICE
from trl.kernels.chunked_logprob import ChunkedLogProbFunction

import trl_isopo.layerwise.head.kernel as fused_head
from trl_isopo.layerwise.head.kernel import RowScaledChunkedLogProb
from trl_isopo.layerwise.other_params import RowScale

torch.set_num_threads(1)

N, H, V = 37, 16, 53
ALL = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def make_inputs(dtype, with_bias, seed=0):
    """hidden [N, H], weight [V, H], bias [V] | None, targets [N], row_scale [N] (zeros and negatives)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) * 0.5
    bias = torch.randn(V, generator=g, dtype=dtype) if with_bias else None
    targets = torch.randint(0, V, (N,), generator=g)
    targets[:3] = torch.tensor([0, V - 1, 17])  # first / last vocab id, and one inside a later chunk
    scale = torch.randn(N, generator=g, dtype=torch.float32)
    scale[::5] = 0.0
    scale[1] = -2.0
    return tuple(t.to(DEVICE) if t is not None else None for t in (hidden, weight, bias, targets, scale))


def randn(n, seed):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def leaves(hidden, weight, bias):
    return [t.detach().clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]


def run(fn, hidden, weight, bias, targets, cfg, grads, scale=None, outputs=ALL):
    """Forward outputs and (grad_hidden, grad_weight, grad_bias) for loss sum(gl*logp + ge*entropy)."""
    h, w, b = leaves(hidden, weight, bias)
    args = (h, w, b, targets) + ((scale,) if scale is not None else ()) + cfg + (outputs,)
    out = fn.apply(*args)
    gl, ge = grads
    loss = (gl * out[0]).sum() + ((ge * out[1]).sum() if ge is not None else 0.0)
    inputs = [x for x in (h, w, b) if x is not None]
    gs = iter(torch.autograd.grad(loss, inputs))
    return out, [next(gs) if x is not None else None for x in (h, w, b)]


def dense_reference(hidden, weight, bias, targets, cfg, grads, scale):
    """Full fp64 logits + plain autograd. Returns (logp, entropy, log_sum_sq, mean, top1), grad_h, grad_w, grad_b."""
    temperature, _, softcap, logit_scale = cfg
    h, w, b = leaves(*(t.double() if t is not None else None for t in (hidden, weight, bias)))
    y = h @ w.T + (b if b is not None else 0.0)
    y = y * logit_scale
    if softcap is not None:
        y = softcap * torch.tanh(y / softcap)
    logp_all = torch.log_softmax(y / temperature, dim=-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    stats = (logp, ent, torch.logsumexp(2 * logp_all, -1), (y / temperature).mean(-1), y.argmax(-1) == targets)
    gl, ge = (g.double() if g is not None else None for g in grads)
    per_row = gl * logp + (ge * ent if ge is not None else 0.0)
    (grad_h,) = torch.autograd.grad(per_row.sum(), h, retain_graph=True)
    params = [x for x in (w, b) if x is not None]
    gw = torch.autograd.grad((per_row * scale.double()).sum(), params)
    return stats, grad_h, gw[0], gw[1] if b is not None else None


def scaled(grads, scale):
    return tuple(g * scale if g is not None else None for g in grads)


def close(a, b, tol):
    if a is None or b is None:
        assert a is None and b is None
        return
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


CASES = [  # (temperature, chunk_size, softcap, logit_scale)
    (0.7, 16, None, 1.3),
    (1.3, 7, 2.5, 0.8),
    (1.0, 64, None, 1.0),
    (0.9, 53, 4.0, 1.7),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("cfg", CASES)
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_matches_trl_and_dense(dtype, with_bias, cfg, entropy_grad):
    hidden, weight, bias, targets, scale = make_inputs(dtype, with_bias)
    g = torch.Generator().manual_seed(1)
    grads = tuple(t.to(DEVICE) if t is not None else None
                  for t in (torch.randn(N, generator=g), torch.randn(N, generator=g) if entropy_grad else None))

    mine, (gh, gw, gb) = run(RowScaledChunkedLogProb, hidden, weight, bias, targets, cfg, grads, scale)
    trl, (th, _, _) = run(ChunkedLogProbFunction, hidden, weight, bias, targets, cfg, grads)
    _, (_, tw, tb) = run(ChunkedLogProbFunction, hidden, weight, bias, targets, cfg, scaled(grads, scale))

    for a, b in zip(mine, trl):  # same fp32 statistics in the same order: equal up to last-ulp noise
        assert a.dtype == b.dtype
        close(a, b, 1e-6) if a.dtype != torch.bool else torch.testing.assert_close(a, b)
    close(gh, th, 1e-6)
    assert gh.dtype == dtype and gw.dtype == dtype
    close(gw, tw, 2e-6)
    close(gb, tb, 2e-6)

    stats, rh, rw, rb = dense_reference(hidden, weight, bias, targets, cfg, grads, scale)
    for a, b in zip(mine, stats):
        close(a, b, 2e-5) if a.dtype != torch.bool else torch.testing.assert_close(a, b)
    close(gh, rh, 2e-5)
    close(gw, rw, 2e-5)
    close(gb, rb, 2e-5)


def test_zero_and_unit_scale_and_unused_entropy():
    hidden, weight, bias, targets, _ = make_inputs(torch.float32, True, seed=2)
    cfg, grads = CASES[1], (randn(N, 101), None)  # entropy computed but unused: grad_entropy arrives as None
    zeros, ones = torch.zeros(N, device=DEVICE), torch.ones(N, device=DEVICE)
    _, (gh0, gw0, gb0) = run(RowScaledChunkedLogProb, hidden, weight, bias, targets, cfg, grads, zeros)
    _, (gh1, gw1, gb1) = run(RowScaledChunkedLogProb, hidden, weight, bias, targets, cfg, grads, ones)
    _, (th, tw, tb) = run(ChunkedLogProbFunction, hidden, weight, bias, targets, cfg, grads)
    assert torch.equal(gw0, torch.zeros_like(gw0)) and torch.equal(gb0, torch.zeros_like(gb0))
    close(gh0, th, 1e-6)
    close(gh1, th, 1e-6)
    close(gw1, tw, 1e-6)
    close(gb1, tb, 1e-6)


@pytest.mark.parametrize("outputs", [(), ("entropy",), ("is_top1", "mean_logits")])
def test_output_subsets(outputs):
    hidden, weight, bias, targets, scale = make_inputs(torch.float32, False, seed=3)
    cfg = CASES[0]
    mine = RowScaledChunkedLogProb.apply(hidden, weight, bias, targets, scale, *cfg, outputs)
    trl = ChunkedLogProbFunction.apply(hidden, weight, bias, targets, *cfg, outputs)
    for a, b in zip(mine, trl):
        close(a, b, 1e-6) if (a is None or a.dtype != torch.bool) else torch.testing.assert_close(a, b)


def test_token_chunking(monkeypatch):
    """Several token chunks (last one partial) give the same result as TRL chunked the same way."""
    monkeypatch.setattr(trl_kernel, "TOKEN_CHUNK_SIZE", 8)
    hidden, weight, bias, targets, scale = make_inputs(torch.float32, True, seed=4)
    cfg, grads = CASES[1], (randn(N, 102), randn(N, 103))
    mine, (gh, gw, gb) = run(RowScaledChunkedLogProb, hidden, weight, bias, targets, cfg, grads, scale)
    trl, (th, _, _) = run(ChunkedLogProbFunction, hidden, weight, bias, targets, cfg, grads)
    _, (_, tw, tb) = run(ChunkedLogProbFunction, hidden, weight, bias, targets, cfg, scaled(grads, scale))
    for a, b in zip(mine[:4], trl[:4]):
        close(a, b, 1e-6)
    close(gh, th, 1e-6)
    close(gw, tw, 2e-6)
    close(gb, tb, 2e-6)


def test_autocast_bf16():
    """Under bf16 autocast the tile GEMMs run in bf16 as in TRL: forward and grad_hidden match TRL's."""
    hidden, weight, bias, targets, scale = make_inputs(torch.float32, True, seed=5)
    cfg, grads = CASES[0], (randn(N, 104), randn(N, 105))
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16):
        mine, (gh, gw, gb) = run(RowScaledChunkedLogProb, hidden, weight, bias, targets, cfg, grads, scale)
        trl, (th, _, _) = run(ChunkedLogProbFunction, hidden, weight, bias, targets, cfg, grads)
        _, (_, tw, tb) = run(ChunkedLogProbFunction, hidden, weight, bias, targets, cfg, scaled(grads, scale))
    for a, b in zip(mine, trl):
        close(a, b, 1e-6) if a.dtype != torch.bool else torch.testing.assert_close(a, b)
    close(gh, th, 1e-6)
    assert gw.dtype == torch.float32
    # weight side: the bf16 rounding of the logits grad falls before (TRL) vs. after (here) the row scaling
    close(gw, tw, 3e-2)
    close(gb, tb, 3e-2)


@pytest.mark.parametrize("trainable", ["hidden", "weight", "bias", "all"])
def test_needs_input_grad_skips_gemms(monkeypatch, trainable):
    calls = []
    real = fused_head.addmm_fp32
    monkeypatch.setattr(fused_head, "addmm_fp32", lambda acc, a, b: (calls.append(a.shape), real(acc, a, b)))
    hidden, weight, bias, targets, scale = make_inputs(torch.float32, True, seed=6)
    h, w, b = (t.detach().clone().requires_grad_(trainable in (name, "all")) for name, t in
               (("hidden", hidden), ("weight", weight), ("bias", bias)))
    cfg = CASES[0]  # chunk 16 -> 4 vocab tiles
    out = RowScaledChunkedLogProb.apply(h, w, b, targets, scale, *cfg, ("entropy",))
    (out[0].sum() + out[1].sum()).backward()
    n_tiles = -(-V // cfg[1])
    assert len(calls) == n_tiles * ({"hidden": 1, "weight": 1, "bias": 0, "all": 2}[trainable])
    assert (h.grad is not None, w.grad is not None, b.grad is not None) == tuple(
        trainable in (name, "all") for name in ("hidden", "weight", "bias")
    )


def test_equals_two_call_approach():
    """Log-prob-only path: one call equals the two TRL calls + RowScale the ISOPO head uses today."""
    hidden, weight, _, targets, scale = make_inputs(torch.float32, False, seed=7)
    cfg, gl = CASES[1], randn(N, 106)
    h, w, _ = leaves(hidden, weight, None)
    main = ChunkedLogProbFunction.apply(h, w.detach(), None, targets, *cfg, ())
    side = ChunkedLogProbFunction.apply(h.detach(), w, None, targets, *cfg, ())
    logp = main[0] + RowScale.apply(side[0] - side[0].detach(), scale)
    two = torch.autograd.grad((gl * logp).sum(), (h, w))
    mine, one = run(RowScaledChunkedLogProb, hidden, weight, None, targets, cfg, (gl, None), scale, ())
    close(mine[0], logp, 1e-6)
    close(one[0], two[0], 1e-6)
    close(one[1], two[1], 2e-6)


def test_row_scale_shape_checked():
    hidden, weight, bias, targets, _ = make_inputs(torch.float32, False)
    with pytest.raises(ValueError, match="row_scale"):
        RowScaledChunkedLogProb.apply(hidden, weight, bias, targets, torch.ones(N + 1, device=DEVICE), *CASES[0], ())


@pytest.mark.parametrize("chunk_size", [7, 64])  # tied ids in different tiles / in one tile
def test_is_top1_first_argmax_ties(chunk_size):
    """Two identical head rows tie for the max: only the earlier id counts as top-1 (torch.argmax semantics)."""
    hidden, weight, _, targets, scale = make_inputs(torch.float32, False, seed=8)
    weight[10] = weight[3] = hidden[0] * 3  # dominant for every row close to hidden[0]
    hidden[:] = hidden[0] + 0.01 * hidden
    targets[: N // 2], targets[N // 2 :] = 3, 10
    cfg = (0.7, chunk_size, 2.5, 1.3)
    mine = RowScaledChunkedLogProb.apply(hidden, weight, None, targets, scale, *cfg, ("is_top1",))[4]
    trl = ChunkedLogProbFunction.apply(hidden, weight, None, targets, *cfg, ("is_top1",))[4]
    torch.testing.assert_close(mine, trl)
    assert mine[: N // 2].all() and not mine[N // 2 :].any()


@pytest.mark.parametrize("cfg", CASES[:2])
def test_entropy_only_loss(cfg):
    """Loss on the entropy alone: grad_logprobs reaches backward as None."""
    hidden, weight, bias, targets, scale = make_inputs(torch.float64, True, seed=9)
    ge = randn(N, 107)
    res = []
    mine, trl = RowScaledChunkedLogProb, ChunkedLogProbFunction
    calls = [(mine, (scale,), ge), (trl, (), ge), (trl, (), ge * scale)]  # grad_w/b: TRL with ge scaled
    for fn, s, g in calls:
        h, w, b = leaves(hidden, weight, bias)
        out = fn.apply(h, w, b, targets, *s, *cfg, ("entropy",))
        res.append(torch.autograd.grad((g * out[1]).sum(), (h, w, b)))
    (gh, gw, gb), (th, _, _), (_, tw, tb) = res
    close(gh, th, 1e-6)
    close(gw, tw, 2e-6)
    close(gb, tb, 2e-6)
    _, rh, rw, rb = dense_reference(hidden, weight, bias, targets, cfg, (torch.zeros(N, device=DEVICE), ge), scale)
    close(gh, rh, 2e-5)
    close(gw, rw, 2e-5)
    close(gb, rb, 2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("cfg", CASES[:2])
def test_bitwise_trl_kernel(dtype, cfg):
    """The forward is TRL's and the backward folds with TRL's kernel: with row_scale = 1 every output and gradient is
    bit-identical to TRL's, and with any row_scale the hidden-state gradient still is."""
    hidden, weight, bias, targets, scale = make_inputs(dtype, True, seed=10)
    grads = (randn(N, 108), randn(N, 109))
    trl, trl_grads = run(ChunkedLogProbFunction, hidden, weight, bias, targets, cfg, grads)
    for s in (torch.ones(N, device=DEVICE), scale):
        mine, mine_grads = run(RowScaledChunkedLogProb, hidden, weight, bias, targets, cfg, grads, s)
        for a, b in zip(mine, trl):
            assert torch.equal(a, b)
        assert torch.equal(mine_grads[0], trl_grads[0])
        if s is not scale:
            assert torch.equal(mine_grads[1], trl_grads[1]) and torch.equal(mine_grads[2], trl_grads[2])
        else:
            assert not torch.equal(mine_grads[1], trl_grads[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("softcap", [None, 2.5])
@pytest.mark.parametrize("grads", ["logprobs", "entropy", "both"])
def test_inplace_fold_is_trl_fold_bit_for_bit(dtype, softcap, grads):
    """`backward_tile_inplace` (the CPU fold) gives exactly TRL's `_backward_tile` on the same tile, targets inside
    and outside the tile's vocabulary range."""
    g = torch.Generator().manual_seed(12)
    n, c, v0 = 9, 16, 32
    tile = (torch.randn(n, c, generator=g) * 3).to(dtype)
    targets = torch.tensor([32, 47, 40, 3, 60, 33, 46, 0, 39])
    log_z = torch.randn(n, generator=g) + 4
    entropy = torch.rand(n, generator=g) * 3
    gl = torch.randn(n, generator=g) if grads != "entropy" else None
    ge = torch.randn(n, generator=g) if grads != "logprobs" else None
    tile, targets, log_z, entropy, gl, ge = (t.to(DEVICE) if t is not None else None
                                             for t in (tile, targets, log_z, entropy, gl, ge))
    kw = dict(logit_scale=1.3, softcap=softcap or 1.0, inv_t=1 / 0.7, HAS_SOFTCAP=softcap is not None,
              HAS_LOGPROB_GRAD=gl is not None, HAS_ENTROPY_GRAD=ge is not None, BLOCK_SIZE=1024)
    a, b = tile.clone(), tile.clone()
    args = (targets, log_z, entropy, gl if gl is not None else log_z, ge if ge is not None else log_z, v0, c)
    trl_kernel._backward_tile(a, a.stride(0), *args, **kw)
    fused_head.backward_tile_inplace(b, b.stride(0), *args, **kw)
    assert torch.equal(a, b) and a.abs().sum() > 0
