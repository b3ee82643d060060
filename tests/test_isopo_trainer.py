"""ISOPOTrainer end to end: train() smoke runs, construction errors, checkpoint/resume, two processes."""

import json
import os

import pytest
import torch
from _launch import launch_two_processes
from isopo_trainer_support import config, resume_and_compare, run
from peft import LoraConfig

from trl_isopo import ISOPOConfig, ISOPOTrainer
from trl_isopo.tiny import tiny_prompt_dataset, tiny_reward, tiny_training_args

HERE = os.path.dirname(__file__)


def test_default_is_pure_normalization(tmp_path):
    """c = 0 by default (docs/isopo-regularizer.md: c = 1 with the mean reference is REINFORCE on the toy task)."""
    args = ISOPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert (args.isopo_p, args.isopo_q, args.isopo_r, args.isopo_reg, args.beta) == (-1.0, 0.0, 0.0, 0.0, 0.0)
    assert args.isopo_reg_reference == "ema_mean"


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(isopo_p=0.0, isopo_q=-1.0),
        dict(isopo_p=0.0, isopo_q=-1.0, isopo_r=-2.0, isopo_reg=0.0),
        dict(isopo_interacting=True),
    ],
    ids=["p=-1", "q=-1", "fig6", "interacting"],
)
def test_train_changes_parameters_and_logs_metrics(tiny_model_dir, tiny_tokenizer, tmp_path, variant):
    trainer, before, changed = run(tiny_model_dir, tiny_tokenizer, config(tmp_path, **variant))
    assert changed == set(before)  # every trainable parameter moved
    logs = [h for h in trainer.state.log_history if "isopo/scale_mean" in h]
    assert len(logs) == 3
    for key in ("policy_loss", "entropy", "isopo/scale_std", "reward"):
        assert all(key in h for h in logs), key
    p_only = not variant.get("isopo_interacting") and variant.get("isopo_q", 0.0) == 0 and variant.get("isopo_r", 0.0) == 0
    assert all(("isopo/euclidean_norm" in h) != p_only for h in logs)  # e is not computed for p alone
    if variant.get("isopo_interacting"):
        assert all("isopo/ntk_lambda" in h for h in logs)
    elif variant.get("isopo_p", -1.0) != 0 or variant.get("isopo_r", 0.0) != 0:
        assert all("isopo/fisher_norm" in h for h in logs)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    if variant.get("isopo_reg", 1.0) > 0:
        assert trainer.isopo_backward.ema.ema  # statistics were folded into the EMA (c = 0 keeps none)
    assert all("isopo/scale_spread" in h for h in logs)


@pytest.mark.parametrize("interacting", [False, True])
def test_train_lora_and_gradient_checkpointing(tiny_model_dir, tiny_tokenizer, tmp_path, interacting):
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = config(tmp_path, gradient_checkpointing=True, learning_rate=5e-2, isopo_interacting=interacting)
    trainer, before, changed = run(tiny_model_dir, tiny_tokenizer, args, peft_config=lora)
    assert before and all(".lora_" in n for n in before)
    # lora_B starts at 0 (so lora_A's gradient is 0 at step 0); after 3 steps both have moved.
    assert any("lora_B" in n for n in changed) and any("lora_A" in n for n in changed)
    assert trainer.isopo_coverage["isopo_layers"] == 8 and trainer.isopo_coverage["other_params"] == 0
    assert "isopo/scale_mean" in trainer.state.log_history[0]


def test_ema_folds_once_per_optimizer_step(tiny_model_dir, tiny_tokenizer, tmp_path):
    args = config(tmp_path, gradient_accumulation_steps=3, per_device_train_batch_size=4, max_steps=2)
    trainer = ISOPOTrainer(
        tiny_model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(32), processing_class=tiny_tokenizer
    )
    ema = trainer.isopo_backward.ema
    calls, original = [], ema.end_step
    ema.end_step = lambda *a, **k: (calls.append(trainer._isopo_micro_step), original(*a, **k))[1]
    trainer.train()
    assert calls == [3, 6]  # after the 3rd and 6th micro-batch: at the optimizer-step boundaries only


def test_bad_data_nan_rewards_and_empty_completions(tiny_model_dir, tiny_tokenizer, tmp_path):
    """Rewards of None (unscorable) become NaN advantages -> 0 in TRL; parameters stay finite."""
    calls = {"n": 0}

    def flaky_reward(completions, **kw):
        calls["n"] += 1
        return [None if i % 3 == 0 else float(len(c.split()) == 0) for i, c in enumerate(completions)]

    args = config(tmp_path, max_completion_length=2)
    trainer = ISOPOTrainer(
        tiny_model_dir, flaky_reward, args=args, train_dataset=tiny_prompt_dataset(32), processing_class=tiny_tokenizer
    )
    trainer.train()
    assert calls["n"] > 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_nonfinite_coefficients_are_dropped_counted_and_warned(tiny_model_dir, tiny_tokenizer, tmp_path, caplog):
    """An overflowing coefficient (forced here: +inf for sequence 0 of one layer) drops that sequence from that
    layer only: parameters stay finite and move, the step warns with the count."""
    import logging

    args = config(tmp_path, max_steps=2)
    trainer = ISOPOTrainer(
        tiny_model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(32), processing_class=tiny_tokenizer
    )
    target = trainer.isopo_coverage["covered"][0]
    trainer.isopo_backward.weight_override = lambda name, A: torch.where(
        (torch.arange(A.numel()) == 0) & (name == target), torch.inf, A
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    with caplog.at_level(logging.WARNING, logger="trl_isopo.isopo.trainer"):
        trainer.train()
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert all(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)
    # per step: 2 micro-batches (gradient_accumulation_steps=2), one dropped coefficient each
    warned = [r.getMessage() for r in caplog.records if "non-finite per-sequence coefficients" in r.getMessage()]
    assert len(warned) == 2 and all(": 2 non-finite" in m for m in warned), warned
    logged = [h["isopo/nonfinite_coefficients"] for h in trainer.state.log_history if "isopo/nonfinite_coefficients" in h]
    assert logged == [2.0, 2.0], trainer.state.log_history


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(beta=-0.1), "beta"),
        (dict(beta=0.04, gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": True}), "use_reentrant"),
        (dict(isopo_reg_reference="mean"), "isopo_reg_reference"),
        (dict(loss_type="cispo"), "loss_type"),
        (dict(isopo_reg=-1.0), "isopo_reg"),
        (dict(isopo_reg_ema_decay=1.0), "isopo_reg_ema_decay"),
        (dict(isopo_other_params="bogus"), "isopo_other_params"),
        (dict(isopo_interacting=True, isopo_q=-1.0), "interacting"),
        (dict(isopo_interacting=True, isopo_interacting_reg=0.0), "isopo_interacting_reg"),
        (dict(importance_sampling_level="sequence"), "importance_sampling_level"),
        (dict(delta=2.0), "delta"),
        (dict(epsilon=1e9), "epsilon=1000000000.0 has no effect"),
        (dict(epsilon_high=0.28), "epsilon_high=0.28 has no effect"),
        (dict(torch_compile=True), "torch_compile"),
        (dict(use_vllm=True, vllm_importance_sampling_correction=True), "vllm_importance_sampling_correction"),
        (dict(fp16=True, bf16=False), "fp16"),
    ],
)
def test_config_errors_name_the_fix(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **bad)


def test_model_without_trainable_linear_is_rejected(tiny_model_dir, tiny_tokenizer, tmp_path):
    from trl_isopo.tiny import build_tiny_causal_lm

    model = build_tiny_causal_lm(tiny_tokenizer)
    for name, p in model.named_parameters():
        p.requires_grad_("embed" in name)
    with pytest.raises(ValueError, match="no trainable nn.Linear"):
        ISOPOTrainer(model, tiny_reward, args=config(tmp_path), train_dataset=tiny_prompt_dataset(8), processing_class=tiny_tokenizer)


def test_model_card_tags_and_citation(tiny_model_dir, tiny_tokenizer, tmp_path):
    trainer = ISOPOTrainer(
        tiny_model_dir, tiny_reward, args=config(tmp_path), train_dataset=tiny_prompt_dataset(8), processing_class=tiny_tokenizer
    )
    trainer.create_model_card(model_name="tiny-isopo")
    card = open(os.path.join(trainer.args.output_dir, "README.md")).read()
    for text in ("isopo", "trl-isopo", "2512.23353", "ISOPO: Proximal policy gradients without pi-old"):
        assert text in card, text


@pytest.mark.parametrize("reference", ["ema_mean", "ema_median", "batch_median"])
def test_resume_from_checkpoint_is_bit_exact(tiny_model_dir, tiny_tokenizer, tmp_path, reference):
    """4 steps straight == 2 steps, save (incl. EMA statistics), resume for 2 more; for every reference point."""
    common = dict(
        max_steps=4, isopo_reg=1.0, save_strategy="steps", save_steps=2, learning_rate=3e-2, isopo_reg_reference=reference
    )
    straight, _, _ = run(tiny_model_dir, tiny_tokenizer, config(tmp_path / "a", **common))
    ckpt = tmp_path / "a" / "out" / "checkpoint-2"
    state = json.load(open(ckpt / "isopo_state.json"))
    assert state["ema"]["decay"] == 0.9
    assert bool(state["ema"]["ema"]) == (reference != "batch_median")  # batch_median keeps no history
    assert all(k.endswith("@median") == (reference == "ema_median") for k in state["ema"]["ema"])
    resumed = resume_and_compare(tiny_model_dir, tiny_tokenizer, config(tmp_path / "b", **common), ckpt, straight)
    assert resumed.isopo_backward.ema.ema == straight.isopo_backward.ema.ema


def test_state_is_in_the_checkpoint_before_push_and_rotation(tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch):
    """The EMA file is written inside the checkpoint save, before the Hub push and the rotation of old checkpoints:
    the pushed folder holds it, the rotated-to checkpoint holds it, and resuming from that one is bit-exact."""
    seen_at_push = []

    def fake_push(self, output_dir):
        seen_at_push.append(os.path.exists(os.path.join(output_dir, "isopo_state.json")))

    class FakeHub:  # transformers' Hub client, replaced (no network): the repo is created at init
        def create_repo(self, repo_id, **kwargs):
            return type("RepoUrl", (), {"repo_id": repo_id})()

        def upload_folder(self, *args, **kwargs):
            return None

    import transformers.trainer

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: FakeHub())
    monkeypatch.setattr(ISOPOTrainer, "_push_from_checkpoint", fake_push)
    common = dict(max_steps=4, save_strategy="steps", save_steps=1, save_total_limit=1, learning_rate=3e-2)
    straight, _, _ = run(tiny_model_dir, tiny_tokenizer, config(tmp_path / "a", **common))
    pushed = ISOPOTrainer(
        tiny_model_dir, tiny_reward, args=config(tmp_path / "p", max_steps=2, save_strategy="steps", save_steps=1,
                                                 push_to_hub=True, hub_model_id="local/none", hub_strategy="every_save"),
        train_dataset=tiny_prompt_dataset(32), processing_class=tiny_tokenizer,
    )
    pushed.train()
    assert seen_at_push == [True, True]
    kept = sorted(p.name for p in (tmp_path / "a" / "out").glob("checkpoint-*"))
    assert kept == ["checkpoint-4"]  # rotation ran; resume from a rotated-to checkpoint (step 2 of a 2-limit run)
    common2 = dict(common, save_total_limit=2)
    run(tiny_model_dir, tiny_tokenizer, config(tmp_path / "c", **common2))
    ckpt = tmp_path / "c" / "out" / "checkpoint-3"
    assert (ckpt / "isopo_state.json").exists()
    resume_and_compare(tiny_model_dir, tiny_tokenizer, config(tmp_path / "d", **common2), ckpt, straight)


def test_reward_funcs_is_optional_like_grpo_trainer():
    import inspect

    from trl import GRPOTrainer

    from trl_isopo import TPOTrainer

    theirs = inspect.signature(GRPOTrainer.__init__).parameters
    for cls in (ISOPOTrainer, TPOTrainer):
        ours = inspect.signature(cls.__init__).parameters
        # Same names, order, kinds and defaults: code written for GRPOTrainer (positional or keyword) works as is.
        assert [(n, p.kind, p.default) for n, p in ours.items()] == [
            (n, p.kind, p.default) for n, p in theirs.items()
        ]
        assert ours["reward_funcs"].default is None


def test_constructed_without_reward_funcs_like_grpo_trainer(tiny_model_dir, tiny_tokenizer, tmp_path):
    """GRPOTrainer 1.16 takes `reward_funcs=None` and then needs the rewards from an environment: without one it raises
    its own ValueError. Ours get there with the same arguments, positional or keyword, and raise the same error (not
    a TypeError about a missing argument, nor a different check of ours first)."""
    from trl import GRPOConfig, GRPOTrainer

    from trl_isopo import TPOConfig, TPOTrainer

    common = tiny_training_args(tmp_path, per_device_train_batch_size=4, num_generations=4, max_completion_length=4)
    data = tiny_prompt_dataset(8)
    messages = []
    for cls, cfg in ((GRPOTrainer, GRPOConfig), (ISOPOTrainer, ISOPOConfig), (TPOTrainer, TPOConfig)):
        with pytest.raises(ValueError) as positional:
            cls(tiny_model_dir, None, cfg(**common), data, None, tiny_tokenizer)
        with pytest.raises(ValueError) as keyword:
            cls(tiny_model_dir, args=cfg(**common), train_dataset=data, processing_class=tiny_tokenizer)
        assert str(positional.value) == str(keyword.value)
        messages.append(str(positional.value))
    assert messages[0].startswith("No reward source provided") and len(set(messages)) == 1, messages


@pytest.mark.multiprocess
def test_two_processes_keep_identical_parameters(tmp_path):
    out = tmp_path / "result"
    proc = launch_two_processes(os.path.join(HERE, "scripts", "isopo_two_proc.py"), str(out))
    results = [json.load(open(f"{out}.rank{r}.json")) for r in (0, 1)]
    assert results[0]["world_size"] == results[1]["world_size"] == 2, proc.stdout[-2000:]
    assert results[0]["param_hash"] == results[1]["param_hash"]
    assert results[0]["changed"] and results[0]["ema"] == results[1]["ema"]
    assert results[0]["completions_differ_across_ranks"]
