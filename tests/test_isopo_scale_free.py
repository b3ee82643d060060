"""Scale-free coefficients: no absolute guards, statistics on the loss normalizer's basis, exact zeros, references.

What is invariant (docs/isopo.md, "Scale-free coefficients"):
- c > 0 and interacting: the per-sequence coefficients do not change when every V_i is multiplied by a constant k,
  provided the reference point mu (EMA history or current batch) is in the same units: either because the trainer
  divides k back out (k is the loss normalizer: tokens, GA, processes, loss_type; `MicroBatch.stat_scale`), or because
  k was there in every step of the history.
- c = 0: the coefficient is homogeneous of degree p + q in k, the update sum_i w_i V_i of degree 1 + p + q, which is
  0 for the named settings (p = -1; q = -1; p = 0, q = -1, r = -2).
"""

import pytest
import torch
from isopo_oracle import logps_grad, make_batch, make_trainer, rel_err
from trl import GRPOTrainer

from trl_isopo.isopo.isopo_backward import ISOPOBackward, ISOPOSettings
from math_settings import isopo_settings
from trl_isopo.layerwise.micro_batch import MicroBatch
from trl_isopo.isopo.reweight import isopo_sequence_scales, nonzero_median, regularized_magnitude
from trl_isopo.tiny import build_tiny_causal_lm

FACTORS = (1e-8, 1e-4, 1e-2, 1e2, 1e4)

# (p, q, r, c) of the named settings with a regularizer; "interacting" separately.
REGULARIZED = {
    "p=-1,c=1": dict(p=-1.0, reg=1.0),
    "q=-1,c=1": dict(p=0.0, q=-1.0, reg=1.0),
    "p+q+r,c=0.8": dict(p=-1.0, q=-0.5, r=-1.0, reg=0.8),
    "interacting": dict(interacting=True, interacting_reg=1.0),
}
PURE = {  # c = 0: (knobs, p + q)
    "p=-1,c=0": (dict(p=-1.0, reg=0.0), -1.0),
    "q=-1,c=0": (dict(p=0.0, q=-1.0, reg=0.0), -1.0),
    "fig6": (dict(p=0.0, q=-1.0, r=-2.0, reg=0.0), -1.0),
    "p=-1,q=-1,c=0": (dict(p=-1.0, q=-1.0, reg=0.0), -2.0),
}


def layer(seed, B=5, L=7, d_in=6, d_out=4):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) > 0.25
    mask[:, 0] = True
    X = torch.randn(B, L, d_in, generator=g, dtype=torch.float64) * mask[..., None]
    G = torch.randn(B, L, d_out, generator=g, dtype=torch.float64) * mask[..., None]
    A = torch.tensor([1.0, -0.5, 0.3, 2.0, -1.5][:B], dtype=torch.float64)
    return X, G, mask, A


def run_step(ctx, k, seeds, n=1.0, end=True):
    """One optimizer step over micro-batches `seeds` with G scaled by k and normalizer n; returns
    [(scale, w, grad)] per micro-batch (scale: w / A for the non-interacting variant, alpha for interacting)."""
    out = []
    for seed in seeds:
        X, G, mask, A = layer(seed)
        mb = MicroBatch(mask=mask, advantages=A, stat_scale=torch.full((mask.shape[0],), float(n), dtype=torch.float64))
        gw, _ = ctx.layer_grads("L", X, G * k, mb, False)
        rec = ctx.records[-1]
        out.append((rec[3].clone(), rec[5].clone(), gw))
        ctx.clear()
    ctx.records.clear()
    ctx.lambdas.clear()
    if end:
        ctx.ema.end_step()
    return out


def context(knobs, reference="ema_mean"):
    return ISOPOBackward(isopo_settings(fisher_tokens=0, reg_reference=reference, **knobs))


@pytest.mark.parametrize("reference", ["ema_mean", "ema_median", "batch_median"])
@pytest.mark.parametrize("name", list(REGULARIZED))
def test_coefficients_are_invariant_to_the_loss_normalizer(name, reference):
    """V scaled by k = 1/n each step (the loss normalizer n changes: tokens, GA, loss_type) with the statistics
    multiplied by n: the coefficients equal those of the unscaled run to 1e-6, also after an EMA history built at a
    different normalizer."""
    knobs = REGULARIZED[name]
    if knobs.get("interacting") and reference != "ema_mean":
        pytest.skip("the interacting variant's lam is always an EMA of the mean eigenvalue")
    base = context(knobs, reference)
    run_step(base, 1.0, (0, 1))  # history at normalizer 1
    want = run_step(base, 1.0, (2, 3), end=False)
    for k in FACTORS:
        ctx = context(knobs, reference)
        run_step(ctx, 1.0 / 3.0, (0, 1), n=3.0)  # history at another normalizer (e.g. 3x the tokens)
        got = run_step(ctx, k, (2, 3), n=1.0 / k, end=False)
        for (s0, w0, g0), (s1, w1, g1) in zip(want, got):
            assert torch.isfinite(s1).all()
            assert rel_err(w1, w0) < 1e-6, (k, w0, w1)
            assert rel_err(g1, k * g0) < 1e-6  # the update carries V's scale, like an ordinary gradient


@pytest.mark.parametrize("reference", ["ema_mean", "ema_median", "batch_median"])
@pytest.mark.parametrize("name", list(REGULARIZED))
def test_coefficients_are_invariant_to_a_constant_factor_on_v(name, reference):
    """A factor k on V in every step (history included), with no normalizer: coefficients unchanged to 1e-6 (float64)
    and to 1e-4 in float32. The reference's absolute guards (+1e-8 next to c mu ~ f^2) failed this for small k."""
    knobs = REGULARIZED[name]
    if knobs.get("interacting") and reference != "ema_mean":
        pytest.skip("the interacting variant's lam is always an EMA of the mean eigenvalue")
    base = context(knobs, reference)
    run_step(base, 1.0, (0, 1))
    want = run_step(base, 1.0, (2, 3), end=False)
    for k in FACTORS:
        ctx = context(knobs, reference)
        run_step(ctx, k, (0, 1))
        got = run_step(ctx, k, (2, 3), end=False)
        for (_, w0, _), (_, w1, _) in zip(want, got):
            assert rel_err(w1, w0) < 1e-6, (k, w0, w1)


@pytest.mark.parametrize("name", list(PURE))
def test_pure_normalization_is_homogeneous(name):
    """c = 0: s(k V) = k^(p+q) s(V) and sum_i w_i V_i scales by k^(1+p+q): invariant for p + q = -1. The statistics
    are those of V as back-propagated (no normalizer), so the named settings' update is independent of the loss
    normalization, as in the reference."""
    knobs, degree = PURE[name]
    ctx = context(knobs)
    want = run_step(ctx, 1.0, (2, 3), n=7.0, end=False)
    for k in FACTORS:
        got = run_step(ctx, k, (2, 3), n=7.0 / k, end=False)
        for (s0, _, g0), (s1, _, g1) in zip(want, got):
            assert rel_err(s1, s0 * k**degree) < 1e-6, k
            assert rel_err(g1, g0 * k ** (1 + degree)) < 1e-6, k
    assert ctx.ema.ema == {} and not ctx.ema._pending  # c = 0 keeps no statistics


def test_guards_of_the_reference_would_distort_at_realistic_scale():
    """Documented numbers: at f^2 ~ 1e-10 (GA = 64, ~4k tokens per micro-batch) the reference's R(f) =
    sqrt(f^2 / (c mu + 1e-8) + 1) is ~1 for everyone; R without the guard is not."""
    f = torch.tensor([1e-6, 1e-5, 3e-5], dtype=torch.float64)  # f^2 = 1e-12 .. 1e-9
    mu = float((f**2).mean())
    reference = torch.sqrt(f**2 / (mu + 1e-8) + 1)
    assert (reference - 1).abs().max() < 0.05
    ours = regularized_magnitude(f, mu, 1.0)
    assert ours.max() / ours.min() > 1.5
    torch.testing.assert_close(regularized_magnitude(f * 1e5, mu * 1e10, 1.0), ours, rtol=1e-12, atol=0)


@pytest.mark.parametrize("knobs", [*REGULARIZED.values(), *(k for k, _ in PURE.values())])
@pytest.mark.parametrize("reference", ["ema_mean", "ema_median", "batch_median"])
def test_exact_zeros_stay_finite(knobs, reference):
    """An all-zero V_i and a layer whose every V_i is zero (PEFT's lora_A while lora_B = 0): finite coefficients,
    zero gradients where V is zero, no NaN, also with a stored history; all-zero steps are not folded."""
    ctx = context(knobs, reference)
    run_step(ctx, 1.0, (0,))  # some history
    X, G, mask, A = layer(4)
    X[1] = 0.0  # sequence 1 has no gradient in this layer
    mb = MicroBatch(mask=mask, advantages=A, stat_scale=torch.full((5,), 11.0, dtype=torch.float64))
    gw, _ = ctx.layer_grads("L", X, G, mb, False)
    scale, w = ctx.records[-1][3], ctx.records[-1][5]
    assert torch.isfinite(scale).all() and torch.isfinite(w).all() and torch.isfinite(gw).all()
    if knobs.get("reg", 1.0) == 0 and not knobs.get("interacting"):
        assert scale[1] == 0  # c = 0: an exact zero statistic gives coefficient 0 (its V_i is 0 anyway)
    ctx.clear()
    for fresh in (False, True):
        if fresh:
            ctx = context(knobs, reference)
        gw, _ = ctx.layer_grads("Z", X, torch.zeros_like(G), mb, False)  # every V_i = 0
        assert torch.isfinite(ctx.records[-1][3]).all() and torch.isfinite(ctx.records[-1][5]).all()
        assert torch.count_nonzero(gw) == 0
        ctx.clear()
        ctx.ema.end_step()
        assert not any(k.startswith("Z/") for k in ctx.ema.ema)


def test_fisher_sample_without_any_gradient_gives_zero_not_nan():
    """f_i = 0 with e_i > 0 (the sample J holds no token with a gradient): the Fisher denominator is 0; f = 0, and
    with c = 0 the coefficient is 0 (the reference returned 1e8 V_i), with c > 0 it is R(0) = 1."""
    X, G, mask, A = layer(5)
    G[:, 0] = 0.0
    sample = torch.arange(0, X.shape[0] * X.shape[1], X.shape[1])  # position 0 of every sequence: g = 0 there
    for reg, expect in ((0.0, 0.0), (1.0, None)):
        ctx = ISOPOBackward(isopo_settings(p=-1.0, reg=reg, fisher_tokens=0))
        ctx.sampler.override = {"L": sample}
        ctx.layer_grads("L", X, G, MicroBatch(mask=mask, advantages=A), False)
        scale = ctx.records[-1][3]
        assert (ctx.records[-1][1] == 0).all()  # f
        assert torch.isfinite(scale).all()
        if expect is not None:
            assert (scale == expect).all()
        else:  # first step, own mu: R(0) = 1 for everyone
            assert torch.equal(scale, torch.ones_like(scale))


def test_sequence_scales_zero_rules():
    e = torch.tensor([0.0, 2.0, 3.0], dtype=torch.float64)
    f = torch.tensor([0.0, 0.0, 1.5], dtype=torch.float64)
    rho = torch.where(e > 0, f / e, 0.0)
    s = isopo_sequence_scales(e, f, rho, {}, 0.0, -1.0, -2.0, 0.0)  # fig6: e / f^2
    assert torch.equal(s, torch.tensor([0.0, 0.0, 3.0 / 1.5**2], dtype=torch.float64))
    s = isopo_sequence_scales(e, f, rho, {"e": 4.0, "f": 1.0, "rho": 1.0}, -1.0, -1.0, 0.0, 1.0)
    assert torch.isfinite(s).all() and s[0] == 1.0  # R(0) = 1
    nan = torch.tensor([float("nan"), 1.0], dtype=torch.float64)
    assert torch.isnan(isopo_sequence_scales(None, nan, None, {}, -1.0, 0.0, 0.0, 0.0)[0])  # counted, dropped


def test_nonzero_median_and_reference_points():
    x2 = torch.tensor([0.0, 4.0, 1.0, 9.0, 0.0], dtype=torch.float64)
    assert nonzero_median(x2) == 4.0
    assert torch.isnan(nonzero_median(torch.zeros(3)))
    ctx = context(dict(p=-1.0, reg=1.0), "ema_median")
    assert ctx.reference_point("L", "f", x2) == 4.0  # no history: the micro-batch median
    ctx.reference_point("L", "f", torch.tensor([2.0, 8.0, 6.0], dtype=torch.float64))  # median 6
    ctx.reference_point("L", "f", torch.zeros(3, dtype=torch.float64))  # no median: left out of the step mean
    ctx.ema.end_step()
    assert ctx.ema.ema == {"L/f@median": pytest.approx(5.0)}  # mean of the medians 4 and 6
    assert ctx.reference_point("L", "f", x2) == pytest.approx(5.0)
    ctx.ema.discard_step()
    ctx = context(dict(p=-1.0, reg=1.0), "batch_median")
    assert ctx.reference_point("L", "f", x2) == 4.0
    assert not ctx.ema._pending  # no history kept
    ctx = context(dict(p=-1.0, reg=1.0), "ema_mean")
    assert torch.equal(ctx.reference_point("L", "f", x2), x2)  # the reference's first step: each sequence's own


def test_reference_point_robust_to_outliers():
    """The point of the medians: one large-f sequence drags the mean, so the others' R ~ 1 (REINFORCE); with the
    median, the bulk of the sequences is spread out."""
    f = torch.tensor([1.0, 1.2, 0.8, 1.1, 30.0], dtype=torch.float64)
    A = torch.ones(5, dtype=torch.float64)
    spread = {}
    for reference in ("ema_mean", "batch_median"):
        ctx = context(dict(p=-1.0, reg=1.0), reference)
        mu = ctx.reference_point("L", "f", f * f)
        mu = mu.mean() if reference == "ema_mean" else mu  # the step mean the EMA would hold
        s = isopo_sequence_scales(None, f, None, {"f": mu}, -1.0, 0.0, 0.0, 1.0)[:4] * A[:4]
        spread[reference] = float(s.std() / s.mean())
    assert spread["batch_median"] > 5 * spread["ema_mean"]


def test_settings_and_config_reject_unknown_reference(tmp_path):
    from trl_isopo import ISOPOConfig

    with pytest.raises(ValueError, match="reg_reference"):
        isopo_settings(reg_reference="mean")
    with pytest.raises(ValueError, match="isopo_reg_reference"):
        ISOPOConfig(output_dir=str(tmp_path), isopo_reg_reference="median", use_cpu=True, report_to="none")


@pytest.mark.parametrize("loss_type", ["bnpo", "grpo", "dr_grpo", "dapo"])
def test_loss_normalizer_matches_trl_loss(tiny_tokenizer, tmp_path, loss_type):
    """The trainer's per-sequence normalizer n_i is exactly the one TRL's loss applies: d loss / d log pi = -mask / n."""
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=1)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, loss_type=loss_type)
    trainer.current_gradient_accumulation_steps = 3
    inputs = make_batch(tiny_tokenizer)
    with trainer.isopo_active():
        trainer.compute_loss(trainer.model, inputs)
        n = trainer.isopo_backward.current.stat_scale
    # TRL's own loss: GRPO with advantages 1 and no importance ratio
    grpo_inputs = {**inputs, "advantages": torch.ones_like(inputs["advantages"]), "old_per_token_logps": None}
    seed = logps_grad(trainer, lambda x: GRPOTrainer._compute_loss(trainer, trainer.model, x), grpo_inputs)
    mask = inputs["completion_mask"].double()
    # (TRL's fused log-prob kernel returns float32 log-probs even for a float64 model)
    torch.testing.assert_close(seed.double(), -mask / n.unsqueeze(1), rtol=1e-6, atol=0)


@pytest.mark.parametrize("knobs", [dict(p=-1.0, reg=1.0), dict(p=0.0, q=-1.0, reg=1.0), dict(interacting=True)])
@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo"])
def test_trainer_coefficients_do_not_depend_on_accumulation(tiny_tokenizer, tmp_path, knobs, loss_type):
    """Through TRL's loss: GA = 1 vs GA = 4 (the loss divided by 4) with the same stored EMA: identical
    coefficients, so the covered gradients are exactly 1/4, like an ordinary gradient."""
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=5)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, loss_type=loss_type)
    ctx = trainer.isopo_backward
    ctx.settings = ISOPOSettings(**{**ctx.settings.__dict__, "fisher_tokens": 0, **knobs})
    mb = make_batch(tiny_tokenizer, seed=1)
    covered = trainer.isopo_coverage["covered"]
    history = {f"{n}/{k}": 3.0e4 * (i + 1) for i, n in enumerate(covered) for k in ("e", "f", "rho", "ntk")}
    out = []
    for ga in (1, 4):
        trainer.current_gradient_accumulation_steps = ga
        ctx.ema.ema = dict(history)
        trainer.model.zero_grad(set_to_none=True)
        with trainer.isopo_active():
            trainer.compute_loss(trainer.model, mb).backward()
        out.append({n: trainer.model.get_submodule(n).weight.grad.clone() for n in covered})
        ctx.ema.discard_step()
        ctx.records.clear()
        ctx.lambdas.clear()
    for n in covered:
        assert rel_err(out[1][n] * 4, out[0][n]) < 1e-10, n


def test_uniform_scales_warn_after_consecutive_steps_and_rarely(tiny_tokenizer, tmp_path, caplog):
    """isopo/scale_spread below the threshold for SPREAD_WARN_STEPS steps in a row warns once, then at most every
    SPREAD_WARN_EVERY steps; a spread step resets the count; REINFORCE settings (all exponents 0) never warn."""
    import logging

    from trl_isopo.isopo import trainer as T

    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=1)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path)

    def run(spreads, start=0):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="trl_isopo.isopo.trainer"):
            for i, spread in enumerate(spreads):
                trainer.state.global_step = start + i
                trainer._isopo_check_spread(spread)
        return [r.getMessage() for r in caplog.records if "REINFORCE" in r.getMessage()]

    low = T.SPREAD_WARN_THRESHOLD / 10
    assert run([low] * (T.SPREAD_WARN_STEPS - 1) + [0.5] + [low] * (T.SPREAD_WARN_STEPS - 1)) == []
    warned = run([low] * (T.SPREAD_WARN_EVERY + T.SPREAD_WARN_STEPS), start=1000)
    assert len(warned) == 2 and "isopo_reg_reference" in warned[0] and "isopo_reg" in warned[0]
    trainer.isopo_backward.settings = isopo_settings(p=0.0, q=0.0, r=0.0)
    trainer._isopo_uniform_steps, trainer._isopo_last_spread_warning = 0, None
    assert run([low] * 20) == []


def test_first_step_of_ema_mean_is_uniform_and_logged_as_such(tiny_tokenizer, tmp_path):
    """The reference's first step regularizes each sequence by its own x^2: every scale is 1/sqrt(1 + 1/c), so
    isopo/scale_spread is 0; batch_median spreads them from the first step on."""
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=1)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path)
    ctx = trainer.isopo_backward
    inputs = make_batch(tiny_tokenizer)
    spreads = {}
    for reference in ("ema_mean", "batch_median"):
        ctx.settings = isopo_settings(
            **{**ctx.settings.__dict__, "fisher_tokens": 0, "reg": 1.0, "reg_reference": reference}
        )
        trainer.model.zero_grad(set_to_none=True)
        with trainer.isopo_active():
            trainer.compute_loss(trainer.model, inputs).backward()
        total, count = ctx.step_metrics()["scale_spread"]
        spreads[reference] = total / count
        ctx.ema.discard_step()
    assert spreads["ema_mean"] < 1e-12 < 1e-2 < spreads["batch_median"]


@pytest.mark.parametrize(
    "knobs",
    [
        dict(p=-1.0, reg=0.0),
        dict(p=0.0, q=-1.0, r=-2.0, reg=0.0),
        dict(p=-1.0, q=-0.5, r=-1.0, reg=0.8, reg_reference="ema_median"),
        dict(p=-1.0, reg=1.0, reg_reference="batch_median"),
    ],
    ids=["p=-1,c=0", "fig6", "p+q+r,ema_median", "p=-1,batch_median"],
)
def test_peft_lora_zero_lora_b_stays_finite(tiny_tokenizer, tmp_path, knobs):
    """PEFT's lora_B = 0 makes every lora_A V_i exactly 0 on the first step: zero, finite lora_A gradients and
    finite lora_B gradients, no dropped coefficients, no zero statistic folded."""
    from peft import LoraConfig

    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=3)
    lc = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, peft_config=lc)
    ctx = trainer.isopo_backward
    ctx.settings = ISOPOSettings(**{**ctx.settings.__dict__, "fisher_tokens": 0, **knobs})
    trainer.model.zero_grad(set_to_none=True)
    with trainer.isopo_active():
        trainer.compute_loss(trainer.model, make_batch(tiny_tokenizer, seed=2)).backward()
    for n, p in trainer.model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), n
            if "lora_A" in n:
                assert torch.count_nonzero(p.grad) == 0, n
            else:
                assert torch.count_nonzero(p.grad) > 0, n
    assert ctx.step_metrics()["nonfinite_coefficients"][0] == 0
    ctx.ema.end_step()
    assert not any("lora_A" in k for k in ctx.ema.ema)
