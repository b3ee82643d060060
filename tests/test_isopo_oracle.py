"""ISOPO inside TRL's real loss path vs a brute-force float64 oracle (per-sequence autograd, dense formulas)."""

import copy

import pytest
import torch
from isopo_oracle import dense_weights, make_batch, make_trainer, per_sequence_data, rel_err

from trl_isopo.isopo.linear import ISOPOSettings
from trl_isopo.tiny import build_tiny_causal_lm

TOL = 1e-10
# TRL's fused log-prob kernel accumulates the LM-head weight gradient in float32 even for float64 inputs, so sums over
# tokens in a different order (one row vs the whole batch) differ at float32 rounding for that one parameter.
HEAD_TOL = 1e-6


def tol(name):
    return HEAD_TOL if name.startswith("lm_head") else TOL


def isopo_grads(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    with trainer.isopo_active():
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
    return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def set_settings(trainer, **kw):
    trainer.isopo_context.settings = ISOPOSettings(**{**trainer.isopo_context.settings.__dict__, **kw})


@pytest.fixture(scope="module")
def setup(tiny_tokenizer, tmp_path_factory):
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=1)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path_factory.mktemp("oracle"))
    inputs = make_batch(tiny_tokenizer)
    data = per_sequence_data(trainer, inputs)
    return trainer, inputs, data


def fixed_samples(data, trainer, k=7, seed=3):
    g = torch.Generator().manual_seed(seed)
    valid = data["mask"].reshape(-1).nonzero().squeeze(1)
    return {n: valid[torch.randperm(valid.numel(), generator=g)[:k]] for n in trainer.isopo_coverage["covered"]}


SETTINGS = [
    pytest.param(dict(p=-1.0, q=0.0, r=0.0, reg=0.0), id="p=-1,c=0"),
    pytest.param(dict(p=-1.0, q=0.0, r=0.0, reg=1.0), id="p=-1,c=1"),
    pytest.param(dict(p=0.0, q=-1.0, r=0.0, reg=1.0), id="q=-1,c=1"),
    pytest.param(dict(p=0.0, q=-1.0, r=-2.0, reg=0.0), id="p=0,q=-1,r=-2,c=0"),
]


@pytest.mark.parametrize("route", ["auto", "gram", "mat"])
@pytest.mark.parametrize("sample_mode", ["all", "fixed"])
@pytest.mark.parametrize("knobs", SETTINGS)
def test_isopo_matches_oracle(setup, knobs, sample_mode, route):
    trainer, inputs, data = setup
    ctx = trainer.isopo_context
    covered = trainer.isopo_coverage["covered"]
    valid = data["mask"].reshape(-1).nonzero().squeeze(1)
    samples = fixed_samples(data, trainer) if sample_mode == "fixed" else {n: valid for n in covered}
    set_settings(trainer, **knobs, route=route, fisher_tokens=0, interacting=False)
    A = inputs["advantages"]
    # A known EMA history (layer-dependent) so that c > 0 really re-weights; c = 0 ignores it.
    mus, expected = {}, {}
    for i, n in enumerate(covered):
        _, stats = dense_weights(data["V"][n], data["X"][n], data["G"][n], samples[n], A, -1.0, 0.0, 0.0, 0.0)
        mus[n] = {k: float((v**2).mean()) * (0.3 + 0.2 * i) for k, v in stats.items()}
        w, _ = dense_weights(data["V"][n], data["X"][n], data["G"][n], samples[n], A, knobs["p"], knobs["q"], knobs["r"], knobs["reg"], mus[n])
        expected[n] = w
    # The trainer's regularizer sees the statistics times the loss normalizer (bnpo, GA = 1: the completion tokens),
    # so the EMA history is stored in those units: e and f scale with it, rho does not.
    n_tok = float(inputs["completion_mask"].sum())
    units = {"e": n_tok**2, "f": n_tok**2, "rho": 1.0}
    ctx.ema.ema = {f"{n}/{k}": v * units[k] for n, d in mus.items() for k, v in d.items()}
    ctx.sample_override = samples
    try:
        got = isopo_grads(trainer, inputs)
    finally:
        ctx.sample_override = None
        ctx.ema.ema = {}
        ctx.ema.discard_step()
    for n in covered:
        want = torch.einsum("b,boi->oi", expected[n], data["V"][n])
        assert rel_err(got[f"{n}.weight"], want) < TOL, n
    # Every other trainable parameter: the ordinary advantage-weighted gradient (default isopo_other_params).
    covered_params = {f"{n}.weight" for n in covered} | {f"{n}.bias" for n in covered}
    others = [n for n in data["grads"][0] if n not in covered_params]
    assert others, "the tiny model has embeddings, norms and an untied LM head"
    for n in others:
        want = sum(float(A[i]) * data["grads"][i][n] for i in range(len(A)))
        assert rel_err(got[n], want) < tol(n), n


def test_covered_bias_is_reweighted_like_its_weight(tiny_tokenizer, tmp_path):
    """Qwen2 q/k/v have biases: their gradient is sum_i w_i b_i with the weight's coefficients."""
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=2)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path)
    inputs = make_batch(tiny_tokenizer, seed=5)
    data = per_sequence_data(trainer, inputs)
    set_settings(trainer, p=-1.0, reg=0.0, fisher_tokens=0)
    got = isopo_grads(trainer, inputs)
    valid = data["mask"].reshape(-1).nonzero().squeeze(1)
    n_bias = 0
    for n in trainer.isopo_coverage["covered"]:
        if data["b"][n][0] is None:
            continue
        w, _ = dense_weights(data["V"][n], data["X"][n], data["G"][n], valid, inputs["advantages"], -1.0, 0, 0, 0.0)
        want = sum(float(w[i]) * data["b"][n][i] for i in range(len(w)))
        assert rel_err(got[f"{n}.bias"], want) < TOL
        n_bias += 1
    with_bias = [n for n, m in trainer.model.named_modules() if n in trainer.isopo_coverage["covered"] and m.bias is not None]
    assert n_bias == len(with_bias) == 6  # q, k, v of both layers


@pytest.mark.parametrize("mode", ["surrogate", "frozen"])
def test_other_params_modes(tiny_tokenizer, tmp_path, mode):
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=1)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, isopo_other_params=mode)
    inputs = make_batch(tiny_tokenizer)
    covered = set(trainer.isopo_coverage["covered"])
    others = [n for n, p in trainer.model.named_parameters() if n.rsplit(".", 1)[0] not in covered]
    if mode == "frozen":
        assert all(not p.requires_grad for n, p in trainer.model.named_parameters() if n in others)
        got = isopo_grads(trainer, inputs)
        assert not any(n in got for n in others)
        assert all(f"{n}.weight" in got for n in covered)
        return
    data = per_sequence_data(trainer, inputs)
    got = isopo_grads(trainer, inputs)
    for n in others:
        want = sum(data["grads"][i][n] for i in range(len(inputs["advantages"])))
        assert rel_err(got[n], want) < tol(n), n


def test_interacting_matches_dense_solve(setup):
    trainer, inputs, data = setup
    ctx = trainer.isopo_context
    covered = trainer.isopo_coverage["covered"]
    A = inputs["advantages"].double()
    for route in ("gram", "mat"):
        set_settings(trainer, interacting=True, interacting_reg=0.7, route=route)
        lams = {}
        for i, n in enumerate(covered):
            V = data["V"][n].reshape(len(A), -1)
            K = V @ V.T
            lams[n] = 0.7 * float(torch.diagonal(K).mean()) * (0.5 + 0.3 * i)  # c_K * EMA(mean eigenvalue)
        n_tok = float(inputs["completion_mask"].sum())  # K in the normalization-free units: times n_tok^2
        ctx.ema.ema = {f"{n}/ntk": lams[n] / 0.7 * n_tok**2 for n in covered}
        try:
            got = isopo_grads(trainer, inputs)
        finally:
            ctx.ema.ema = {}
            ctx.ema.discard_step()
            set_settings(trainer, interacting=False, route="auto")
        for n in covered:
            V = data["V"][n]
            K = V.reshape(len(A), -1) @ V.reshape(len(A), -1).T
            alpha = lams[n] * torch.linalg.solve(K + lams[n] * torch.eye(len(A), dtype=K.dtype), A)
            assert rel_err(got[f"{n}.weight"], torch.einsum("b,boi->oi", alpha, V)) < TOL, (route, n)


def test_first_step_ema_semantics_and_update(setup):
    """No history: each sequence is regularized by its own x^2 (R = sqrt(1/c + 1)); after the step the EMA holds the
    batch mean of f^2, and the next step uses it."""
    trainer, inputs, data = setup
    ctx = trainer.isopo_context
    set_settings(trainer, p=-1.0, q=0.0, r=0.0, reg=1.0, fisher_tokens=0, route="auto", interacting=False)
    ctx.ema.ema = {}
    got = isopo_grads(trainer, inputs)
    valid = data["mask"].reshape(-1).nonzero().squeeze(1)
    A = inputs["advantages"].double()
    for n in trainer.isopo_coverage["covered"]:
        w, stats = dense_weights(data["V"][n], data["X"][n], data["G"][n], valid, A, -1.0, 0, 0, 1.0, mu=None)
        # mu = own f^2, so R = sqrt(f^2 / f^2 + 1) = sqrt(2) exactly (no absolute guard)
        nz = A != 0
        assert torch.allclose(w[nz] / A[nz], torch.full_like(w[nz], 2**-0.5), rtol=1e-12)
        assert rel_err(got[f"{n}.weight"], torch.einsum("b,boi->oi", w, data["V"][n])) < TOL, n
    ctx.ema.end_step()
    n_tok = float(inputs["completion_mask"].sum())  # the EMA holds the normalization-free statistic: f * n_tok
    for n in trainer.isopo_coverage["covered"]:
        _, stats = dense_weights(data["V"][n], data["X"][n], data["G"][n], valid, A, -1.0, 0, 0, 0.0)
        assert ctx.ema.ema[f"{n}/f"] == pytest.approx(float((stats["f"] ** 2).mean()) * n_tok**2, rel=1e-12)
        assert f"{n}/e" not in ctx.ema.ema  # q = 0: the Euclidean statistic is not regularized, not tracked
    ctx.ema.ema = {}


def test_single_valid_token_and_empty_completion(tiny_tokenizer, tmp_path):
    """Routes agree with the oracle for a sequence with one valid token and one with an empty completion."""
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=4)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path)
    inputs = make_batch(tiny_tokenizer, seed=9, prompt_lens=(1, 3, 5, 2), completion_lens=(0, 1, 4, 2))
    inputs["prompt_ids"][0, -1] = tiny_tokenizer.convert_tokens_to_ids("a")
    data = per_sequence_data(trainer, inputs)
    valid = data["mask"].reshape(-1).nonzero().squeeze(1)
    A = inputs["advantages"]
    results = {}
    for route, budget in (("gram", 2**27), ("mat", 2**27), ("gram", 512), ("mat", 512)):
        set_settings(trainer, p=-1.0, q=0.0, r=0.0, reg=0.0, fisher_tokens=0, route=route, budget_bytes=budget)
        results[(route, budget)] = isopo_grads(trainer, inputs)
    for n in trainer.isopo_coverage["covered"]:
        w, _ = dense_weights(data["V"][n], data["X"][n], data["G"][n], valid, A, -1.0, 0, 0, 0.0)
        want = torch.einsum("b,boi->oi", w, data["V"][n])
        for key, got in results.items():
            assert torch.isfinite(got[f"{n}.weight"]).all()
            assert rel_err(got[f"{n}.weight"], want) < TOL, (key, n)
