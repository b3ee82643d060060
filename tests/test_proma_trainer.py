"""PROMATrainer inside TRL's real loss path vs a float64 oracle (per-sequence autograd, dense projections).

One optimizer step of 3 micro-batches of 4 sequences on the tiny float64 model (tests/scripts/proma_steps.py): every
covered layer's gradient (full weights, LoRA factors, and the q/k/v biases) equals the oracle's PROMA chain to 1e-9.
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
from proma_steps import F64, make_trainer, micro_batches, oracle_step_grads, per_sequence_data, run_step  # noqa: E402
from proma_oracle import assert_matches  # noqa: E402

from trl_isopo.grpo_terms import k3_per_token  # noqa: E402
from trl_isopo.proma import PROMAConfig, PROMATrainer  # noqa: E402
from math_settings import proma_settings  # noqa: E402

# The advantage-weighted norm weights and the LM head (TRL's fused kernel folds d loss / d logits in float32) are
# not PROMA's: they agree with the oracle at float32 rounding.
OTHER_TOL = 1e-6
SETTINGS = {
    "accumulation": dict(proma_mode="accumulation"),
    "intra": dict(proma_mode="intra", proma_intra_dim=3),
    "both,accumulated": dict(proma_mode="both", proma_intra_dim=3, proma_intra_target="accumulated"),
    "both,after": dict(proma_mode="both", proma_intra_dim=3, proma_intra_target="accumulated_after",
                       proma_intra_power_iters=2),
    "gs,bound,skip": dict(proma_mode="accumulation", proma_solver="gram_schmidt", proma_gs_sweeps=3,
                          proma_relative_bound=0.5, proma_skip_fraction=0.3, proma_shrinkage=0.7),
}
WINDOW = (11, 12, 13)


def covered_keys(trainer):
    names = trainer.proma_coverage["covered"]
    return [k for n in names for k in (f"{n}.weight", f"{n}.bias")]


def check_step(trainer, got, want):
    assert got.keys() == want.keys(), sorted(got.keys() ^ want.keys())[:5]
    covered = [k for k in covered_keys(trainer) if k in want]
    assert len(covered) >= len(trainer.proma_coverage["covered"])
    for k in covered:
        assert_matches(got[k], want[k]), k
    for k in want.keys() - set(covered):
        assert ((got[k] - want[k]).norm() / want[k].norm()).item() < OTHER_TOL, k


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("setting", SETTINGS)
def test_one_step_matches_oracle(tiny_tokenizer, tmp_path, setting, lora):
    """GA = 3: the update of every covered layer is the oracle's chain S_3; the plain sum is not (negative control:
    the same comparison with sum_m G_m fails)."""
    trainer = make_trainer(tiny_tokenizer, tmp_path, ga=3, lora=lora, **SETTINGS[setting])
    window = micro_batches(tiny_tokenizer, WINDOW)
    got = run_step(trainer, window)
    check_step(trainer, got, oracle_step_grads(trainer, window))
    plain = oracle_step_grads(trainer, window, plain=True)
    weights = [k for k in covered_keys(trainer) if k.endswith(".weight")]
    with pytest.raises(AssertionError):
        for k in weights:
            assert_matches(got[k], plain[k])


def test_running_gradient_restarts_every_optimizer_step(tiny_tokenizer, tmp_path):
    """Two optimizer steps on different micro-batches: the second step's gradient is the oracle chain of its own
    micro-batches from S = 0, not a continuation of the first step's S."""
    trainer = make_trainer(tiny_tokenizer, tmp_path, ga=3, proma_mode="accumulation")
    first, second = micro_batches(tiny_tokenizer, WINDOW), micro_batches(tiny_tokenizer, (21, 22, 23))
    run_step(trainer, first)
    assert trainer._proma_index == 0
    got = run_step(trainer, second)
    check_step(trainer, got, oracle_step_grads(trainer, second))


def test_kl_term_is_an_ordinary_gradient_outside_the_chain(tiny_tokenizer, tmp_path):
    """beta > 0: the step's gradient is PROMA's (beta = 0) plus the plain autograd gradient of the k3 KL terms."""
    from isopo_steps import with_reference

    beta = 0.3
    with_kl = make_trainer(tiny_tokenizer, tmp_path / "kl", ga=3, proma_mode="accumulation", beta=beta)
    window = [with_reference(with_kl, mb, s) for mb, s in zip(micro_batches(tiny_tokenizer, WINDOW), WINDOW)]
    got = run_step(with_kl, window)
    base = run_step(make_trainer(tiny_tokenizer, tmp_path / "base", ga=3, proma_mode="accumulation"), window)
    params = {n: p for n, p in with_kl.model.named_parameters() if p.requires_grad}
    kl = {n: torch.zeros_like(p) for n, p in params.items()}
    from isopo_oracle import surrogate_logps

    for mb in window:
        logps = surrogate_logps(with_kl, mb)
        mask = mb["completion_mask"].to(F64)
        per_token = k3_per_token(logps, mb["ref_per_token_logps"], None, with_kl.args.use_bias_correction_kl)
        loss = beta * (per_token * mask).sum() / (mask.sum() * len(window))
        for n, g in zip(params, torch.autograd.grad(loss, list(params.values()), allow_unused=True)):
            if g is not None:
                kl[n] += g
    for k in covered_keys(with_kl):
        if k in got:
            assert_matches(got[k] - base[k], kl[k]), k
    assert any(float(kl[k].norm()) > 1e-3 * float(base[k].norm()) for k in covered_keys(with_kl) if k in base)


def test_metrics_are_logged_as_means_over_projected_calls(tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_tokenizer, tmp_path, ga=3, proma_mode="both", proma_intra_dim=3)
    run_step(trainer, micro_batches(tiny_tokenizer, WINDOW))
    trainer.log({})
    logged = trainer.state.log_history[-1]
    names = ("running_norm", "projected_fraction", "bound_factor", "reduction_pct", "intra_rank", "intra_fraction",
             "intra_reduction_pct")
    assert all(f"proma/{n}" in logged for n in names), logged
    assert 0 < logged["proma/projected_fraction"] <= 1 and logged["proma/bound_factor"] == 1.0
    assert 0 < logged["proma/reduction_pct"] < 100 and logged["proma/intra_rank"] == 3
    assert 0 < logged["proma/intra_fraction"] <= 1
    trainer.log({})  # nothing projected since: no layer metric
    assert "proma/running_norm" not in trainer.state.log_history[-1]


def test_old_log_probs_only_for_the_per_step_kl(tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_tokenizer, tmp_path, ga=3, proma_mode="accumulation")
    assert not trainer._needs_old_logps()  # beta = 0, one pass per sample: TRL's forward is skipped
    trainer.num_iterations = 2
    assert trainer._needs_old_logps()
    mb = micro_batches(tiny_tokenizer, (5,))[0]
    data_logps = torch.zeros(4, mb["completion_ids"].shape[1], dtype=F64)
    mask = mb["completion_mask"].to(F64)
    pairs = trainer._surrogate_metrics({**mb, "old_per_token_logps": data_logps + 0.5}, data_logps, mask)
    assert [float(p) for p in pairs] == [0.5 * float(mask.sum()), float(mask.sum())]


def test_sketch_seed_and_gate_are_per_micro_batch(tiny_tokenizer, tmp_path):
    """The micro-batch bound into the window carries its index, the skip gate's decision and the sketch key."""
    trainer = make_trainer(tiny_tokenizer, tmp_path, ga=4, proma_mode="accumulation", proma_skip_fraction=0.5)
    seen = []
    original = trainer.proma_backward.micro_batch

    def spy(mb):
        seen.append((mb.index, mb.active, mb.sketch_key))
        return original(mb)

    trainer.proma_backward.micro_batch = spy
    run_step(trainer, micro_batches(tiny_tokenizer, (1, 2, 3, 4)))
    assert [s[:2] for s in seen] == [(0, False), (1, False), (2, True), (3, True)]
    assert [s[2] for s in seen] == [(trainer.args.seed, 0, 0, j) for j in range(4)]


def test_clear_errors_at_construction(tiny_tokenizer, tmp_path):
    from trl_isopo.isopo.config import ISOPOConfig
    from trl_isopo.tiny import build_tiny_causal_lm, tiny_prompt_dataset, tiny_reward, tiny_training_args

    kw = tiny_training_args(tmp_path, per_device_train_batch_size=4, num_generations=4, use_cpu=True,
                            gradient_accumulation_steps=2)  # fmt: skip
    model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
    with pytest.raises(TypeError, match="needs a PROMAConfig"):
        PROMATrainer(model, tiny_reward, args=ISOPOConfig(**kw), train_dataset=tiny_prompt_dataset(8),
                     processing_class=tiny_tokenizer)  # fmt: skip
    with pytest.raises(NotImplementedError, match="proma_lm_head=True"):
        PROMATrainer(model, tiny_reward, args=PROMAConfig(**kw, proma_lm_head=True),
                     train_dataset=tiny_prompt_dataset(8), processing_class=tiny_tokenizer)  # fmt: skip


def test_sharding_rule():
    """DeepSpeed and FSDP1 refused; FSDP2 accepted (tests/test_proma_fsdp2.py) unless an extra gradient pass runs."""
    from types import SimpleNamespace

    def setup(ds=False, fsdp=False, fsdp2=False, beta=0.0, aux=False, mode="accumulation"):
        trainer = SimpleNamespace(is_deepspeed_enabled=ds, is_fsdp_enabled=fsdp, aux_loss_enabled=aux,
                                  accelerator=SimpleNamespace(is_fsdp2=fsdp2),
                                  args=SimpleNamespace(beta=beta, proma_settings=lambda: proma_settings(mode=mode)))
        return PROMATrainer._unsupported_setup(trainer)

    assert setup() is None and setup(beta=0.04) is None  # one process / DDP
    assert setup(fsdp=True, fsdp2=True) is None and setup(fsdp=True, fsdp2=True, mode="intra") is None
    assert "DeepSpeed" in setup(ds=True) and "ZeRO" not in setup(ds=True)
    assert "FSDP1" in setup(fsdp=True) and "ISOPO" not in setup(fsdp=True)
    assert "beta > 0" in setup(fsdp=True, fsdp2=True, beta=0.04)
    assert "router aux loss" in setup(fsdp=True, fsdp2=True, aux=True)


def test_compute_loss_outside_the_window_is_refused(tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_tokenizer, tmp_path, ga=2, proma_mode="accumulation")
    mb = micro_batches(tiny_tokenizer, (3,))[0]
    with pytest.raises(RuntimeError, match="training_step"):
        trainer._compute_loss(trainer.model, mb)
    data = per_sequence_data(trainer, mb)  # outside the window the layers are plain: the oracle's own forward
    assert torch.isfinite(data["V"][trainer.proma_coverage["covered"][0]]).all()


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("setting", ["accumulation", "intra"])
def test_activation_checkpointing_gives_the_same_step(tiny_tokenizer, tmp_path, setting, lora):
    """With activation checkpointing (TRL's default; the real-model job's memory setting) the layers' inputs are
    recomputed in the backward: the update is still the oracle's PROMA chain."""
    trainer = make_trainer(tiny_tokenizer, tmp_path, ga=3, lora=lora, **SETTINGS[setting])
    trainer.model.gradient_checkpointing_enable({"use_reentrant": False})  # what Trainer.train() does
    assert trainer.model.is_gradient_checkpointing
    # a module inside the checkpointed layer (the layer's own call is not repeated; its forward is)
    mlp = next(m for name, m in trainer.model.named_modules() if name.endswith("layers.0.mlp"))
    calls = []
    hook = mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    window = micro_batches(tiny_tokenizer, WINDOW)
    got = run_step(trainer, window)
    hook.remove()
    assert len(calls) == 2 * len(WINDOW)  # each micro-batch's forward and its recompute in the backward
    check_step(trainer, got, oracle_step_grads(trainer, window))
