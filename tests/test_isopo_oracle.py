"""ISOPO inside TRL's real loss path vs a brute-force float64 oracle (per-sequence autograd, dense formulas)."""

import pytest
import torch
from isopo_oracle import dense_weights, make_batch, make_trainer, per_sequence_data, rel_err
from isopo_oracle_checks import (
    SETTINGS,
    TOL,
    check_interacting_matches_dense_solve,
    check_isopo_matches_oracle,
    isopo_grads,
    set_settings,
    tol,
)

from trl_isopo.tiny import build_tiny_causal_lm


@pytest.fixture(scope="module")
def setup(tiny_tokenizer, tmp_path_factory):
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=1)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path_factory.mktemp("oracle"))
    inputs = make_batch(tiny_tokenizer)
    data = per_sequence_data(trainer, inputs)
    return trainer, inputs, data


@pytest.mark.parametrize("route", ["auto", "gram", "mat"])
@pytest.mark.parametrize("sample_mode", ["all", "fixed"])
@pytest.mark.parametrize("knobs", SETTINGS)
def test_isopo_matches_oracle(setup, knobs, sample_mode, route):
    check_isopo_matches_oracle(setup, knobs, sample_mode, route)


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
        w, _ = dense_weights(data["V"][n], data["X"][n], data["G"][n], valid, inputs["advantages"], -1.0, 0, 0, 0.0, n_step=len(inputs["advantages"]))
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
    check_interacting_matches_dense_solve(setup)


def test_first_step_ema_semantics_and_update(setup):
    """No history: each sequence is regularized by its own x^2 (R = sqrt(1/c + 1)); after the step the EMA holds the
    batch mean of f^2, and the next step uses it."""
    trainer, inputs, data = setup
    ctx = trainer.isopo_backward
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
        w, _ = dense_weights(data["V"][n], data["X"][n], data["G"][n], valid, A, -1.0, 0, 0, 0.0, n_step=len(A))
        want = torch.einsum("b,boi->oi", w, data["V"][n])
        for key, got in results.items():
            assert torch.isfinite(got[f"{n}.weight"]).all()
            assert rel_err(got[f"{n}.weight"], want) < TOL, (key, n)
