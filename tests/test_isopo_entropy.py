"""ISOPO with TRL's entropy bonus, `top_entropy_quantile < 1` and a MoE router aux loss (docs/grpo-config.md).

Oracles (float64):
- entropy bonus, aux loss: grad_ISOPO(term) = grad_ISOPO(no term) + plain autograd of the term, for every trainable
  parameter (the term is added unweighted, like the KL term of tests/test_isopo_kl.py); the entropy from full logits.
- `top_entropy_quantile`: the trainer's covered-layer gradients equal the dense formulas of tests/isopo_oracle.py on
  per-sequence gradients of the surrogate with the low-entropy tokens removed (their log-probs detached), and the
  other parameters get the advantage-weighted gradient of that surrogate.
"""

import numpy as np
import pytest
import torch
from isopo_oracle import dense_weights, layer_io, make_batch, make_trainer, rel_err, row, surrogate_logps
from kl_support import BETA, isopo_grads, kl_oracle, with_reference

from trl_isopo.isopo.isopo_backward import ISOPOSettings
from trl_isopo.tiny import build_tiny_causal_lm

TOL = 1e-10
# TRL's fused head accumulates the LM-head weight gradient in float32 even for float64 inputs.
HEAD_TOL = 1e-6
# The entropy bonus's gradient goes through the entropies TRL's fused kernel returns, which carry float32-level
# rounding for a float64 model: measured worst relative error 2.7e-8 over these tests (2026-12-02, CPU).
ENT_TOL = 1e-6
COEF = 0.7
# Qwen3-MoE's router takes its softmax in float32 even in a float64 model.
ROUTER_TOL = 1e-6


def full_logps_entropies(trainer, inputs):
    """(B, C) log-probs and entropies from full temperature-scaled logits (no fused kernel), differentiable."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    C = inputs["completion_ids"].shape[1]
    logits = trainer.model(input_ids=ids, attention_mask=att).logits[:, -C - 1 : -1] / trainer.temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(-1, inputs["completion_ids"][..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def high_entropy_mask(entropies, mask, top_q):
    """Tokens at or above the (1 - top_q) quantile of the completion tokens' entropies (numpy's linear quantile)."""
    m = mask.bool()
    threshold = np.quantile(entropies.detach()[m].double().numpy(), 1.0 - top_q)
    return m & (entropies.detach() >= torch.tensor(threshold, dtype=entropies.dtype))


def plain_grads(trainer, loss):
    params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: g for n, g in zip(params, grads) if g is not None}


def entropy_oracle(trainer, inputs, coef, top_q=1.0):
    """Plain autograd of -coef * mean entropy over the (high-entropy) completion tokens (GA = 1)."""
    _, ent = full_logps_entropies(trainer, inputs)
    mask = inputs["completion_mask"].bool()
    if top_q < 1.0:
        mask = high_entropy_mask(ent, mask, top_q)
    m = mask.to(ent.dtype)
    return plain_grads(trainer, -coef * (ent * m).sum() / m.sum())


def set_knobs(trainer, **knobs):
    ctx = trainer.isopo_backward
    ctx.settings = ISOPOSettings(**{**ctx.settings.__dict__, "fisher_tokens": 0, **knobs})


def grads_without_and_with(trainer, inputs, term, coef):
    """ISOPO gradients with the trainer's `term` coefficient at 0, then at `coef`; each pass's pending EMA values are
    dropped (no optimizer step follows)."""
    grads = []
    for value in (0.0, coef):
        setattr(trainer, term, value)
        grads.append(isopo_grads(trainer, inputs))
        trainer.isopo_backward.ema.discard_step()
    return grads


def check_identity(got, base, *extras, tol=TOL):
    """got == base + sum(extras) for every parameter; returns the worst relative error."""
    assert set(got) == set(base)
    worst = 0.0
    for n in got:
        want = base[n] + sum(e[n] for e in extras if n in e)
        err = rel_err(got[n], want)
        worst = max(worst, err)
        assert err < max(tol, HEAD_TOL if n.startswith("lm_head") else TOL), (n, err)
    return worst


@pytest.mark.parametrize(
    "knobs,other,head",
    [(dict(p=-1.0, reg=0.0), "advantage_weighted", False), (dict(p=0.0, q=-1.0, r=-2.0, reg=0.0), "surrogate", False),
     (dict(interacting=True), "advantage_weighted", False), (dict(p=-1.0, reg=0.0), "advantage_weighted", True)],
    ids=["p=-1", "fig6,surrogate", "interacting", "p=-1,lm_head"],
)
def test_entropy_bonus_is_added_unweighted(tiny_tokenizer, tmp_path, knobs, other, head):
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=1)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, isopo_other_params=other, entropy_coef=COEF,
                           isopo_lm_head=head)
    set_knobs(trainer, **knobs)
    inputs = make_batch(tiny_tokenizer)
    want = entropy_oracle(trainer, inputs, COEF)
    base, got = grads_without_and_with(trainer, inputs, "entropy_coef", COEF)
    check_identity(got, base, want, tol=ENT_TOL)
    assert all(want[f"{n}.weight"].norm() > 0 for n in trainer.isopo_coverage["covered"])


def test_entropy_bonus_with_kl_lora_and_quantile(tiny_tokenizer, tmp_path):
    """beta > 0, PEFT LoRA and top_entropy_quantile < 1 together: base + KL + bonus on the high-entropy tokens."""
    from peft import LoraConfig

    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=3)
    lc = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM",
                    init_lora_weights=False)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, peft_config=lc, entropy_coef=COEF,
                           top_entropy_quantile=0.5)
    for p in trainer.model.parameters():
        p.data = p.data.double()
    set_knobs(trainer, p=-1.0, reg=0.0)
    inputs = with_reference(trainer, make_batch(tiny_tokenizer, seed=2), seed=1)
    want_kl, _ = kl_oracle(trainer, inputs, BETA, True)
    want_ent = entropy_oracle(trainer, inputs, COEF, top_q=0.5)
    trainer.beta, trainer.entropy_coef = 0.0, 0.0
    base = isopo_grads(trainer, inputs)
    trainer.beta, trainer.entropy_coef = BETA, COEF
    got = isopo_grads(trainer, inputs)
    assert got and all("lora_" in n for n in got)
    check_identity(got, base, want_kl, want_ent, tol=ENT_TOL)
    assert trainer._metrics["train"]["entropy_coef"][-1] == COEF


# ================================================================================================ top_entropy_quantile
def masked_per_sequence_data(trainer, inputs, keep):
    """Per sequence i: V_i of each covered layer, every trainable parameter's gradient, and each covered layer's
    inputs X and output gradients G, for the bnpo surrogate with the tokens outside `keep` removed:
    -sum_t keep_it log pi_it / (all completion tokens). Plain autograd on one row at a time."""
    layers = {n: m for n, m in trainer.model.named_modules() if n in set(trainer.isopo_coverage["covered"])}
    params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    n_tok = inputs["completion_mask"].sum().double()
    data = {"V": {n: [] for n in layers}, "X": {n: [] for n in layers}, "G": {n: [] for n in layers}, "grads": []}
    for b in range(inputs["prompt_ids"].shape[0]):
        with layer_io(layers) as store:  # TRL's forward, as tests/isopo_oracle.py (float32 parts cancel)
            logps = surrogate_logps(trainer, row(inputs, b))
        loss = -(logps * keep[b : b + 1]).sum() / n_tok
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True, retain_graph=True)
        gouts = torch.autograd.grad(loss, [store[n][1] for n in layers], allow_unused=True)
        g = {n: torch.zeros_like(p) if gr is None else gr for (n, p), gr in zip(params.items(), grads)}
        data["grads"].append(g)
        for (n, _), go in zip(layers.items(), gouts):
            data["V"][n].append(g[f"{n}.weight"])
            data["X"][n].append(store[n][0][0])
            data["G"][n].append(torch.zeros_like(store[n][1][0]) if go is None else go[0])
    for key in ("V", "X", "G"):
        data[key] = {n: torch.stack(v) for n, v in data[key].items()}
    data["mask"] = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1).bool()
    return data


@pytest.mark.parametrize("knobs", [dict(p=-1.0, q=0.0, r=0.0), dict(p=0.0, q=-1.0, r=-2.0)], ids=["p=-1", "fig6"])
def test_top_entropy_quantile_masks_the_seed(tiny_tokenizer, tmp_path, knobs):
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=1)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, top_entropy_quantile=0.4)
    inputs = make_batch(tiny_tokenizer)
    with torch.no_grad():
        _, ent = full_logps_entropies(trainer, inputs)
    keep = high_entropy_mask(ent, inputs["completion_mask"], 0.4).to(torch.float64)
    assert 0 < keep.sum() < inputs["completion_mask"].sum()
    data = masked_per_sequence_data(trainer, inputs, keep)
    set_knobs(trainer, **knobs, reg=0.0, interacting=False, route="auto")
    got = isopo_grads(trainer, inputs)
    trainer.isopo_backward.ema.discard_step()
    A = inputs["advantages"]
    valid = data["mask"].reshape(-1).nonzero().squeeze(1)
    covered = trainer.isopo_coverage["covered"]
    for n in covered:
        w, _ = dense_weights(data["V"][n], data["X"][n], data["G"][n], valid, A, knobs["p"], knobs["q"], knobs["r"],
                             0.0, n_step=len(A))
        assert rel_err(got[f"{n}.weight"], torch.einsum("b,boi->oi", w, data["V"][n])) < TOL, n
    covered_params = {f"{n}.weight" for n in covered} | {f"{n}.bias" for n in covered}
    for n in (n for n in data["grads"][0] if n not in covered_params):
        want = sum(float(A[i]) * data["grads"][i][n] for i in range(len(A)))
        assert rel_err(got[n], want) < (HEAD_TOL if n.startswith("lm_head") else TOL), n
    # negative control: the unmasked surrogate gives different layer gradients
    full = masked_per_sequence_data(trainer, inputs, inputs["completion_mask"].to(torch.float64))
    n = covered[0]
    w, _ = dense_weights(full["V"][n], full["X"][n], full["G"][n], valid, A, knobs["p"], knobs["q"], knobs["r"], 0.0,
                         n_step=len(A))
    assert rel_err(got[f"{n}.weight"], torch.einsum("b,boi->oi", w, full["V"][n])) > 1e-3


# ================================================================================================ router aux loss
def test_router_aux_loss_is_added_unweighted(tiny_tokenizer, tmp_path):
    from moe_support import build_tiny_moe

    # Other parameters on the surrogate here; the default (advantage_weighted) on a MoE model is tested below.
    trainer = make_trainer(build_tiny_moe(tiny_tokenizer), tiny_tokenizer, tmp_path, router_aux_loss_coef=COEF,
                           isopo_other_params="surrogate")
    assert trainer.aux_loss_enabled and trainer.isopo_coverage["covered"]
    set_knobs(trainer, p=-1.0, reg=0.0)
    inputs = make_batch(tiny_tokenizer)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    want = plain_grads(trainer, COEF * trainer.model(input_ids=ids, attention_mask=att, output_router_logits=True).aux_loss)
    base, got = grads_without_and_with(trainer, inputs, "router_aux_loss_coef", COEF)
    router = [n for n in want if "mlp.gate" in n]
    assert router and all(want[n].norm() > 0 for n in router)
    check_identity(got, base, want)


def test_moe_experts_and_router_are_advantage_weighted(tiny_tokenizer, tmp_path):
    """isopo_other_params="advantage_weighted" (the default) on a MoE model: the stacked experts and the router see the
    (B, L) positions flattened and the router returns a tuple; with every ISOPO weight forced to 1 (coefficients
    A_i), every parameter's gradient equals plain autograd of the advantage-weighted surrogate (float64), and the
    router aux loss still adds its plain gradient."""
    from moe_support import build_tiny_moe

    trainer = make_trainer(build_tiny_moe(tiny_tokenizer), tiny_tokenizer, tmp_path, router_aux_loss_coef=COEF)
    assert trainer.isopo_coverage["other_params_mode"] == "advantage_weighted"
    inputs = make_batch(tiny_tokenizer, seed=5)
    A, mask = inputs["advantages"].double(), inputs["completion_mask"]
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    att = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    aux = plain_grads(trainer, COEF * trainer.model(input_ids=ids, attention_mask=att, output_router_logits=True).aux_loss)
    trainer.model.zero_grad(set_to_none=True)
    (-(A[:, None] * surrogate_logps(trainer, inputs) * mask).sum() / mask.sum()).backward()
    want = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.isopo_backward.weight_override = lambda name, adv: adv
    try:
        base, got = grads_without_and_with(trainer, inputs, "router_aux_loss_coef", COEF)
    finally:
        trainer.isopo_backward.weight_override = None
    experts = [n for n in want if ".mlp.experts." in n or ".mlp.gate." in n]
    assert len(experts) == 3 and all(want[n].norm() > 0 for n in experts)
    # The router's softmax runs in float32 whatever the model's dtype, so its weight carries float32 rounding.
    router = {n for n in want if ".mlp.gate." in n}
    for keep, tol in ((lambda n: n not in router, TOL), (lambda n: n in router, ROUTER_TOL)):
        sub = lambda d: {n: v for n, v in d.items() if keep(n)}  # noqa: E731
        check_identity(sub(base), sub(want), tol=tol)  # no aux term: exactly the advantage-weighted gradient
        check_identity(sub(got), sub(base), sub(aux), tol=tol)


def test_leaf_rule_allows_parameter_free_children_only():
    """A module owning parameters may have children (an activation) as long as none of them owns trainable ones."""
    from torch import nn

    from trl_isopo.isopo.isopo_backward import ISOPO
    from trl_isopo.layerwise.other_params import check_leaf_module

    class Experts(nn.Module):
        def __init__(self, child):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2, 3))
            self.child = child

    check_leaf_module("experts", Experts(nn.SiLU()), ISOPO)
    frozen = nn.Linear(3, 3).requires_grad_(False)
    check_leaf_module("experts", Experts(frozen), ISOPO)
    with pytest.raises(ValueError, match="sub-modules that do too"):
        check_leaf_module("experts", Experts(nn.Linear(3, 3)), ISOPO)


# ================================================================================================ training runs
def _args(out, **kw):
    from trl_isopo import ISOPOConfig

    return ISOPOConfig(
        output_dir=out, report_to="none", use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=6, max_steps=2, logging_steps=1, learning_rate=1e-2, isopo_fisher_tokens=16, seed=0,
        beta=0.1, entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=100.0, entropy_coef_delta=1e-3,
        top_entropy_quantile=0.5, **kw,
    )  # fmt: skip


def test_train_with_entropy_bonus_quantile_and_kl(tiny_model_dir, tiny_tokenizer, tmp_path):
    """End to end (reference model, adaptive bonus, high-entropy mask): trains and logs TRL's entropy_coef."""
    from trl_isopo import ISOPOTrainer
    from trl_isopo.tiny import tiny_prompt_dataset, tiny_reward

    trainer = ISOPOTrainer(tiny_model_dir, tiny_reward, args=_args(str(tmp_path / "out")),
                           train_dataset=tiny_prompt_dataset(32), processing_class=tiny_tokenizer)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "isopo/scale_mean" in h]
    # adaptive: entropy (<= 100) is below target at every step, so the coefficient rises by entropy_coef_delta
    assert [h["entropy_coef"] for h in logs] == pytest.approx([0.01 + 1e-3, 0.01 + 2e-3])
    assert all("kl" in h for h in logs)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


@pytest.mark.multiprocess
def test_two_processes_keep_identical_parameters(tmp_path):
    """DDP (2 gloo CPU ranks, different data): the bonus and KL gradients join before the all-reduce, and the
    high-entropy threshold and the adaptive coefficient are global, so both ranks step and log identically."""
    import json
    import os

    from _launch import launch_two_processes

    out = tmp_path / "result"
    proc = launch_two_processes(os.path.abspath(__file__), str(out))
    results = [json.load(open(f"{out}.rank{r}.json")) for r in (0, 1)]
    assert results[0]["world_size"] == results[1]["world_size"] == 2, proc.stdout[-2000:]
    assert results[0]["param_hash"] == results[1]["param_hash"] and results[0]["changed"]
    assert results[0]["entropy_coef"] == results[1]["entropy_coef"] and len(results[0]["entropy_coef"]) == 2
    assert "outside the backward pass" not in proc.stdout + proc.stderr


def _two_process_main(out: str):  # run by `accelerate launch` on this file
    import json

    from ddp_support import tiny_world, train_fingerprint

    from trl_isopo import ISOPOTrainer
    from trl_isopo.tiny import load_tiny_tokenizer, tiny_prompt_dataset, tiny_reward

    state, model_dir = tiny_world(out)
    trainer = ISOPOTrainer(model_dir, tiny_reward, args=_args(out + ".run"), train_dataset=tiny_prompt_dataset(64),
                           processing_class=load_tiny_tokenizer(model_dir))
    run = train_fingerprint(trainer)
    with open(f"{out}.rank{state.process_index}.json", "w") as f:
        json.dump({"world_size": state.num_processes, **run,
                   "entropy_coef": [h["entropy_coef"] for h in trainer.state.log_history if "entropy_coef" in h]}, f)


def test_extra_terms_follow_the_kl_sharding_rule():
    """The bonus and the aux loss take the KL term's extra pass, so they are refused where beta > 0 is."""
    from trl_isopo.isopo.isopo_backward import ISOPO
    from trl_isopo.layerwise.install import unsupported_sharding

    for args in ((True, True, 0), (False, False, 2), (False, False, 1)):  # FSDP2, ZeRO-2, ZeRO-1
        for extra in (("an entropy bonus",), ("a router aux loss",)):
            assert extra[0] in unsupported_sharding(ISOPO, *args, 0.0, extra)
        assert unsupported_sharding(ISOPO, *args, 0.0) is None
    assert unsupported_sharding(ISOPO, False, False, 0, 0.04, ("an entropy bonus", "a router aux loss")) is None  # DDP


if __name__ == "__main__":
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _two_process_main(sys.argv[1])
    from _launch import end_world

    end_world()
