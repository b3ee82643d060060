"""The ISOPO Function inside TRL's loss path: exactness limits, checkpointing, LoRA, accumulation, scale invariance."""

import pytest
import torch
from isopo_oracle import make_batch, make_trainer, rel_err, surrogate_logps
from peft import LoraConfig

from trl_isopo.isopo.isopo_backward import ISOPOSettings
from math_settings import isopo_settings
from trl_isopo.tiny import build_tiny_causal_lm


def isopo_backward(trainer, inputs):
    with trainer.isopo_active():
        trainer.compute_loss(trainer.model, inputs).backward()


def grads(trainer):
    return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def set_settings(trainer, **kw):
    trainer.isopo_backward.settings = ISOPOSettings(**{**trainer.isopo_backward.settings.__dict__, **kw})


def lora_config():
    return LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM", init_lora_weights=False,  # random lora_B so lora_A's gradient is not identically 0
    )


@pytest.mark.parametrize("checkpointing", ["off", "non-reentrant", "reentrant"])
@pytest.mark.parametrize("lora", [False, True])
def test_unit_weights_equal_plain_advantage_weighted_autograd(tiny_tokenizer, tmp_path, checkpointing, lora):
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=3)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, peft_config=lora_config() if lora else None)
    if checkpointing != "off":
        # What Trainer.train() does with gradient_checkpointing=True (the TRL default); recompute runs in backward.
        trainer.model.gradient_checkpointing_enable({"use_reentrant": checkpointing == "reentrant"})
        trainer.model.enable_input_require_grads()
        assert trainer.model.is_gradient_checkpointing
    if lora:
        assert all(".lora_" in n for n in trainer.isopo_coverage["covered"])
    inputs = make_batch(tiny_tokenizer, seed=11)
    A = inputs["advantages"].double()
    # Plain autograd of the advantage-weighted (REINFORCE) loss, outside the ISOPO window.
    trainer.model.zero_grad(set_to_none=True)
    logps = surrogate_logps(trainer, inputs)
    mask = inputs["completion_mask"]
    (-(A[:, None] * logps * mask).sum() / mask.sum()).backward()
    want = grads(trainer)
    # ISOPO with every per-sequence coefficient forced to A_i (i.e. all ISOPO weights 1).
    trainer.model.zero_grad(set_to_none=True)
    trainer.isopo_backward.weight_override = lambda name, adv: adv
    try:
        isopo_backward(trainer, inputs)
    finally:
        trainer.isopo_backward.weight_override = None
    got = grads(trainer)
    assert set(got) == set(want) and len(got) > 0
    for n in want:
        tol = 1e-6 if n.startswith("lm_head") else 1e-12  # fused head accumulates its weight grad in fp32
        assert rel_err(got[n], want[n]) < tol, n


@pytest.mark.parametrize("knobs", [dict(p=-1.0, q=0.0, r=0.0), dict(p=0.0, q=-1.0, r=0.0), dict(p=0.0, q=-1.0, r=-2.0)])
def test_gradient_accumulation_sums_and_c0_scale_invariance(tiny_tokenizer, tmp_path, knobs):
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=5)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path)
    set_settings(trainer, **knobs, reg=0.0, fisher_tokens=0)
    mb1, mb2 = make_batch(tiny_tokenizer, seed=1), make_batch(tiny_tokenizer, seed=2)
    covered = [f"{n}.weight" for n in trainer.isopo_coverage["covered"]]
    trainer.current_gradient_accumulation_steps = 2
    separate = []
    for mb in (mb1, mb2):
        trainer.model.zero_grad(set_to_none=True)
        isopo_backward(trainer, mb)
        separate.append(grads(trainer))
    trainer.model.zero_grad(set_to_none=True)
    isopo_backward(trainer, mb1)
    isopo_backward(trainer, mb2)  # accumulates into .grad like the Trainer's micro-steps
    accumulated = grads(trainer)
    for n in accumulated:
        assert rel_err(accumulated[n], separate[0][n] + separate[1][n]) < 1e-12, n
    # c = 0: a step of GA=2 micro-batches is a mean over twice the sequences (docs/isopo.md "Batch semantics"), so one
    # micro-batch's share halves, for the covered layers exactly as for the ordinary (advantage-weighted) gradients
    # of the other parameters; the coefficients themselves do not see the surrogate's scale (no absolute guards: the
    # reference's 1 / (R + 1e-8) made this 5e-4 for r = -2 on this tiny model).
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.zero_grad(set_to_none=True)
    isopo_backward(trainer, mb1)
    unscaled = grads(trainer)
    for n in covered:
        assert rel_err(unscaled[n], 2 * separate[0][n]) < 1e-10, n
    emb = "model.embed_tokens.weight"
    assert rel_err(unscaled[emb], 2 * separate[0][emb]) < 1e-12


def test_regularized_setting_keeps_coefficients_and_scales_like_reinforce(tiny_tokenizer, tmp_path):
    """Contrast with the test above: with c = 1 and a stored EMA the coefficients see the statistics times the loss
    normalizer, so halving the loss (GA = 2) leaves them unchanged and the covered gradient halves exactly, like an
    ordinary gradient (the reference would have compared the halved statistics with the stored EMA)."""
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=5)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path)
    set_settings(trainer, p=-1.0, reg=1.0, fisher_tokens=0)
    trainer.isopo_backward.ema.ema = {f"{n}/f": 1.0 for n in trainer.isopo_coverage["covered"]}  # R ~ 1: unnormalized
    mb = make_batch(tiny_tokenizer, seed=1)
    out = []
    for ga in (1, 2):
        trainer.current_gradient_accumulation_steps = ga
        trainer.model.zero_grad(set_to_none=True)
        isopo_backward(trainer, mb)
        out.append(grads(trainer))
    for n in trainer.isopo_coverage["covered"]:
        assert rel_err(out[0][f"{n}.weight"], 2 * out[1][f"{n}.weight"]) < 1e-12, n


def test_bf16_autocast_runs_and_stays_close(tiny_tokenizer, tmp_path):
    """Under CPU bf16 autocast the Function casts like autocast; statistics are computed in float32."""
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float32, seed=6)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path)
    set_settings(trainer, p=-1.0, reg=0.0, fisher_tokens=0)
    mb = make_batch(tiny_tokenizer, seed=4)
    trainer.model.zero_grad(set_to_none=True)
    isopo_backward(trainer, mb)
    ref = grads(trainer)
    trainer.model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        isopo_backward(trainer, mb)
    got = grads(trainer)
    for n in ref:
        assert got[n].dtype == torch.float32 and torch.isfinite(got[n]).all()
        assert rel_err(got[n], ref[n]) < 0.1, n


@pytest.mark.parametrize("knobs", [(-1.0, 0.0, 0.0), (0.0, -1.0, 0.0), (0.0, -1.0, -2.0)])
def test_scale_invariance_is_exact_away_from_eps(knobs):
    """c = 0: scaling the output gradients G by any factor leaves sum_i w_i V_i unchanged (pure functions)."""
    from trl_isopo.isopo.reweight import fisher_norm, isopo_sequence_scales, relative_overlap
    from trl_isopo.layerwise.statistics import sequence_statistics
    from trl_isopo.layerwise.weight_grad import reweighted_weight_grad

    p, q, r = knobs
    g = torch.Generator().manual_seed(0)
    X = torch.randn(4, 6, 5, generator=g, dtype=torch.float64)
    G = torch.randn(4, 6, 3, generator=g, dtype=torch.float64)
    A = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=torch.float64)
    sample = torch.arange(24)
    out = []
    for scale in (1e2, 1e5):
        st = sequence_statistics(X, G * scale, sample, fisher=True, ntk=False)
        e = st.e2.sqrt()
        f = fisher_norm(st.fisher_num, st.fisher_den)
        s = isopo_sequence_scales(e, f, relative_overlap(f, e), {"e": 0.0, "f": 0.0, "rho": 0.0}, p, q, r, 0.0)
        out.append(reweighted_weight_grad(X, G * scale, A * s, st)[0])
    assert rel_err(out[0], out[1]) < 1e-10


def test_statistics_identical_with_and_without_checkpointing(tiny_tokenizer, tmp_path):
    """Real ISOPO weights (c = 1 with a stored EMA, seeded Fisher sample): GC recompute changes nothing."""
    out = {}
    for mode in ("off", "non-reentrant", "reentrant"):
        model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=8)
        trainer = make_trainer(model, tiny_tokenizer, tmp_path / mode)
        set_settings(trainer, p=-1.0, q=-1.0, r=0.0, reg=1.0, fisher_tokens=9)
        trainer.isopo_backward.ema.ema = {
            f"{n}/{k}": 1e-5 for n in trainer.isopo_coverage["covered"] for k in ("e", "f")
        }
        if mode != "off":
            trainer.model.gradient_checkpointing_enable({"use_reentrant": mode == "reentrant"})
            trainer.model.enable_input_require_grads()
        trainer.model.zero_grad(set_to_none=True)
        isopo_backward(trainer, make_batch(tiny_tokenizer, seed=3))
        out[mode] = grads(trainer)
    for mode in ("non-reentrant", "reentrant"):
        for n in out["off"]:
            assert rel_err(out[mode][n], out["off"][n]) < 1e-13, (mode, n)


def test_fisher_sample_is_a_seeded_subset_of_valid_positions(tiny_tokenizer, tmp_path):
    """The sample has the fixed size min(k, B*L) (no host read of the valid count); its valid picks are min(k, N)
    distinct valid positions, fresh per layer, reproducible per seed and independent of the global RNG. (Updated
    with the on-device sampler: when k >= N the sample is padded with padding positions, which add exactly 0; for
    k <= 0 or k >= B*L it is every position.)"""
    from trl_isopo.layerwise.micro_batch import MicroBatch

    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=1)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path)
    ctx = trainer.isopo_backward
    set_settings(trainer, fisher_tokens=6)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    mask[0, 2:] = mask[1, :] = mask[2, 4] = True
    mb = MicroBatch(mask=mask, advantages=torch.ones(3), seed=11)
    flat = mask.reshape(-1)
    valid = set(flat.nonzero().squeeze(1).tolist())
    names = trainer.isopo_coverage["covered"]
    samples = {n: ctx.fisher_sample(n, mb) for n in names}
    for J in samples.values():
        assert len(J) == 6 and len(set(J.tolist())) == 6 and set(J.tolist()) <= valid
    assert len({tuple(J.tolist()) for J in samples.values()}) > 1  # fresh per layer
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)  # the global RNG plays no part
        again = ctx.fisher_sample(names[0], MicroBatch(mask=mask, advantages=torch.ones(3), seed=11))
    assert torch.equal(samples[names[0]], again)
    assert not torch.equal(samples[names[0]], ctx.fisher_sample(names[0], MicroBatch(mask=mask, advantages=torch.ones(3), seed=12)))
    set_settings(trainer, fisher_tokens=12)  # more than the 9 valid positions, fewer than B*L = 15
    J = ctx.fisher_sample(names[0], mb)
    assert len(J) == 12 and len(set(J.tolist())) == 12 and set(J[flat[J]].tolist()) == valid
    for k in (100, 0):  # every position
        set_settings(trainer, fisher_tokens=k)
        assert torch.equal(ctx.fisher_sample(names[0], mb), torch.arange(15))


def test_fisher_sample_is_uniform_over_valid_positions():
    """The k smallest of i.i.d. keys (padding keyed +inf) is a uniform k-subset of the valid positions: every valid
    position is included with probability k / N, every pair with k (k - 1) / (N (N - 1))."""
    from trl_isopo.isopo.isopo_backward import fisher_token_sample

    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[0, 1:] = mask[1, :2] = mask[2, 3] = True  # N = 6 valid of 12
    k, n_draws = 3, 6000
    gen = torch.Generator().manual_seed(0)
    hits = torch.zeros(12, dtype=torch.float64)
    pairs = torch.zeros(12, 12, dtype=torch.float64)
    for _ in range(n_draws):
        J = fisher_token_sample(mask, k, gen)
        ind = torch.zeros(12, dtype=torch.float64).index_fill_(0, J, 1.0)
        hits += ind
        pairs += ind[:, None] * ind[None, :]
    flat = mask.reshape(-1)
    assert hits[~flat].sum() == 0
    p = hits[flat] / n_draws  # binomial: std sqrt(0.25 / 6000) = 0.0065
    assert (p - k / 6).abs().max() < 0.03, p
    off = pairs[flat][:, flat][~torch.eye(6, dtype=torch.bool)] / n_draws
    assert (off - k * (k - 1) / 30).abs().max() < 0.03, off


def test_lora_default_init_zero_lora_B(tiny_tokenizer, tmp_path):
    """PEFT initializes lora_B = 0, so lora_A's output gradient is exactly 0 at step 0: its ISOPO gradient must be 0
    (finite), lora_B's must match the dense formula, and the zero statistics must not enter the EMA."""
    from isopo_oracle import dense_weights, per_sequence_data

    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=3)
    lc = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, peft_config=lc)
    inputs = make_batch(tiny_tokenizer, seed=2)
    data = per_sequence_data(trainer, inputs)
    valid = data["mask"].reshape(-1).nonzero().squeeze(1)
    for interacting in (False, True):
        set_settings(trainer, p=-1.0, reg=1.0, fisher_tokens=0, interacting=interacting)
        trainer.model.zero_grad(set_to_none=True)
        isopo_backward(trainer, inputs)
        got = grads(trainer)
        for n in trainer.isopo_coverage["covered"]:
            g = got[f"{n}.weight"]
            assert torch.isfinite(g).all()
            if "lora_A" in n:
                assert torch.count_nonzero(g) == 0
            elif not interacting:
                w, _ = dense_weights(data["V"][n], data["X"][n], data["G"][n], valid, inputs["advantages"], -1.0, 0, 0, 1.0)
                assert rel_err(g, torch.einsum("b,boi->oi", w, data["V"][n])) < 1e-10, n
        trainer.isopo_backward.ema.end_step()
        assert not any("lora_A" in k for k in trainer.isopo_backward.ema.ema)
        assert any("lora_B" in k for k in trainer.isopo_backward.ema.ema)
        trainer.isopo_backward.ema.ema = {}


def test_masked_input_cache_never_serves_a_freed_input():
    """Layers reading one input share its masked copy, keyed by address. Under gradient checkpointing a recomputed
    input can land at the address of a freed one (with a fresh version counter): the cache must keep its input alive
    so that such a tensor can never hit another layer's masked copy (the CPU allocator reuses small blocks at once;
    the CUDA caching allocator does so for every size)."""
    from trl_isopo.isopo.isopo_backward import ISOPOBackward
    from trl_isopo.layerwise.micro_batch import MicroBatch

    ctx = ISOPOBackward(isopo_settings())
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[0, :2] = False
    mb = MicroBatch(mask=mask, advantages=torch.ones(2))
    pad = ~mask.unsqueeze(-1)
    for i in range(300):
        x1 = torch.full((2, 5, 3), float(i))
        ctx.masked_input(x1, mb, torch.float32)
        del x1
        x2 = torch.full((2, 5, 3), -1.0 - i)  # a different layer's input, allocated right after the free
        assert torch.equal(ctx.masked_input(x2, mb, torch.float32), x2.masked_fill(pad, 0.0)), i
        X = ctx.masked_input(x2, mb, torch.float32)
        assert X is ctx.masked_input(x2.view(2, 5, 3), mb, torch.float32)  # the same input still shares one copy


@pytest.mark.parametrize("narrow", ["x", "g"])
def test_layer_grads_fill_padding_of_the_narrow_operand_in_a_copy(narrow):
    """The narrower operand's padding rows are set to 0 in a copy, never multiplied by the mask: they may hold NaN or
    inf (a pad token's hidden state). The caller's tensors are left untouched, and the gradient equals that of inputs
    that were clean to begin with. The wider operand must only be finite there, as for autograd's own G^T X."""
    from trl_isopo.isopo.isopo_backward import ISOPOBackward
    from trl_isopo.layerwise.micro_batch import MicroBatch

    B, L = 3, 6
    d_in, d_out = (3, 7) if narrow == "x" else (7, 3)
    gen = torch.Generator().manual_seed(4)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, :2] = mask[2, 4:] = False
    pad = ~mask.unsqueeze(-1)
    x = torch.randn(B, L, d_in, generator=gen, dtype=torch.float64)
    g = torch.randn(B, L, d_out, generator=gen, dtype=torch.float64)
    clean_x, clean_g = x.masked_fill(pad, 0.0), g.masked_fill(pad, 0.0)
    dirty = x if narrow == "x" else g
    n = int(pad.sum()) * dirty.shape[-1]  # padding entries: NaN, inf, -inf in turn
    dirty[pad.expand_as(dirty)] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=torch.float64).repeat(n)[:n]
    other = g if narrow == "x" else x
    other[pad.expand_as(other)] = 1e3  # finite garbage in the wider operand
    before = (x.clone(), g.clone())
    A = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    grads = []
    for xi, gi in ((x, g), (clean_x, clean_g)):
        ctx = ISOPOBackward(isopo_settings(p=-1.0, q=-0.5, r=0.3, fisher_tokens=5))
        gw, gb = ctx.layer_grads("layer", xi, gi, MicroBatch(mask=mask, advantages=A, seed=3), True)
        grads.append((gw, gb))
    assert torch.isfinite(grads[0][0]).all() and torch.isfinite(grads[0][1]).all()
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close((x, g), before, rtol=0, atol=0, equal_nan=True)


def test_zero_padding_is_a_contiguous_copy_with_padding_rows_zeroed():
    """Always a new contiguous tensor (no host read of the mask for a "no padding" shortcut, updated with the
    sync-free fill), valid rows bit-identical (NaN and -0.0 included), padding rows +0.0 whatever they held."""
    from trl_isopo.layerwise.micro_batch import MicroBatch

    t = torch.randn(2, 4, 5).transpose(0, 1).contiguous().transpose(0, 1)  # a non-contiguous (2, 4, 5) input
    full = MicroBatch(mask=torch.ones(2, 4, dtype=torch.bool), advantages=torch.ones(2))
    out = full.zero_padding(t, torch.float32)
    assert out is not t and out.is_contiguous() and torch.equal(out, t)
    mask = torch.ones(2, 4, dtype=torch.bool)
    mask[1, 3] = mask[0, 0] = False
    t[1, 3] = float("nan")
    t[0, 0, 0] = -float("inf")
    t[0, 1, 0], t[0, 1, 1] = -0.0, float("nan")  # a valid row keeps its exact bits
    mb = MicroBatch(mask=mask, advantages=torch.ones(2))

    def bits(x):
        return x.contiguous().view({8: torch.int64, 4: torch.int32, 2: torch.int16}[x.element_size()])

    for dt in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        for src in (t, t.to(dt)):  # with and without a cast
            out = mb.zero_padding(src, dt)
            assert out.is_contiguous() and out.dtype == dt
            assert torch.equal(bits(out), bits(src.to(dt).masked_fill(~mask.unsqueeze(-1), 0.0))), dt


def test_weight_used_outside_its_forward_raises(tiny_tokenizer, tmp_path):
    """A covered layer whose weight is used by another op (here a custom MLP forward calling F.linear on
    down_proj.weight) would get an ordinary, reward-free gradient: the ISOPO window raises, naming the layer. The
    unmodified model in the same trainer trains normally (a negative control)."""
    import types

    import torch.nn.functional as F

    model = build_tiny_causal_lm(tiny_tokenizer, seed=2)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path)
    inputs = make_batch(tiny_tokenizer)
    with trainer.isopo_active():
        trainer.compute_loss(trainer.model, inputs).backward()  # every covered layer had its ISOPO backward
    mlp = trainer.model.model.layers[1].mlp

    def forward(self, x):  # the same values, but down_proj's weight used without calling the module
        return F.linear(self.act_fn(self.gate_proj(x)) * self.up_proj(x), self.down_proj.weight)

    mlp.forward = types.MethodType(forward, mlp)
    with pytest.raises(RuntimeError, match=r"model\.layers\.1\.mlp\.down_proj.*used outside the module's own forward"):
        with trainer.isopo_active():
            trainer.compute_loss(trainer.model, inputs).backward()
    assert trainer.isopo_backward.calls == {}  # cleared for the next micro-batch


def test_compute_loss_backward_outside_the_isopo_window_is_refused(tiny_tokenizer, tmp_path):
    """compute_loss + backward outside training_step would give the covered layers the advantage-free gradient of
    -log pi: refused with the way out; under no_grad (logging, evaluation) it still reports the loss."""
    trainer = make_trainer(build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=5), tiny_tokenizer, tmp_path)
    inputs = make_batch(tiny_tokenizer, seed=1)
    with pytest.raises(RuntimeError, match="isopo_active"):
        trainer.compute_loss(trainer.model, inputs)
    with torch.no_grad():
        assert torch.isfinite(trainer.compute_loss(trainer.model, inputs))
    with trainer.isopo_active():
        trainer.compute_loss(trainer.model, inputs).backward()
