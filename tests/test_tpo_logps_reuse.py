"""TPOTrainer takes p_old from the loss forward when the policy cannot have moved since generation.

With `num_iterations == 1` and whole generation batches inside one optimizer step (TRL then skips
`old_per_token_logps`), the parameters at every loss forward are the rollout-time ones, so q is built from the loss
forward's own detached log-probs instead of a separate no-grad forward. These tests pin that this changes nothing
(loss, every gradient, every logged metric; float64 model, whose log-probs TRL's fused head still computes in float32)
and that the extra forward is gone exactly when it may be.
"""

import math

import pytest
import torch
from tpo_support import two_proc
from transformers import TrainerCallback

from trl_isopo import TPOConfig, TPOTrainer
from trl_isopo.tiny import load_tiny_tokenizer, tiny_prompt_dataset, tiny_reward, tiny_training_args

K = two_proc.K


class _GradRecorder(TrainerCallback):
    """Every parameter's gradient right before each optimizer step."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def _run(model_dir, out_dir, reuse, per_device=8, ga=1, max_steps=2, evaluate=False, reward=tiny_reward, **overrides):
    """Train (or evaluate) on deterministic completions; return a record of everything that must not change."""
    tokenizer = load_tiny_tokenizer(model_dir)
    record = {"losses": [], "targets": [], "forwards": {"grad": 0, "no_grad": 0}}

    class RecordingTPOTrainer(TPOTrainer):
        _tpo_reuse_loss_logps = reuse

        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            record["losses"].append(loss.detach().clone())
            record["targets"].append((inputs["tpo_targets"].clone(), inputs["tpo_valid_mask"].clone()))
            return loss

    kwargs = tiny_training_args(
        out_dir,
        max_completion_length=8,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=ga,
        num_generations=K,
        num_iterations=1,
        max_steps=max_steps,
        logging_steps=1,
        optim="sgd",
        learning_rate=0.05,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": torch.float64},
        seed=0,
    )
    kwargs.update(overrides)
    grads = _GradRecorder()
    trainer = RecordingTPOTrainer(
        model_dir,
        reward,
        args=TPOConfig(**kwargs),
        train_dataset=tiny_prompt_dataset(8),
        eval_dataset=tiny_prompt_dataset(4, seed=1) if evaluate else None,
        processing_class=tokenizer,
        rollout_func=two_proc.make_rollout(tokenizer),
        callbacks=[grads],
    )
    assert trainer.model.dtype == torch.float64
    assert trainer.model.config.attention_dropout == 0.0  # exactness needs a deterministic forward

    def count(module, args):  # with a rollout_func every model forward is a log-prob forward
        record["forwards"]["grad" if torch.is_grad_enabled() else "no_grad"] += 1

    trainer.model.register_forward_pre_hook(count)
    if evaluate:
        record["metrics"] = trainer.evaluate()
    else:
        trainer.train()
        record["logs"] = [r for r in trainer.state.log_history if "loss" in r]
    record["grads"] = grads.grads
    record["trainer"] = trainer
    return record


def _assert_same(a, b, rel=1e-9):
    assert len(a["losses"]) == len(b["losses"]) > 0
    for x, y in zip(a["losses"], b["losses"]):
        assert torch.allclose(x, y, rtol=rel, atol=1e-12), (x, y)
    for (qa, va), (qb, vb) in zip(a["targets"], b["targets"]):
        assert torch.equal(va, vb)
        assert qa.dtype == qb.dtype
        assert torch.allclose(qa, qb, rtol=rel, atol=1e-12)
    assert len(a["grads"]) == len(b["grads"])
    for ga, gb in zip(a["grads"], b["grads"]):
        assert ga.keys() == gb.keys() and len(ga) > 0
        for name in ga:
            scale = max(ga[name].abs().max().item(), 1e-30)
            assert (ga[name] - gb[name]).abs().max().item() <= rel * scale + 1e-15, name
    for key in ("logs", "metrics"):
        if key not in a:
            continue
        rows_a, rows_b = (a[key], b[key]) if key == "logs" else ([a[key]], [b[key]])
        assert len(rows_a) == len(rows_b) > 0
        for ra, rb in zip(rows_a, rows_b):
            assert ra.keys() == rb.keys()
            assert sum(k.split("tpo/")[0] in ("", "eval_") for k in ra if "tpo/" in k) >= 5, sorted(ra)
            for k in ra:  # every logged value (tpo/*, loss, policy_loss, entropy, kl, grad_norm, ...) but timings
                if any(t in k for t in ("runtime", "per_second", "_time")):
                    continue
                assert math.isclose(ra[k], rb[k], rel_tol=rel, abs_tol=1e-12), (k, ra[k], rb[k])


SETTINGS = {
    "one_micro_batch": dict(per_device=8, ga=1),
    "two_micro_batches": dict(per_device=4, ga=2),  # steps_per_generation = gradient_accumulation_steps = 2
    "two_generations_per_step": dict(per_device=4, ga=2, steps_per_generation=1),
    "length_normalized_no_anchor": dict(per_device=4, ga=2, tpo_length_normalize=True, tpo_anchor=False, tpo_eta=0.5),
    "gradient_checkpointing": dict(per_device=4, ga=2, gradient_checkpointing=True),
    "kl_with_bias_correction": dict(per_device=8, ga=1, beta=0.04, use_bias_correction_kl=True),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_reuse_path_matches_recompute_path_exactly(tiny_model_dir, tmp_path, setting):
    kw = SETTINGS[setting]
    forced = _run(tiny_model_dir, tmp_path / "forced", reuse=False, **kw)
    reused = _run(tiny_model_dir, tmp_path / "reused", reuse=True, **kw)
    steps, micro = 2, 2 * kw["ga"]
    assert len(reused["losses"]) == micro and len(reused["grads"]) == steps
    # the update is not trivially zero, so equal gradients mean something
    assert max(g.abs().max().item() for g in reused["grads"][0].values()) > 1e-4
    _assert_same(forced, reused)
    # the recompute path runs a no-grad p_old forward per generation batch, the reuse path none (the KL reference
    # is a separate model here, not hooked)
    assert reused["forwards"]["no_grad"] == 0 and forced["forwards"]["no_grad"] > 0
    assert reused["forwards"]["grad"] == forced["forwards"]["grad"] == micro


def test_reuse_path_matches_with_invalid_rows(tiny_model_dir, tmp_path):
    """Unscorable rows and whole unscorable groups: the same valid mask, q, loss, gradients and metrics."""

    def flaky(prompts, completions, **kw):
        out = tiny_reward(completions)
        return [None if ("b" in p.split()[1:-1] or i % 3 == 0) else r for i, (p, r) in enumerate(zip(prompts, out))]

    forced = _run(tiny_model_dir, tmp_path / "forced", reuse=False, per_device=4, ga=2, reward=flaky)
    reused = _run(tiny_model_dir, tmp_path / "reused", reuse=True, per_device=4, ga=2, reward=flaky)
    assert any(not bool(v.all()) for _, v in reused["targets"])
    assert reused["logs"][0]["tpo/frac_invalid_completions"] > 0
    _assert_same(forced, reused)


def test_reuse_path_in_evaluation(tiny_model_dir, tmp_path):
    kw = dict(per_device_eval_batch_size=8, num_generations_eval=4, evaluate=True)
    forced = _run(tiny_model_dir, tmp_path / "forced", reuse=False, **kw)
    reused = _run(tiny_model_dir, tmp_path / "reused", reuse=True, **kw)
    assert "eval_tpo/target_entropy" in reused["metrics"]
    _assert_same(forced, reused)
    assert reused["forwards"]["no_grad"] == len(reused["losses"])  # only the (no-grad) evaluation loss forwards
    assert forced["forwards"]["no_grad"] == 2 * len(forced["losses"])


@pytest.mark.parametrize(
    "setting,reuse_expected",
    [
        (dict(per_device=8, ga=1), True),
        (dict(per_device=4, ga=2), True),  # steps_per_generation == gradient_accumulation_steps
        (dict(per_device=4, ga=2, steps_per_generation=1), True),  # two whole generations inside one step
        (dict(per_device=8, ga=1, num_iterations=2), False),  # TRL computes p_old (misaligned); TPO takes TRL's
        (dict(per_device=4, ga=2, steps_per_generation=1, num_iterations=2), False),  # TRL skips; TPO recomputes
        (dict(per_device=4, ga=1, steps_per_generation=2), False),  # the second micro-batch is off-policy
    ],
)
def test_extra_forward_skipped_exactly_when_exact(tiny_model_dir, tmp_path, setting, reuse_expected):
    rec = _run(tiny_model_dir, tmp_path / "r", reuse=True, **setting)
    trainer = rec["trainer"]
    n_micro = trainer.state.global_step * setting["ga"]
    assert rec["forwards"]["grad"] == n_micro == len(rec["losses"])
    if reuse_expected:
        assert rec["forwards"]["no_grad"] == 0  # no p_old forward at all
    else:
        # p_old forwards (by TRL or by TPO) in chunks of per_device rows: one per micro-batch of each generation
        spg = setting.get("steps_per_generation") or setting["ga"]
        generations = n_micro // (spg * setting.get("num_iterations", 1))
        assert generations >= 1 and rec["forwards"]["no_grad"] == generations * spg
    logs = rec["logs"]
    assert all(k in logs[0] for k in ("tpo/target_entropy", "tpo/frac_zero_variance_groups", "tpo/kl_q_p"))


def test_dropout_reuse_uses_the_loss_forwards_own_mask(tiny_model_dir, tmp_path):
    """With dropout, p_old is this forward's (as GRPO's ratio is exactly 1): constant rewards give zero gradient.

    The recompute path draws p_old under a different dropout mask (the model stays in train mode), so its q differs
    from p_theta and the first-epoch gradient is noise; the reuse path has q == p_theta exactly.
    """
    from transformers import AutoModelForCausalLM

    tokenizer = load_tiny_tokenizer(tiny_model_dir)
    grads = {}
    for reuse in (True, False):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64, attention_dropout=0.3)
        rec = _GradRecorder()

        class T(TPOTrainer):
            _tpo_reuse_loss_logps = reuse

        args = TPOConfig(
            **tiny_training_args(
                tmp_path / str(reuse), max_completion_length=8, per_device_train_batch_size=8, num_generations=K,
                max_steps=1, optim="sgd", max_grad_norm=0.0, seed=0,
            )
        )
        trainer = T(
            model, lambda completions, **kw: [0.5] * len(completions), args=args,
            train_dataset=tiny_prompt_dataset(8), processing_class=tokenizer,
            rollout_func=two_proc.make_rollout(tokenizer), callbacks=[rec],
        )
        trainer.train()
        grads[reuse] = max(g.abs().max().item() for g in rec.grads[0].values())
    print(grads)
    assert grads[True] < 1e-5  # float32 rounding of q (the log-prob kernel runs in float32)
    assert grads[False] > 100 * grads[True]


def test_compute_loss_needs_a_prepared_batch(tiny_model_dir, tmp_path):
    rec = _run(tiny_model_dir, tmp_path / "r", reuse=True, max_steps=1)
    trainer = rec["trainer"]
    ids = torch.ones(4, 3, dtype=torch.long)
    batch = {"prompt_ids": ids, "prompt_mask": ids, "completion_ids": ids, "completion_mask": ids}
    with pytest.raises(RuntimeError, match="tpo_scores"):
        trainer._compute_loss(trainer.model, batch)
