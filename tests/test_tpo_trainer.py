"""TPOTrainer: exactness inside the real training loop (in-loop oracles for q and the loss), invariance to how an
optimizer step is split into micro-batches and processes, and real runs. Construction guards: tests/test_tpo_config.py."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from tpo_support import TWO_PROC_SCRIPT, base_args, two_proc

from trl_isopo import TPOTrainer
from trl_isopo.tiny import tiny_prompt_dataset, tiny_reward

HERE = Path(__file__).parent


def params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


# ================================================================================================ in-loop oracles
def _plain_seq_logps(model, inputs, length_normalize):
    """Independent oracle: a plain forward (no fused head, float64 log_softmax) -> (B,) sequence log-probs."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    C = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att).logits[:, -C - 1 : -1].double()
    tok = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"][..., None]).squeeze(-1)
    out = []
    for row, m in zip(tok.tolist(), inputs["completion_mask"].tolist()):
        vals = [x for x, keep in zip(row, m) if keep]
        out.append(math.fsum(vals) / (len(vals) if length_normalize else 1) if vals else 0.0)
    return out


def _oracle_q(l_old, scores, eta, anchor):
    mean = math.fsum(scores) / len(scores)
    std = math.sqrt(math.fsum((s - mean) ** 2 for s in scores) / len(scores))
    u = [(s - mean) / std if std > 1e-6 else s - mean for s in scores]
    z = [(lo if anchor else 0.0) + ui / eta for lo, ui in zip(l_old, u)]
    m = max(z)
    w = [math.exp(x - m) for x in z]
    return [x / math.fsum(w) for x in w]


def _seq_from_tokens(tok_logps, mask, length_normalize):
    out = []
    for row, m in zip(tok_logps.tolist(), mask.tolist()):
        vals = [x for x, keep in zip(row, m) if keep]
        out.append(math.fsum(vals) / (len(vals) if length_normalize else 1) if vals else 0.0)
    return out


def _recorder(tokenizer, length_normalize, seen, K, score=tiny_reward):
    def on_loss(trainer, model, inputs, loss):
        comp = [
            tokenizer.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=True)
            for ids, mask in zip(inputs["completion_ids"].tolist(), inputs["completion_mask"].tolist())
        ]
        l_now = _plain_seq_logps(trainer.accelerator.unwrap_model(model), inputs, length_normalize)
        q = inputs["tpo_targets"].view(-1, K).tolist()
        ce = []
        for qg, lg in zip(q, [l_now[i : i + K] for i in range(0, len(l_now), K)]):
            m = max(lg)
            lse = m + math.log(math.fsum(math.exp(x - m) for x in lg))
            ce.append(-math.fsum(qi * (li - lse) for qi, li in zip(qg, lg)))
        seen.append(
            {
                "step": trainer.state.global_step,
                "rewards": score(comp),
                "l_now": l_now,
                "l_old": _seq_from_tokens(inputs["old_per_token_logps"], inputs["completion_mask"], length_normalize),
                "targets": inputs["tpo_targets"].clone(),
                "advantages": inputs["advantages"].clone(),
                "loss": loss.item() * trainer.current_gradient_accumulation_steps,
                "oracle_loss": math.fsum(ce) / len(ce),
                "key": inputs["completion_ids"].clone(),
            }
        )

    return on_loss


def _check_targets(s, K, eta, anchor):
    """q vs the float64 oracle from the recorded p_old and the recomputed raw rewards; u is not TRL's advantage."""
    for g in range(len(s["l_old"]) // K):
        sl = slice(g * K, (g + 1) * K)
        expected = _oracle_q(s["l_old"][sl], s["rewards"][sl], eta, anchor)
        assert torch.allclose(s["targets"][sl].double(), torch.tensor(expected, dtype=torch.float64), atol=2e-6)
        # u recovered from q (u / eta = log q - log p_old + const) is the population z-score, not TRL's
        # Bessel-corrected advantages (which differ by a factor sqrt((K-1)/K) here)
        x = torch.log(s["targets"][sl].double()) - torch.tensor(s["l_old"][sl], dtype=torch.float64) * anchor
        u_rec = eta * (x - x.mean())
        scores = s["rewards"][sl]
        mean = sum(scores) / K
        std = math.sqrt(sum((r - mean) ** 2 for r in scores) / K)
        u_oracle = torch.tensor([(r - mean) / std for r in scores], dtype=torch.float64)
        assert torch.allclose(u_rec, u_oracle, atol=2e-3)
        assert (s["advantages"][sl].double() - u_oracle).abs().max() > 2e-2


@pytest.mark.parametrize("length_normalize,anchor,eta", [(False, True, 1.0), (True, False, 0.5)])
def test_targets_and_loss_match_oracle_over_epochs(
    tiny_model_dir, tiny_tokenizer, tmp_path, length_normalize, anchor, eta
):
    """q from raw rewards (population std) and training-model p_old; frozen over num_iterations; loss recomputed."""
    K, seen = two_proc.K, []
    two_proc.run(
        tiny_model_dir, str(tmp_path / "r"), per_device=4, ga=2, num_iterations=2, max_steps=2,
        on_loss=_recorder(tiny_tokenizer, length_normalize, seen, K),
        tpo_length_normalize=length_normalize, tpo_anchor=anchor, tpo_eta=eta,
    )
    assert [s["step"] for s in seen] == [0, 0, 1, 1]
    for first, again in ((seen[0], seen[2]), (seen[1], seen[3])):
        assert torch.equal(first["key"], again["key"])  # the same buffered micro-batch is reused
        assert first["targets"].numpy().tobytes() == again["targets"].numpy().tobytes()  # byte-identical q
        # ... while log p (and the loss) is recomputed at the new theta; the oracle check below pins its value
        assert max(abs(a - b) for a, b in zip(first["l_now"], again["l_now"])) > 1e-3
        assert first["loss"] != again["loss"]
    for s in seen:
        assert math.isclose(s["loss"], s["oracle_loss"], rel_tol=1e-5, abs_tol=1e-6)
        _check_targets(s, K, eta, anchor)
    for s in seen[:2]:  # first epoch: theta = theta_old, so p_old is the training model's own log-probs
        assert max(abs(a - b) for a, b in zip(s["l_now"], s["l_old"])) < 1e-4


def test_off_policy_micro_batches_use_rollout_time_targets(tiny_model_dir, tiny_tokenizer, tmp_path):
    """steps_per_generation > GA: TRL computes the old log-probs itself; micro-batch 2 is off-policy, q from p_old."""
    K, seen = two_proc.K, []
    two_proc.run(
        tiny_model_dir, str(tmp_path / "r"), per_device=4, ga=1, num_iterations=1, max_steps=2,
        on_loss=_recorder(tiny_tokenizer, False, seen, K), steps_per_generation=2,
    )
    assert [s["step"] for s in seen] == [0, 1]
    assert max(abs(a - b) for a, b in zip(seen[0]["l_now"], seen[0]["l_old"])) < 1e-4
    assert max(abs(a - b) for a, b in zip(seen[1]["l_now"], seen[1]["l_old"])) > 1e-3  # theta moved
    for s in seen:
        assert math.isclose(s["loss"], s["oracle_loss"], rel_tol=1e-5, abs_tol=1e-6)
        _check_targets(s, K, 1.0, True)


def test_targets_use_weighted_sum_of_reward_functions(tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch):
    """s = sum_f w_f r_f; a function returning None for a row counts 0 there (as in TRL), the row stays valid."""
    # The group check of the run script reads q before the loss; force q at generation time (the loss-forward reuse
    # path is shown equal to this one in test_tpo_logps_reuse.py).
    monkeypatch.setattr(TPOTrainer, "_tpo_reuse_loss_logps", False)

    def n_words(completions, **kw):
        return [float(len(c.split())) if len(c.split()) % 3 else None for c in completions]

    nones = []

    def oracle_score(completions):
        nones.extend(b is None for b in n_words(completions))
        return [a + -0.25 * (b or 0.0) for a, b in zip(tiny_reward(completions), n_words(completions))]

    K, seen = two_proc.K, []
    two_proc.run(
        tiny_model_dir, str(tmp_path / "r"), per_device=8, ga=1, num_iterations=1, max_steps=1,
        on_loss=_recorder(tiny_tokenizer, False, seen, K, score=oracle_score),
        reward=[tiny_reward, n_words], reward_weights=[1.0, -0.25],
    )
    assert len(seen) == 1 and any(nones) and not all(nones)
    assert bool(seen[0]["targets"].gt(0).all())  # rows with one None reward are still scored
    _check_targets(seen[0], K, 1.0, True)


# ================================================================================================ split invariance
def _max_rel_diff(a, b):
    scale = max(d.abs().max().item() for d in a.values())
    return max((a[n] - b[n]).abs().max().item() for n in a) / scale


def test_microbatch_invariance_and_negative_control(tiny_model_dir, tmp_path, monkeypatch):
    one, logs_one, checks_one, _ = two_proc.run(tiny_model_dir, str(tmp_path / "a"), per_device=8, ga=1)
    two, logs_two, checks_two, _ = two_proc.run(tiny_model_dir, str(tmp_path / "b"), per_device=4, ga=2)
    assert all(c["whole_groups"] for c in checks_one + checks_two)
    assert [c["rows"] for c in checks_two] == [4, 4, 4, 4]
    assert max(d.abs().max().item() for d in one.values()) > 1e-3  # the update is not trivially zero
    assert _max_rel_diff(one, two) < 1e-5
    for a, b in zip(logs_one[:2], logs_two[:2]):
        for key in ("loss", "policy_loss", "tpo/kl_q_p", "tpo/max_abs_p_minus_q", "grad_norm"):
            assert math.isclose(a[key], b[key], rel_tol=1e-5), key

    # Negative control: TRL's row shuffle splits groups across micro-batches and changes the update.
    from trl.trainer.utils import shuffle_sequence_dict

    from trl_isopo.tpo import trainer as tpo_trainer

    monkeypatch.setattr(tpo_trainer, "shuffle_groups", lambda batch, k: shuffle_sequence_dict(batch))
    rows, _, checks_rows, _ = two_proc.run(tiny_model_dir, str(tmp_path / "c"), per_device=4, ga=2)
    assert not all(c["whole_groups"] for c in checks_rows)
    assert _max_rel_diff(one, rows) > 1e-2


@pytest.mark.multiprocess
def test_two_process_invariance(tiny_model_dir, tmp_path):
    from _launch import launch_two_processes

    out = tmp_path / "two" / "out.pt"
    out.parent.mkdir()
    launch_two_processes(str(TWO_PROC_SCRIPT), tiny_model_dir, str(out), "4", "1")
    res = torch.load(out)
    assert res["world_size"] == 2 and res["rank_param_diff"] == 0.0
    assert sorted({c["rank"] for c in res["checks"]}) == [0, 1]
    assert all(c["whole_groups"] and c["rows"] == 4 for c in res["checks"])
    one, logs_one, _, _ = two_proc.run(tiny_model_dir, str(tmp_path / "a"), per_device=8, ga=1)
    assert _max_rel_diff(one, res["deltas"]) < 1e-5
    for a, b in zip(logs_one[:2], res["logs"][:2]):
        for key in ("loss", "policy_loss", "tpo/kl_q_p", "tpo/max_abs_p_minus_q", "tpo/target_entropy"):
            if key in a:
                assert math.isclose(a[key], b[key], rel_tol=1e-5), key


# ================================================================================================ real runs
METRICS = (
    "policy_loss",
    "entropy",
    "tpo/target_entropy",
    "tpo/kl_q_p",
    "tpo/frac_zero_variance_groups",
    "tpo/frac_invalid_completions",
    "tpo/max_abs_p_minus_q",
)


def test_train_full_finetune_changes_parameters_and_logs(tiny_model_dir, tiny_tokenizer, tmp_path):
    args = base_args(
        tmp_path, gradient_accumulation_steps=2, num_iterations=2, max_steps=3, gradient_checkpointing=True
    )
    trainer = TPOTrainer(
        tiny_model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(16), processing_class=tiny_tokenizer
    )
    before = params(trainer)
    trainer.train()
    after = params(trainer)
    assert max((after[n] - before[n]).abs().max().item() for n in before) > 1e-4
    assert all(torch.isfinite(p).all() for p in after.values())
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert len(logs) == 3
    first = logs[0]
    for key in METRICS:
        assert key in first and math.isfinite(first[key]), key
    assert 0 <= first["tpo/max_abs_p_minus_q"] <= 1 and first["tpo/kl_q_p"] >= 0
    assert math.isclose(first["loss"], first["policy_loss"], rel_tol=1e-5)  # beta = 0


def test_train_lora_with_kl(tiny_model_dir, tiny_tokenizer, tmp_path):
    from peft import LoraConfig

    args = base_args(tmp_path, beta=0.04, max_steps=2, num_iterations=2, learning_rate=5e-2)
    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
    )
    trainer = TPOTrainer(
        tiny_model_dir,
        tiny_reward,
        args=args,
        train_dataset=tiny_prompt_dataset(16),
        processing_class=tiny_tokenizer,
        peft_config=lora,
    )
    before = params(trainer)
    trainer.train()
    after = params(trainer)
    lora_moved = max((after[n] - before[n]).abs().max().item() for n in before if "lora_" in n)
    base_moved = max((after[n] - before[n]).abs().max().item() for n in before if "lora_" not in n)
    assert lora_moved > 1e-4 and base_moved == 0.0
    logs = [r for r in trainer.state.log_history if "loss" in r]
    for key in METRICS:  # generation-time metrics are logged on the generation step
        assert key in logs[0] and math.isfinite(logs[0][key]), key
    for key in ("policy_loss", "entropy", "tpo/kl_q_p", "tpo/max_abs_p_minus_q", "kl"):
        assert key in logs[-1] and math.isfinite(logs[-1][key]), key
    assert logs[-1]["kl"] > 0  # the adapter moved away from the (adapter-disabled) reference


def test_zero_variance_rewards_do_not_move_parameters(tiny_model_dir, tiny_tokenizer, tmp_path):
    """Constant rewards -> u = 0 -> q = p_old -> first-epoch gradient ~ 0 (p_old from the training model)."""
    args = base_args(tmp_path, optim="sgd", learning_rate=1.0, max_grad_norm=0.0, max_steps=2)
    trainer = TPOTrainer(
        tiny_model_dir, lambda completions, **kw: [0.5] * len(completions), args=args,
        train_dataset=tiny_prompt_dataset(16), processing_class=tiny_tokenizer,
    )
    before = params(trainer)
    trainer.train()
    after = params(trainer)
    assert max((after[n] - before[n]).abs().max().item() for n in before) < 1e-6
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert all(r["grad_norm"] < 1e-5 and r["tpo/frac_zero_variance_groups"] == 1.0 for r in logs)
    assert all(r["tpo/kl_q_p"] < 1e-6 for r in logs)


def test_bad_data_never_gives_nan(tiny_model_dir, tiny_tokenizer, tmp_path):
    """None rewards (single rows and whole groups), truncated completions masked out: finite everything."""
    calls = {"n": 0}

    def flaky_reward(prompts, completions, **kw):
        calls["n"] += 1
        out = tiny_reward(completions)
        for i, p in enumerate(prompts):
            if "b" in p.split()[1:-1] or i % 3 == 0:  # whole groups of some prompts, plus scattered rows
                out[i] = None
        return out

    args = base_args(
        tmp_path, mask_truncated_completions=True, max_completion_length=3, max_steps=3, num_iterations=2, beta=0.04
    )  # beta > 0 with a path model: TRL rebuilds a full reference model
    trainer = TPOTrainer(
        tiny_model_dir, flaky_reward, args=args, train_dataset=tiny_prompt_dataset(16), processing_class=tiny_tokenizer
    )
    trainer.train()
    assert calls["n"] >= 2
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    logs = [r for r in trainer.state.log_history if "loss" in r]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and math.isfinite(r["kl"]) for r in logs)
    assert logs[0]["tpo/frac_invalid_completions"] > 0.3


def test_all_invalid_batch_gives_zero_loss(tiny_model_dir, tiny_tokenizer, tmp_path):
    args = base_args(tmp_path, optim="sgd", max_grad_norm=0.0, max_steps=1)
    trainer = TPOTrainer(
        tiny_model_dir, lambda completions, **kw: [None] * len(completions), args=args,
        train_dataset=tiny_prompt_dataset(8), processing_class=tiny_tokenizer,
    )
    before = params(trainer)
    trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in params(trainer).items())
    log = trainer.state.log_history[0]
    assert log["loss"] == 0.0 and log["tpo/frac_invalid_completions"] == 1.0 and log["grad_norm"] == 0.0


def test_evaluate(tiny_model_dir, tiny_tokenizer, tmp_path):
    args = base_args(tmp_path, per_device_eval_batch_size=4, num_generations_eval=2)
    trainer = TPOTrainer(
        tiny_model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(8),
        eval_dataset=tiny_prompt_dataset(4, seed=1), processing_class=tiny_tokenizer,
    )
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    for key in ("eval_tpo/kl_q_p", "eval_tpo/target_entropy", "eval_policy_loss"):
        assert key in metrics and math.isfinite(metrics[key]), key
    assert math.isclose(metrics["eval_loss"], metrics["eval_policy_loss"], rel_tol=1e-5)


def test_evaluate_with_one_completion_per_prompt(tiny_model_dir, tiny_tokenizer, tmp_path):
    """num_generations_eval=1 (TRL's fast evaluation): a group of one has p = q = 1, so the eval loss is exactly 0;
    rewards are still scored. Training groups stay K >= 2."""
    args = base_args(tmp_path, per_device_eval_batch_size=3, num_generations_eval=1)
    trainer = TPOTrainer(
        tiny_model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(8),
        eval_dataset=tiny_prompt_dataset(3, seed=1), processing_class=tiny_tokenizer,
    )
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == 0.0 and metrics["eval_tpo/kl_q_p"] == 0.0
    assert math.isfinite(metrics["eval_reward"]) and metrics["eval_tpo/frac_zero_variance_groups"] == 1.0
    with pytest.raises(ValueError, match="num_generations >= 2"):
        base_args(tmp_path, num_generations=1, per_device_train_batch_size=1)


def test_quickstart_example_runs(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("tpo_quickstart", HERE.parent / "examples" / "tpo_quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trainer = module.main(["--max_steps", "2", "--output_dir", str(tmp_path)])
    assert trainer.state.global_step == 2
    assert "KL(q||p)" in capsys.readouterr().out
