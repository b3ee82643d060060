"""TPO with the GRPOConfig options it gives a meaning to (docs/tpo.md, "GRPOConfig fields"), against independent
oracles: normalization-only `loss_type`s (accepted, warned, no effect), `scale_rewards` / `multi_objective_aggregation`
(python float64 brute force of the stated formulas, pure functions and inside the training loop), and the entropy
bonus and `top_entropy_quantile` (the trainer's gradient equals plain float64 autograd of the stated loss)."""

import math
import statistics
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tpo_support import base_args, two_proc

from trl_isopo import TPOConfig, TPOTrainer
from trl_isopo.grpo_terms import entropy_bonus_term
from trl_isopo.tiny import build_tiny_causal_lm, tiny_prompt_dataset, tiny_reward
from trl_isopo.tpo.scores import batch_population_std, combine_rewards, scores_to_u


# ================================================================================================ configuration
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_normalization_only_loss_types_warn_and_are_accepted(tmp_path, loss_type):
    with pytest.warns(UserWarning, match=f"loss_type='{loss_type}'` is ignored by TPO"):
        args = base_args(tmp_path, loss_type=loss_type)
    assert args.loss_type == loss_type
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        base_args(tmp_path)  # the default (dapo) is silent
    assert not [w for w in caught if "TPOConfig" in str(w.message)]


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
def test_ratio_loss_types_are_refused(tmp_path, loss_type):
    with pytest.raises(ValueError, match="transforms GRPO's importance ratio"):
        base_args(tmp_path, loss_type=loss_type)


def test_normalization_only_loss_type_changes_nothing(tiny_model_dir, tmp_path, monkeypatch):
    """bnpo vs the default: the same parameter update, bit for bit (a 1-step run on deterministic completions)."""
    monkeypatch.setattr(TPOTrainer, "_tpo_reuse_loss_logps", False)  # the run script reads q before the loss
    runs = {}
    for loss_type in ("dapo", "bnpo"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            deltas, *_ = two_proc.run(tiny_model_dir, str(tmp_path / loss_type), per_device=8, ga=1,
                                      num_iterations=1, max_steps=1, loss_type=loss_type)
        runs[loss_type] = deltas
    assert any(d.abs().max() > 0 for d in runs["dapo"].values())
    assert all(torch.equal(runs["dapo"][n], runs["bnpo"][n]) for n in runs["dapo"])


@pytest.mark.parametrize(
    "fields",
    [dict(scale_rewards="none"), dict(scale_rewards="batch"), dict(scale_rewards=False),
     dict(multi_objective_aggregation="normalize_then_sum"), dict(entropy_coef=0.01),
     dict(use_adaptive_entropy=True), dict(top_entropy_quantile=0.2)],
)
def test_supported_fields_construct(tmp_path, fields):
    args = base_args(tmp_path, **fields)
    assert isinstance(args, TPOConfig)


# ================================================================================================ scores, pure
def _pstd(xs):
    return statistics.pstdev(xs) if xs else 0.0


def _paper_u(xs):
    """The paper's rule on one group (python floats): population z-score, centred if std <= 1e-6."""
    mean = math.fsum(xs) / len(xs)
    std = _pstd(xs)
    return [(x - mean) / std if std > 1e-6 else x - mean for x in xs]


def test_combine_rewards_matches_brute_force():
    K = 4
    r = torch.tensor(
        [[1.0, 0.5], [0.0, float("nan")], [2.0, 1.0], [1.0, 3.0],  # group 0: one None for function 1
         [5.0, 5.0], [5.0, 5.0], [5.0, 5.0], [float("nan"), float("nan")]],  # group 1: constant, one unscorable
        dtype=torch.float64,
    )
    w = torch.tensor([1.0, -0.5], dtype=torch.float64)
    s = combine_rewards(r, w, K)
    expected = [1.0 - 0.25, 0.0, 2.0 - 0.5, 1.0 - 1.5, 2.5, 2.5, 2.5, float("nan")]
    assert torch.allclose(s, torch.tensor(expected, dtype=torch.float64), equal_nan=True, atol=0, rtol=0)
    valid = torch.tensor([True, True, True, False, True, True, True, True])  # row 3: an empty completion
    s = combine_rewards(r, w, K, "normalize_then_sum", valid)
    rows = r.tolist()
    want = [0.0] * 8
    for g in range(2):
        for f in range(2):
            idx = [i for i in range(g * K, g * K + K) if valid[i] and not math.isnan(rows[i][f])]
            z = _paper_u([rows[i][f] for i in idx]) if idx else []
            for i, zi in zip(idx, z):
                want[i] += w[f].item() * zi
    want[7] = float("nan")  # unscorable stays NaN
    assert torch.allclose(s, torch.tensor(want, dtype=torch.float64), equal_nan=True, atol=1e-15)
    r[2, 1] = float("inf")  # an infinite reward makes its row unscorable in both modes
    for mode in ("sum_then_normalize", "normalize_then_sum"):
        s = combine_rewards(r, w, K, mode)
        assert torch.isnan(s[2]) and torch.isfinite(s[:2]).all()


def test_scores_to_u_matches_brute_force():
    s = torch.tensor([[1.0, 3.0, 2.0, 7.0], [4.0, 4.0, 4.0, 4.0], [0.0, 1e-9, 0.0, 0.0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, True, False], [True] * 4, [True] * 4])
    groups = [[x for x, v in zip(row, vrow) if v] for row, vrow in zip(s.tolist(), valid.tolist())]
    flat = [x for g in groups for x in g]
    b = _pstd(flat)
    assert batch_population_std(s, valid).item() == pytest.approx(b, rel=1e-14)
    for mode in ("group", "none", "batch"):
        u, std = scores_to_u(s, valid, mode, batch_population_std(s, valid))
        for gi, g in enumerate(groups):
            mean = math.fsum(g) / len(g)
            exp = {"group": _paper_u(g), "none": [x - mean for x in g], "batch": [(x - mean) / b for x in g]}[mode]
            got = [x for x, v in zip(u[gi].tolist(), valid[gi].tolist()) if v]
            assert got == pytest.approx(exp, rel=1e-12, abs=1e-15), (mode, gi)
            assert std[gi].item() == pytest.approx(_pstd(g), rel=1e-12, abs=1e-300)
        assert u[0, 3] == 0  # invalid member
    u, _ = scores_to_u(s, valid, "batch", torch.tensor(0.0, dtype=torch.float64))  # zero batch std: centred
    assert u[0, :3].tolist() == pytest.approx([x - 2.0 for x in (1.0, 3.0, 2.0)])


# ================================================================================================ scores, in the loop
def _oracle_q(l_old, u, eta=1.0):
    z = [lo + ui / eta for lo, ui in zip(l_old, u)]
    m = max(z)
    w = [math.exp(x - m) for x in z]
    return [x / math.fsum(w) for x in w]


def _seq(tok_logps, mask):
    return [math.fsum(x for x, k in zip(row, m) if k) for row, m in zip(tok_logps.tolist(), mask.tolist())]


def _n_words(completions, **kw):
    return [float(len(c.split())) for c in completions]


@pytest.mark.parametrize(
    "fields",
    [dict(scale_rewards="none"), dict(scale_rewards="batch"),
     dict(multi_objective_aggregation="normalize_then_sum"),
     dict(multi_objective_aggregation="normalize_then_sum", scale_rewards="none")],
    ids=["none", "batch", "normalize_then_sum", "normalize_then_sum+none"],
)
def test_targets_follow_the_stated_scaling(tiny_model_dir, tiny_tokenizer, tmp_path, fields, monkeypatch):
    """q inside the training loop (2 micro-batches of 1 group each, so "batch" spans micro-batches) vs the python
    oracle of docs/tpo.md's formulas from the decoded completions' rewards and the recorded p_old. q is built at
    generation time here (the run script reads it before the loss); the loss-forward path is checked below."""
    monkeypatch.setattr(TPOTrainer, "_tpo_reuse_loss_logps", False)
    K, seen = two_proc.K, []
    weights = [1.0, -0.25]

    def on_loss(trainer, model, inputs, loss):
        comp = [tiny_tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
                for ids, mask in zip(inputs["completion_ids"].tolist(), inputs["completion_mask"].tolist())]
        seen.append({"r": list(zip(tiny_reward(comp), _n_words(comp))), "q": inputs["tpo_targets"].tolist(),
                     "l_old": _seq(inputs["old_per_token_logps"], inputs["completion_mask"])})

    two_proc.run(tiny_model_dir, str(tmp_path / "r"), per_device=4, ga=2, num_iterations=1, max_steps=1,
                 on_loss=on_loss, reward=[tiny_reward, _n_words], reward_weights=weights, **fields)
    assert len(seen) == 2
    aggregation = fields.get("multi_objective_aggregation", "sum_then_normalize")
    scale = fields.get("scale_rewards", "group")

    def combined(rows):
        if aggregation == "sum_then_normalize":
            return [math.fsum(w * x for w, x in zip(weights, r)) for r in rows]
        per_func = [_paper_u([r[f] for r in rows]) for f in range(2)]
        return [math.fsum(weights[f] * per_func[f][i] for f in range(2)) for i in range(len(rows))]

    s_all = [combined(rec["r"]) for rec in seen]
    b = _pstd([x for s in s_all for x in s])
    informative = 0
    for rec, s in zip(seen, s_all):
        mean = math.fsum(s) / K
        u = {"group": _paper_u(s), "none": [x - mean for x in s], "batch": [(x - mean) / b for x in s]}[scale]
        informative += _pstd(s) > 1e-6
        assert rec["q"] == pytest.approx(_oracle_q(rec["l_old"], u), abs=2e-6)
    assert informative  # at least one group moves q away from p_old


# ================================================================================================ entropy terms
def _plain_loss(model, inputs, scores, K, temperature, coef, top_q, beta=0.0):
    """Float64 plain autograd of TPO's loss with the entropy bonus and the high-entropy token mask: log-probs and
    entropies from full logits, l_i with the low-entropy tokens detached, q from the detached l_i and the paper's u;
    plus beta x the bias-corrected k3 KL (per-sequence token mean over every completion token, mean over rows)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    C = inputs["completion_ids"].shape[1]
    logits = model(input_ids=ids, attention_mask=att).logits[:, -C - 1 : -1].double() / temperature
    logp_all = torch.log_softmax(logits, -1)
    tok = logp_all.gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    m = inputs["completion_mask"].bool()
    keep = m.clone()
    if top_q < 1.0:  # the tokens at or above the (1 - top_q) quantile of the completion tokens' entropies
        threshold = np.quantile(ent.detach()[m].numpy(), 1.0 - top_q)
        keep = m & (ent.detach() >= torch.tensor(threshold, dtype=ent.dtype))
    l = (torch.where(keep, tok, tok.detach()) * m).sum(-1)
    loss = 0.0
    for g in range(len(scores) // K):
        sl = slice(g * K, (g + 1) * K)
        u = torch.tensor(_paper_u(scores[sl]), dtype=torch.float64)
        q = torch.softmax(l.detach()[sl] + u, -1)
        loss = loss - (q * torch.log_softmax(l[sl], -1)).sum()
    loss = loss / (len(scores) // K)
    if coef:
        loss = loss - coef * (ent * keep).sum() / keep.sum()
    if beta:
        d = torch.where(m, inputs["ref_per_token_logps"] - tok, torch.zeros_like(tok))
        # GRPOConfig's default use_bias_correction_kl: k3 times pi_theta / pi_old, pi_old = this forward (value 1)
        k3 = (torch.exp(d) - d - 1) * torch.exp(torch.where(m, tok - tok.detach(), torch.zeros_like(tok)))
        loss = loss + beta * (k3.sum(-1) / m.sum(-1)).mean()
    return loss, keep


@pytest.fixture
def f64_trainer(tiny_tokenizer, tmp_path):
    def make(lora=False, **fields):
        from peft import LoraConfig

        model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=3)
        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                                 task_type="CAUSAL_LM", init_lora_weights=False) if lora else None
        trainer = TPOTrainer(model, tiny_reward, args=base_args(tmp_path, use_cpu=True, **fields),
                             train_dataset=tiny_prompt_dataset(8), processing_class=tiny_tokenizer,
                             peft_config=peft_config)
        if lora:
            for p in trainer.model.parameters():
                p.data = p.data.double()
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        return trainer

    return make


def _batch(tokenizer, scores):
    from isopo_oracle import make_batch

    b = make_batch(tokenizer, seed=5, B=8, P=5, C=5, prompt_lens=(4,) * 8, completion_lens=(5, 2, 4, 3, 1, 5, 3, 4))
    b = {k: v for k, v in b.items() if k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
    b["prompt_ids"][:4] = b["prompt_ids"][0]  # two groups of K = 4 rows sharing a prompt
    b["prompt_ids"][4:] = b["prompt_ids"][4]
    b["tpo_scores"] = torch.tensor(scores, dtype=torch.float64)
    return b


def test_batch_scale_on_the_loss_forward_path(f64_trainer, tiny_tokenizer):
    """q built in the loss from the carried per-row batch std (`tpo_score_scale`): u = (s - mean_g) / std_B."""
    scores = [1.0, 0.0, 2.0, 0.5, 0.0, 3.0, 1.0, 1.0]
    trainer = f64_trainer(scale_rewards="batch")
    inputs = _batch(tiny_tokenizer, scores)
    inputs["tpo_score_scale"] = torch.full((8,), 2.5, dtype=torch.float64)  # as if the other process' rows counted
    trainer.compute_loss(trainer.model, inputs)
    l_old = _seq(inputs["old_per_token_logps"], inputs["completion_mask"])
    for g in range(2):
        s = scores[4 * g : 4 * g + 4]
        u = [(x - math.fsum(s) / 4) / 2.5 for x in s]
        want = _oracle_q(l_old[4 * g : 4 * g + 4], u)  # float32 parts of TRL's fused kernel: 1e-6
        assert inputs["tpo_targets"][4 * g : 4 * g + 4].tolist() == pytest.approx(want, abs=1e-6)


def _grads(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    trainer.compute_loss(trainer.model, dict(inputs)).backward()
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


# TRL's fused log-prob kernel has float32 parts even for a float64 model (tests/isopo_oracle_checks.py), while the
# oracle uses full float64 logits: measured worst relative error 9.7e-7 over these tests (2026-12-02, CPU).
GRAD_TOL = 1e-5


@pytest.mark.parametrize(
    "coef,top_q,beta,lora",
    [(0.05, 1.0, 0.0, False), (0.0, 0.4, 0.0, False), (0.05, 0.4, 0.0, False), (0.05, 0.4, 0.2, True),
     (0.0, 1.0, 0.2, False), (0.0, 1.0, 0.0, True)],
    ids=["entropy_coef", "top_entropy_quantile", "both", "both+kl+lora", "kl", "lora"],
)
def test_entropy_terms_match_plain_autograd(f64_trainer, tiny_tokenizer, coef, top_q, beta, lora):
    scores = [1.0, 0.0, 2.0, 0.5, 0.0, 3.0, 1.0, 1.0]
    trainer = f64_trainer(lora=lora, entropy_coef=coef, top_entropy_quantile=top_q)
    trainer.beta = beta  # the loss reads it; a reference model is not needed with ref log-probs given below
    inputs = _batch(tiny_tokenizer, scores)
    if beta:
        g = torch.Generator().manual_seed(0)
        inputs["ref_per_token_logps"] = -1.0 - torch.rand(inputs["completion_ids"].shape, generator=g,
                                                          dtype=torch.float64)
    got = _grads(trainer, inputs)
    trainer.model.zero_grad(set_to_none=True)
    loss, keep = _plain_loss(trainer.model, inputs, scores, 4, trainer.temperature, coef, top_q, beta)
    loss.backward()
    want = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for n in want:
        err = ((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)).item()
        assert err < GRAD_TOL, (n, err)
    if top_q < 1.0:  # negative control: the mask must matter
        assert 0 < keep.sum() < inputs["completion_mask"].sum()
        full, _ = _plain_loss(trainer.model, inputs, scores, 4, trainer.temperature, coef, 1.0)
        trainer.model.zero_grad(set_to_none=True)
        full.backward()
        n = next(n for n in want if "q_proj" in n)
        assert (trainer.model.get_parameter(n).grad - want[n]).norm() > 1e-3 * want[n].norm()
    if lora:
        assert want and all("lora_" in n for n in want)


def test_router_aux_loss_matches_plain_autograd(tiny_tokenizer, tmp_path):
    """MoE: the trainer's gradient is that of TPO's loss + router_aux_loss_coef x the model's own aux loss."""
    from moe_support import build_tiny_moe

    scores = [1.0, 0.0, 2.0, 0.5, 0.0, 3.0, 1.0, 1.0]
    trainer = TPOTrainer(build_tiny_moe(tiny_tokenizer), tiny_reward,
                         args=base_args(tmp_path, use_cpu=True, router_aux_loss_coef=0.5),
                         train_dataset=tiny_prompt_dataset(8), processing_class=tiny_tokenizer)
    assert trainer.aux_loss_enabled
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = _batch(tiny_tokenizer, scores)
    got = _grads(trainer, inputs)
    trainer.model.zero_grad(set_to_none=True)
    policy, _ = _plain_loss(trainer.model, inputs, scores, 4, trainer.temperature, 0.0, 1.0)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    aux = trainer.model(input_ids=ids, attention_mask=att, output_router_logits=True).aux_loss
    (policy + 0.5 * aux).backward()
    want = {n: p.grad for n, p in trainer.model.named_parameters() if p.grad is not None}
    router = [n for n in want if "gate.weight" in n and "mlp.gate" in n]
    assert router and want[router[0]].norm() > 0
    for n in want:
        err = ((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)).item()
        assert err < GRAD_TOL, (n, err)
    trainer.model.zero_grad(set_to_none=True)
    policy, _ = _plain_loss(trainer.model, inputs, scores, 4, trainer.temperature, 0.0, 1.0)
    policy.backward()  # negative control: without the aux term the router gradient differs
    assert (trainer.model.get_parameter(router[0]).grad - want[router[0]]).norm() > 1e-3 * want[router[0]].norm()


def test_adaptive_entropy_controller():
    """TRL's controller: no bonus until a measured entropy is <= target; coef moves by delta per optimizer step."""
    args = SimpleNamespace(use_adaptive_entropy=True, entropy_target=0.5, entropy_coef_delta=0.1,
                           entropy_coef_min=0.0, entropy_coef_max=0.25)
    acc = SimpleNamespace(sync_gradients=False, reduce=lambda t, reduction: t)
    trainer = SimpleNamespace(args=args, accelerator=acc, current_gradient_accumulation_steps=2, entropy_coef=0.1,
                              _last_world_entropy=float("inf"), _entropy_window_stats=None,
                              _metrics={"train": {"entropy_coef": []}})
    ent = torch.tensor([[0.2, 0.4, 9.0], [0.6, 0.0, 9.0]], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert entropy_bonus_term(trainer, ent, mask, "train").item() == 0.0  # nothing measured yet: no bonus
    acc.sync_gradients = True
    entropy_bonus_term(trainer, ent, mask, "train")  # end of the step: window mean (2 micro-batches) 0.4 <= 0.5
    assert trainer._last_world_entropy == pytest.approx(0.4) and trainer.entropy_coef == pytest.approx(0.2)
    term = entropy_bonus_term(trainer, ent, mask, "train")  # applied now: -0.2 * 0.4 / 2; coef capped at 0.25
    assert term.item() == pytest.approx(-0.2 * 0.4 / 2) and trainer.entropy_coef == pytest.approx(0.25)
    (g,) = torch.autograd.grad(term, ent)
    assert torch.allclose(g, -0.2 / 2 * mask.double() / 3)
    trainer.entropy_coef = 0.25
    entropy_bonus_term(trainer, ent * 10, mask, "train")  # 4.0 > target: coef goes down, bonus gated off next
    assert trainer.entropy_coef == pytest.approx(0.15) and entropy_bonus_term(trainer, ent, mask, "eval").item() == 0
