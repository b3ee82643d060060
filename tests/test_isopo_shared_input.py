"""ISOPO's Fisher sample and its input products, made once per distinct layer input (q/k/v, gate/up, LoRA A's).

What is checked: a follower's gradient and metrics equal, bit for bit, the unshared layer's fed the first layer's
sample, whichever operand each layer masked, with the sample holding padding positions or not; the first layer is
unchanged; in a real step the sample is drawn and the input products are made once per distinct input and
micro-batch; "auto" prices a follower without the input side; a follower's Fisher estimate keeps its distribution
(Monte Carlo against its own draw), while the test tells a biased sample apart. The float64 oracle of a whole model
with the samples the layers read is tests/test_isopo_bf16.py's model test.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from isopo_steps import micro_batch, prepared_trainer  # noqa: E402

from math_settings import isopo_settings  # noqa: E402
from trl_isopo import ISOPOConfig, ISOPOTrainer  # noqa: E402
from trl_isopo.isopo import layer as layer_module  # noqa: E402
from trl_isopo.isopo.isopo_backward import ISOPOBackward  # noqa: E402
from trl_isopo.layerwise import costs, statistics  # noqa: E402
from trl_isopo.layerwise.micro_batch import MicroBatch  # noqa: E402

F64 = torch.float64
B, L, D_IN = 3, 8, 10
FIRST, FOLLOWER = 4, 12  # output widths: the first layer masks G (narrower), the follower masks X


def operands(seed, dtype=F64):
    """x (B, L, D_IN) with finite garbage at padding, one output gradient per layer (finite garbage too), mask, A."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, :3] = False
    mask[2, 6:] = False
    x = torch.randn(B, L, D_IN, generator=g, dtype=dtype)
    gs = [torch.randn(B, L, d, generator=g, dtype=dtype) for d in (FIRST, FOLLOWER)]
    return x, gs, mask, torch.randn(B, generator=g, dtype=dtype)


def backward(**knobs) -> ISOPOBackward:
    ctx = ISOPOBackward(isopo_settings(**knobs))
    ctx.layer_index = {"first": 0, "follower": 1}  # as `install` numbers covered layers: distinct seeds
    return ctx


@pytest.mark.parametrize("route", ["gram", "auto"])
@pytest.mark.parametrize("k", [5, 40], ids=["sampled", "with-padding"])  # 19 valid of 24 positions
@pytest.mark.parametrize("knobs", [dict(p=-1.0, reg=0.0), dict(p=-1.0, reg=1.0), dict(p=0.0, q=-1.0, r=-2.0),
                                   dict(p=0.0, q=-1.0, reg=1.0)], ids=["p=-1,c=0", "p=-1,c=1", "fig6", "q=-1,c=1"])
def test_follower_equals_unshared_layer_fed_the_first_layers_sample(route, k, knobs):
    """Both layers read one input tensor x: the first draws J and makes the input side (X a_J^T; the e^2 blocks
    X_i X_i^T for q, r != 0); the follower reuses them. Its gradient, bias gradient and metrics record equal those of
    an unshared call (a copy of x, so no cache hit) with the first layer's sample, bit for bit; the first layer's
    equal its unshared call. q = -1 alone draws no sample: its shared e^2 blocks are exact."""
    x, (g1, g2), mask, A = operands(k)
    settings = dict(knobs, route=route, fisher_tokens=k)
    ctx = backward(**settings)
    drawn = []
    inner = ctx.shared_fisher_sample
    ctx.shared_fisher_sample = lambda call: drawn.append(inner(call)) or drawn[-1]
    mb = MicroBatch(mask=mask, advantages=A, seed=3)
    shared = [ctx.layer_grads(name, x, g, mb, True) for name, g in (("first", g1), ("follower", g2))]
    fisher = ctx.settings.needs_fisher
    assert (drawn[0] is drawn[1]) if fisher else not drawn  # one sample for both
    assert len(ctx.inputs._entries) == 1
    entry = next(iter(ctx.inputs._entries.values()))
    # A layer on "gram" made them (with k = 40 under "auto" the first layer takes "mat", the follower "gram").
    assert any(key[0] == "isopo_gram_input" for key in entry.statistics)
    records = ctx.records[:]
    for i, (name, g) in enumerate((("first", g1), ("follower", g2))):
        ref = backward(**settings)
        ref.sampler.override = {name: drawn[0]} if fisher else None  # per layer: no sharing
        gw, gb = ref.layer_grads(name, x.clone(), g, MicroBatch(mask=mask, advantages=A, seed=3), True)
        assert torch.equal(gw, shared[i][0]) and torch.equal(gb, shared[i][1]), name
        assert torch.equal(ref.records[0], records[i]), name


def test_first_layer_draws_with_its_own_seed():
    """The shared sample is the first layer's own draw; drawn by the follower alone it would differ (the law of
    each J is that of `fisher_token_sample`, tested in tests/test_isopo_mechanics.py)."""
    x, (g1, g2), mask, A = operands(1)
    ctx = backward(p=-1.0, route="gram", fisher_tokens=6)
    mb = MicroBatch(mask=mask, advantages=A, seed=9)
    used = []
    inner = ctx.shared_fisher_sample
    ctx.shared_fisher_sample = lambda call: used.append(inner(call)) or used[-1]
    ctx.layer_grads("follower", x, g2, mb, False)  # the follower runs first here: it owns the draw
    ctx.layer_grads("first", x, g1, mb, False)
    assert torch.equal(used[1], ctx.fisher_sample("follower", mb))
    assert not torch.equal(used[1], ctx.fisher_sample("first", mb))


def test_input_products_kept_only_when_they_fit_one_block():
    """Over the budget the numerator runs in blocks of positions and nothing is kept: each layer its own products."""
    x, (g1, g2), mask, A = operands(2)
    S = costs.gathered_rows(6)
    budget = 2 * B * S * 8 * (L // 2)  # half of the positions per block
    assert costs.fisher_rows_per_chunk(B, L, S, 8, budget) == L // 2
    ctx = backward(p=-1.0, route="gram", fisher_tokens=6, budget_bytes=budget)
    mb = MicroBatch(mask=mask, advantages=A, seed=4)
    for name, g in (("first", g1), ("follower", g2)):
        ctx.layer_grads(name, x, g, mb, False)
    entry = next(iter(ctx.inputs._entries.values()))
    assert [key[0] for key in entry.statistics] == ["isopo_fisher_sample"]


def test_input_side_kept_within_half_the_budget_for_the_euclidean_blocks():
    """`costs.gram_input_kept`: the e^2 blocks (B tri(L) floats) are kept up to half the budget; one float more and
    every layer makes its own (q = -1, no sample)."""
    b, l = 2, 160  # rows in blocks of 64 (`costs.TRI_ROWS`) against the remaining columns
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(b, l, generator=g) > 0.1
    x, g1, g2 = (torch.randn(b, l, d, generator=g, dtype=F64) for d in (D_IN, FIRST, FOLLOWER))
    step = costs.euclid_rows_per_chunk(b, l, 8, costs.DEFAULT_BUDGET_BYTES)
    need = b * costs.tri_work(l, step) * 8
    assert step == costs.TRI_ROWS and need == b * (64 * 160 + 64 * 96 + 32 * 32) * 8
    for budget, kept in ((2 * need, True), (2 * need - 16, False)):
        assert costs.euclid_rows_per_chunk(b, l, 8, budget) == step
        assert costs.gram_input_kept(b, l, 0, False, True, 8, budget) == kept
        ctx = backward(p=0.0, q=-1.0, route="gram", budget_bytes=budget)
        mb = MicroBatch(mask=mask, advantages=torch.randn(b, generator=g, dtype=F64), seed=4)
        for name, gr in (("first", g1), ("follower", g2)):
            ctx.layer_grads(name, x, gr, mb, False)
        entry = next(iter(ctx.inputs._entries.values()))
        assert len(entry.statistics) == kept


def test_auto_prices_a_follower_without_the_input_side(monkeypatch):
    """At a shape where the input side decides, "auto" picks "mat" for the first layer and "gram" for a follower
    whose input products exist (the model: `route_costs(..., input_shared=True)`)."""
    b, l, d_in, d_out, k = 2, 64, 256, 16, 24
    S = costs.gathered_rows(k)
    alone = costs.route_costs(b, l, d_in, d_out, S, True, False, euclidean=False)
    follower = costs.route_costs(b, l, d_in, d_out, S, True, False, euclidean=False, input_shared=True)
    assert alone.best == "mat" and follower.best == "gram"
    assert follower.gram == b * l * S * d_out and alone.gram == b * l * S * (d_in + d_out)
    g = torch.Generator().manual_seed(5)
    mask = torch.rand(b, l, generator=g) > 0.2
    x = torch.randn(b, l, d_in, generator=g)
    ctx = backward(p=-1.0, route="auto", fisher_tokens=k)
    mb = MicroBatch(mask=mask, advantages=torch.randn(b, generator=g), seed=1)
    routes = []
    inner = statistics.sequence_statistics

    def spy(*args, **kwargs):
        out = inner(*args, **kwargs)
        routes.append(out.route)
        return out

    # A first layer on "gram" (forced) leaves the products; the follower on "auto" then takes "gram" too.
    ctx.settings = isopo_settings(p=-1.0, route="gram", fisher_tokens=k)
    monkeypatch.setattr(layer_module, "sequence_statistics", spy)
    ctx.layer_grads("first", x, torch.randn(b, l, d_out, generator=g), mb, False)
    ctx.settings = isopo_settings(p=-1.0, route="auto", fisher_tokens=k)
    ctx.layer_grads("follower", x, torch.randn(b, l, d_out, generator=g), mb, False)
    ctx.layer_grads("other", x.clone(), torch.randn(b, l, d_out, generator=g), mb, False)  # no products: mat
    assert routes == ["gram", "gram", "mat"]


@pytest.mark.parametrize("knobs", [dict(p=-1.0), dict(p=0.0, q=-1.0), dict(p=-1.0, q=-1.0)], ids=["p", "q", "pq"])
@pytest.mark.parametrize("bias", [False, True])
def test_follower_gemm_count_is_the_models(bias, knobs):
    """torch's FlopCounterMode over a follower's `layer_grads` call on "gram": the output side of the Fisher
    numerator and of the e^2 blocks only, `costs.gemm_macs(..., input_shared=True)`: B L S d_out and B tri(L) d_out
    (plus the bias products)."""
    from torch.utils.flop_counter import FlopCounterMode

    b, l, d_in, d_out, k = 4, 16, 24, 40, 10
    S = costs.gathered_rows(k)
    g = torch.Generator().manual_seed(7)
    mask = torch.rand(b, l, generator=g) > 0.2
    x = torch.randn(b, l, d_in, generator=g)
    ctx = backward(**knobs, route="gram", fisher_tokens=k)
    st = ctx.settings
    mb = MicroBatch(mask=mask, advantages=torch.randn(b, generator=g), seed=2)
    ctx.layer_grads("first", x, torch.randn(b, l, d_out, generator=g), mb, bias)
    with FlopCounterMode(display=False) as counter:
        ctx.layer_grads("follower", x, torch.randn(b, l, d_out, generator=g), mb, bias)
    counted = counter.get_total_flops() / 2 - b * l * d_in * d_out  # less the weight-gradient GEMM
    S = S if st.needs_fisher else 0
    assert counted == costs.gemm_macs(b, l, d_in, d_out, S, st.needs_fisher, False, costs.DEFAULT_BUDGET_BYTES,
                                      "gram", euclidean=st.needs_euclidean, bias=bias, input_shared=True)
    euclid = b * costs.tri_work(l, l) * d_out if st.needs_euclidean else 0
    assert counted - (b * (l + 1) * d_out if bias else 0) == b * l * S * d_out + euclid


def test_follower_fisher_estimate_keeps_its_distribution():
    """Monte Carlo over 400 micro-batch seeds: the follower's Fisher norms f_i (record row 1) with the shared sample
    and with its own draw have the same mean within 5 standard errors (each J is a uniform sample of the valid
    positions either way); a sample biased to the first valid positions is told apart by the same test."""
    x, (g1, g2), mask, A = operands(6)
    k = 5
    valid = mask.reshape(-1).nonzero().squeeze(1)

    def follower_f(seed, mode):
        ctx = backward(p=-1.0, route="gram", fisher_tokens=k)
        mb = MicroBatch(mask=mask, advantages=A, seed=seed)
        if mode == "biased":
            ctx.sampler.override = {"follower": valid[:k]}
        elif mode == "shared":
            ctx.layer_grads("first", x, g1, mb, False)
        ctx.layer_grads("follower", x, g2, mb, False)
        return ctx.records[-1][1]

    runs = {mode: torch.stack([follower_f(seed, mode) for seed in range(400)]) for mode in ("shared", "own")}
    runs["biased"] = follower_f(0, "biased").unsqueeze(0)  # deterministic

    def z(a, b):
        se = (a.var(0) / a.shape[0] + (b.var(0) / b.shape[0] if b.shape[0] > 1 else 0)).sqrt()
        return ((a.mean(0) - b.mean(0)).abs() / se).max().item()

    assert z(runs["shared"], runs["own"]) < 5
    assert z(runs["own"], runs["biased"]) > 5


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_sample_and_input_products_once_per_input_in_a_training_step(tiny_tokenizer, tmp_path, monkeypatch, lora):
    """One step of 2 micro-batches on the tiny model ("gram" forced, a sample of 6 positions): one draw and one
    set of input products per distinct input and micro-batch (full weights: 4 inputs for 7 layers per block; LoRA on
    q, v, up: 5 inputs for 6 factors)."""
    draws, products = [], []
    inner_products = statistics.gram_input_statistics

    def count_products(*args):
        products.append(args[0].shape)
        return inner_products(*args)

    monkeypatch.setattr(statistics, "gram_input_statistics", count_products)
    trainer = prepared_trainer(ISOPOTrainer, ISOPOConfig, tiny_tokenizer, tmp_path, ga=2, batch_size=4, lora=lora,
                               isopo_fisher_tokens=6, isopo_route="gram")
    sampler = trainer.isopo_backward.sampler
    inner_draw = sampler.draw
    covered = set(trainer.isopo_coverage["covered"])

    def count_draws(name, *args, **kwargs):
        if name in covered:
            draws.append(name)
        return inner_draw(name, *args, **kwargs)

    sampler.draw = count_draws
    window = [micro_batch(tiny_tokenizer, seed) for seed in (5, 6)]
    trainer.model.zero_grad(set_to_none=True)
    for k, mb in enumerate(window):
        trainer.accelerator.gradient_state._set_sync_gradients(k == 1)
        items = torch.tensor(sum(int(m["completion_mask"].sum()) for m in window))
        trainer.training_step(trainer.model, {**mb, "num_items_in_batch": items}, items)
    blocks = trainer.model.config.num_hidden_layers
    per_block = (6, 5) if lora else (7, 4)  # (covered layers, distinct inputs) per block
    assert len(covered) == blocks * per_block[0]
    assert len(draws) == len(products) == 2 * blocks * per_block[1]
