"""ISOPO on the LM head (`isopo_lm_head=True`) inside TRL's fused log-prob kernel vs the float64 oracle.

The oracle's head gradients V_i come from per-sequence autograd through TRL's own kernel (which accumulates the head
gradient in float32), its inputs and logits gradients from a dense float64 forward with full logits
(`isopo_oracle.head_data`); coefficients from the dense formulas (`dense_weights`, `torch.linalg.solve`).
"""

import pytest
import torch
from isopo_oracle import dense_weights, head_data, make_batch, make_trainer, per_sequence_data, rel_err

from trl_isopo import ISOPOConfig, ISOPOTrainer
from trl_isopo.layerwise.head import scored_rows
from trl_isopo.isopo.isopo_backward import ISOPOSettings
from trl_isopo.layerwise.micro_batch import MicroBatch
from trl_isopo.tiny import build_tiny_causal_lm

# The kernel folds each float64 logits tile in float32 and accumulates the head gradient in float32 (TRL's numerics),
# so statistics and gradient agree with the float64 oracle to float32 rounding, not to 1e-10 as the covered layers do.
TOL = 1e-5


def isopo_grads(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    with trainer.isopo_active():
        trainer.compute_loss(trainer.model, inputs).backward()
    return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def setup(tiny_tokenizer, tmp_path_factory):
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=2)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path_factory.mktemp("head"), isopo_lm_head=True)
    inputs = make_batch(tiny_tokenizer, seed=1)
    data = per_sequence_data(trainer, inputs)
    V = torch.stack([g["lm_head.weight"] for g in data["grads"]])  # (B, vocab, H)
    X, G, mask = head_data(trainer, inputs)
    return trainer, inputs, V, X, G, mask


def test_oracle_is_consistent(setup):
    """The dense head data reproduce the kernel's per-sequence head gradients: V_i = sum_t g_t x_t^T."""
    _, _, V, X, G, mask = setup
    dense = torch.einsum("bto,bti->boi", G * mask.unsqueeze(-1), X)
    assert rel_err(dense, V) < 1e-6
    assert G.abs().sum() > 0 and V[2].norm() > 0


SETTINGS = [
    pytest.param(dict(p=-1.0, q=0.0, r=0.0, reg=0.0), id="p=-1,c=0"),
    pytest.param(dict(p=-1.0, q=0.0, r=0.0, reg=1.0), id="p=-1,c=1"),
    pytest.param(dict(p=0.0, q=-1.0, r=0.0, reg=1.0), id="q=-1,c=1"),
    pytest.param(dict(p=0.0, q=-1.0, r=-2.0, reg=0.0), id="p=0,q=-1,r=-2,c=0"),
]


def run_head(trainer, inputs, settings, ema=None, sample=None):
    ctx = trainer.isopo_backward
    ctx.settings = ISOPOSettings(**{**ctx.settings.__dict__, **settings})
    ctx.ema.ema = dict(ema or {})
    try:
        if sample is not None:  # covered layers draw their own samples; only the head's is fixed
            orig = ctx.fisher_sample
            ctx.fisher_sample = lambda name, mb, mask=None: sample if name == "lm_head" else orig(name, mb, mask)
        got = isopo_grads(trainer, inputs)
        record = ctx.records[-1] if ctx.records else None
    finally:
        ctx.__dict__.pop("fisher_sample", None)
        ctx.ema.ema = {}
        ctx.ema.discard_step()
        ctx.records.clear()
        ctx.lambdas.clear()
    return got, record


@pytest.mark.parametrize("route", ["auto", "gram", "mat"])
@pytest.mark.parametrize("sampled", [False, True], ids=["all_tokens", "sampled"])
@pytest.mark.parametrize("knobs", SETTINGS)
def test_head_matches_oracle(setup, knobs, sampled, route):
    trainer, inputs, V, X, G, mask = setup
    A = inputs["advantages"]
    B, C = mask.shape
    if sampled:  # a fixed sample of 5 scored positions, as flat indices into (B, C)
        valid = mask.reshape(-1).nonzero().squeeze(1)
        J = valid[torch.randperm(valid.numel(), generator=torch.Generator().manual_seed(4))[:5].to(valid.device)]
    else:
        J = mask.reshape(-1).nonzero().squeeze(1)
    Gm = G * mask.unsqueeze(-1)
    _, stats = dense_weights(V, X, Gm, J, A, -1.0, 0.0, 0.0, 0.0)
    mu = {k: float((v**2).mean()) * 0.7 for k, v in stats.items()}
    want_w, _ = dense_weights(V, X, Gm, J, A, knobs["p"], knobs["q"], knobs["r"], knobs["reg"], mu, n_step=len(A))
    n_tok = float(mask.sum())  # stored EMA values are in the normalizer's units (see test_isopo_oracle)
    units = {"e": n_tok**2, "f": n_tok**2, "rho": 1.0}
    ema = {f"lm_head/{k}": v * units[k] for k, v in mu.items()}
    got, _ = run_head(trainer, inputs, dict(knobs, route=route, fisher_tokens=0, interacting=False), ema,
                      J if sampled else None)
    want = torch.einsum("b,boi->oi", want_w, V)
    assert rel_err(got["lm_head.weight"], want) < TOL
    # not the advantage-weighted gradient the head gets without isopo_lm_head
    plain = torch.einsum("b,boi->oi", A.double(), V)
    assert rel_err(got["lm_head.weight"], plain) > 1e-2


@pytest.mark.parametrize("route", ["gram", "mat"])
def test_head_interacting_matches_dense_solve(setup, route):
    trainer, inputs, V, _, _, mask = setup
    A = inputs["advantages"].double()
    Vf = V.reshape(len(A), -1)
    K = Vf @ Vf.T
    lam = 0.7 * float(torch.diagonal(K).mean()) * 0.8
    n_tok = float(mask.sum())
    got, _ = run_head(trainer, inputs, dict(interacting=True, interacting_reg=0.7, route=route, p=-1.0, q=0.0, r=0.0),
                      {"lm_head/ntk": lam / 0.7 * n_tok**2})
    alpha = lam * torch.linalg.solve(K + lam * torch.eye(len(A), dtype=K.dtype, device=K.device), A)
    assert rel_err(got["lm_head.weight"], torch.einsum("b,boi->oi", alpha, V)) < TOL


def test_head_keeps_ema_and_metrics(setup):
    """The head's statistics enter the EMA under its module name and its record joins the step metrics."""
    trainer, inputs, *_ = setup
    ctx = trainer.isopo_backward
    ctx.settings = ISOPOSettings(**{**ctx.settings.__dict__, "p": -1.0, "q": 0.0, "r": 0.0, "reg": 1.0,
                                    "interacting": False, "fisher_tokens": 0, "route": "auto"})
    try:
        isopo_grads(trainer, inputs)
        n_records = len(ctx.records)
        ctx.ema.end_step()
        assert "lm_head/f" in ctx.ema.ema and ctx.ema.ema["lm_head/f"] > 0
        assert n_records == len(trainer.isopo_coverage["covered"]) + 1
    finally:
        ctx.ema.ema = {}
        ctx.records.clear()


def test_scored_rows_both_layouts():
    """Row of each scored position (b, c) in TRL's full layout (all B (L-1) shifted positions) and in its compact one
    (only positions with a valid shifted label, row-major), against a direct enumeration."""
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    mb = MicroBatch(mask=mask, advantages=torch.zeros(3), logits_to_keep=3)
    B, L = mask.shape
    rows, valid = scored_rows(mb, B * (L - 1))
    assert torch.equal(valid, mask[:, -3:])
    assert torch.equal(rows[valid], (torch.arange(B).unsqueeze(1) * (L - 1) + torch.arange(L - 4, L - 1))[valid])
    scored = [(b, t) for b in range(B) for t in range(L - 1) if t >= L - 1 - 3 and mask[b, t + 1]]
    rows_c, valid_c = scored_rows(mb, len(scored))
    assert torch.equal(valid_c, valid)
    for r, (b, t) in enumerate(scored):
        assert rows_c[b, t - (L - 1 - 3)] == r


def test_lora_head_is_rejected(tiny_tokenizer, tmp_path):
    from peft import LoraConfig

    from trl_isopo.tiny import tiny_prompt_dataset, tiny_reward, tiny_training_args

    model = build_tiny_causal_lm(tiny_tokenizer)
    args = ISOPOConfig(**tiny_training_args(tmp_path, per_device_train_batch_size=4, num_generations=4),
                       isopo_lm_head=True)
    with pytest.raises(ValueError, match="isopo_lm_head"):
        ISOPOTrainer(model, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(8), processing_class=tiny_tokenizer,
                     peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))


@pytest.mark.parametrize("keep_half", [False, True], ids=["upcast", "half"])
def test_bf16_head_close_to_float64_oracle(tiny_tokenizer, tmp_path, setup, keep_half):
    """A bf16 copy of the same model: the ISOPO head gradient (p = -1, c = 0, exact Fisher estimate) is within bf16's
    error of the float64 oracle (measured 6.4e-3; bound 5e-2; the advantage-weighted gradient is 1.7 away), on the CPU
    path (statistics upcast) and the GPU's half-operand path (`ISOPOSettings.force_half_operands`)."""
    _, inputs, V, X, G, mask = setup
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=2).to(torch.bfloat16)  # setup's weights
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, isopo_lm_head=True)
    J = mask.reshape(-1).nonzero().squeeze(1)
    A = inputs["advantages"]
    want_w, _ = dense_weights(V, X, G * mask.unsqueeze(-1), J, A, -1.0, 0.0, 0.0, 0.0, n_step=len(A))
    got, _ = run_head(trainer, inputs, dict(p=-1.0, q=0.0, r=0.0, reg=0.0, fisher_tokens=0, interacting=False,
                                                 force_half_operands=keep_half))
    gw = got["lm_head.weight"]
    assert gw.dtype == torch.bfloat16 and torch.isfinite(gw).all()
    want = torch.einsum("b,boi->oi", want_w, V)
    assert rel_err(gw.double(), want) < 5e-2
    assert rel_err(gw.double(), torch.einsum("b,boi->oi", A.double(), V)) > 0.2


def test_train_and_resume_with_isopo_head(tiny_model_dir, tiny_tokenizer, tmp_path):
    """`trainer.train()` with isopo_lm_head=True: the head trains, its EMA statistics are checkpointed under its name,
    and 2 steps + resume + 2 steps equal 4 straight steps bit for bit."""
    import json

    from isopo_trainer_support import config, resume_and_compare, run

    common = dict(max_steps=4, isopo_reg=1.0, isopo_lm_head=True, save_strategy="steps", save_steps=2,
                  learning_rate=3e-2)
    straight, _, changed = run(tiny_model_dir, tiny_tokenizer, config(tmp_path / "a", **common))
    assert "lm_head.weight" in changed and straight.isopo_coverage["lm_head"] == "isopo"
    ckpt = tmp_path / "a" / "out" / "checkpoint-2"
    state = json.load(open(ckpt / "isopo_state.json"))
    assert any(k.startswith("lm_head/") for k in state["ema"]["ema"])
    assert any("isopo/fisher_norm" in h for h in straight.state.log_history)
    resumed = resume_and_compare(tiny_model_dir, tiny_tokenizer, config(tmp_path / "b", **common), ckpt, straight)
    assert resumed.isopo_backward.ema.ema == straight.isopo_backward.ema.ema
