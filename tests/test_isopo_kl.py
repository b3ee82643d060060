"""beta > 0: TRL's k3 KL-to-reference term enters ISOPO as an ordinary gradient, not re-weighted.

Oracle (float64): grad_ISOPO(beta) = grad_ISOPO(beta = 0) + plain autograd of beta * TRL's k3 term, for every
trainable parameter, on every ISOPO variant and other-parameter mode.
"""

import json
import os
import sys

import pytest
import torch
from isopo_oracle import make_batch, make_trainer, rel_err
from kl_support import BETA, isopo_grads, kl_oracle, with_reference
from peft import LoraConfig

from trl_isopo.isopo.isopo_backward import ISOPOSettings
from trl_isopo.tiny import build_tiny_causal_lm

TOL = 1e-10
HEAD_TOL = 1e-6  # TRL's fused head accumulates the LM-head weight gradient in float32 even for float64 inputs

VARIANTS = [
    pytest.param(dict(p=-1.0, reg=1.0), "advantage_weighted", id="p=-1,c=1"),
    pytest.param(dict(p=-1.0, reg=0.0), "advantage_weighted", id="p=-1,c=0"),
    pytest.param(dict(p=0.0, q=-1.0, r=-2.0, reg=0.0), "advantage_weighted", id="fig6"),
    pytest.param(dict(interacting=True), "advantage_weighted", id="interacting"),
    pytest.param(dict(p=-1.0, reg=1.0), "surrogate", id="p=-1,surrogate"),
    pytest.param(dict(p=-1.0, reg=1.0), "frozen", id="p=-1,frozen"),
]


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("knobs, other", VARIANTS)
def test_kl_gradient_is_added_unweighted(tiny_tokenizer, tmp_path, knobs, other, bias_correction):
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=1)
    trainer = make_trainer(
        model, tiny_tokenizer, tmp_path, isopo_other_params=other, use_bias_correction_kl=bias_correction
    )
    ctx = trainer.isopo_backward
    ctx.settings = ISOPOSettings(**{**ctx.settings.__dict__, "fisher_tokens": 0, **knobs})
    inputs = with_reference(trainer, make_batch(tiny_tokenizer))
    want_kl, kl_value = kl_oracle(trainer, inputs, BETA, bias_correction)
    trainer.beta = 0.0
    base = isopo_grads(trainer, inputs)
    ctx.ema.discard_step()
    ctx.records.clear()
    n_records = len(ctx.records)
    trainer.beta = BETA
    got = isopo_grads(trainer, inputs)
    ctx.ema.discard_step()
    covered = trainer.isopo_coverage["covered"]
    assert len(ctx.records) == n_records + len(covered)  # the KL pass adds no statistics, one record per layer
    assert set(got) == set(base) == set(want_kl)
    for n in got:
        want = base[n] + want_kl[n]
        tol = HEAD_TOL if n.startswith("lm_head") else TOL
        assert rel_err(got[n], want) < tol, n
        assert rel_err(want_kl[n], torch.zeros_like(want_kl[n])) > 0  # the KL term really contributes
    assert trainer._metrics["train"]["kl"][-1] == pytest.approx(kl_value, rel=1e-6)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_kl_with_lora_and_checkpointing(tiny_tokenizer, tmp_path, checkpointing):
    """PEFT LoRA (lora_B = 0 at step 0) and non-reentrant gradient checkpointing: the same identity."""
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=3)
    lc = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = make_trainer(
        model, tiny_tokenizer, tmp_path, peft_config=lc, gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    if checkpointing:
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ctx = trainer.isopo_backward
    ctx.settings = ISOPOSettings(**{**ctx.settings.__dict__, "fisher_tokens": 0, "p": -1.0, "reg": 0.0})
    inputs = with_reference(trainer, make_batch(tiny_tokenizer, seed=2), seed=1)
    # lora_B = 0 makes lora_A's KL gradient 0 as well: move lora_B so that every adapter matrix has one
    with torch.no_grad():
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    want_kl, _ = kl_oracle(trainer, inputs, BETA, True)
    trainer.beta = 0.0
    base = isopo_grads(trainer, inputs)
    trainer.beta = BETA
    got = isopo_grads(trainer, inputs)
    assert got and set(got) == set(want_kl)
    for n in got:
        assert rel_err(got[n], base[n] + want_kl[n]) < TOL, n


def test_train_with_beta_logs_kl(tiny_model_dir, tiny_tokenizer, tmp_path):
    """End to end with TRL's reference model (rebuilt from the path): trains, logs GRPO's "kl" metric."""
    from trl_isopo import ISOPOConfig, ISOPOTrainer
    from trl_isopo.tiny import tiny_prompt_dataset, tiny_reward, tiny_training_args

    args = ISOPOConfig(
        **tiny_training_args(
            tmp_path / "out", per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
            max_completion_length=6, max_steps=2, logging_steps=1, learning_rate=1e-2, isopo_fisher_tokens=16,
            beta=0.1, seed=0,
        )
    )
    trainer = ISOPOTrainer(
        tiny_model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(32), processing_class=tiny_tokenizer
    )
    assert trainer.ref_model is not None
    trainer.train()
    logs = [h for h in trainer.state.log_history if "isopo/scale_mean" in h]
    assert len(logs) == 2 and all("kl" in h and h["kl"] >= 0 for h in logs)
    assert logs[-1]["kl"] > 0  # the policy moved away from the reference
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.multiprocess
def test_two_processes_with_beta_keep_identical_parameters(tmp_path):
    """DDP (2 gloo CPU ranks, different data per rank): the KL gradient joins the policy gradient before DDP's
    all-reduce (one-shot parameter hooks), so both ranks step identically."""
    from _launch import launch_two_processes

    out = tmp_path / "result"
    proc = launch_two_processes(os.path.abspath(__file__), str(out))
    results = [json.load(open(f"{out}.rank{r}.json")) for r in (0, 1)]
    assert results[0]["world_size"] == results[1]["world_size"] == 2, proc.stdout[-2000:]
    assert results[0]["param_hash"] == results[1]["param_hash"]
    assert results[0]["changed"] and results[0]["kl"] and results[0]["kl"] == results[1]["kl"]
    assert "outside the backward pass" not in proc.stdout + proc.stderr


def _two_process_main(out: str):  # run by `accelerate launch` on this file
    from ddp_support import tiny_world, train_fingerprint

    from trl_isopo import ISOPOConfig, ISOPOTrainer
    from trl_isopo.tiny import load_tiny_tokenizer, tiny_prompt_dataset, tiny_reward

    state, model_dir = tiny_world(out)
    args = ISOPOConfig(
        output_dir=out + ".run", report_to="none", use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=6, max_steps=2, logging_steps=1, learning_rate=1e-2, isopo_fisher_tokens=16, seed=0,
        beta=0.2,
    )
    trainer = ISOPOTrainer(model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(64),
                           processing_class=load_tiny_tokenizer(model_dir))
    run = train_fingerprint(trainer)
    with open(f"{out}.rank{state.process_index}.json", "w") as f:
        json.dump({
            "world_size": state.num_processes,
            **run,
            "kl": [h["kl"] for h in trainer.state.log_history if "kl" in h],
        }, f)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _two_process_main(sys.argv[1])
    from _launch import end_world

    end_world()
