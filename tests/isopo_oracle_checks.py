"""The ISOPO oracle checks shared by tests/test_isopo_oracle.py (tiny model) and tests/test_real_model.py (two real
SmolLM2 layers): settings, tolerances, and the comparisons of the trainer's gradients with tests/isopo_oracle.py."""

import pytest
import torch
from isopo_oracle import dense_weights, rel_err

from trl_isopo.isopo.isopo_backward import ISOPOSettings

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


def isopo_grads_fixed(trainer, inputs, samples, ema=None):
    """`isopo_grads` with each covered layer's Fisher sample fixed (`samples`: name -> flat token indices) and, when
    given, the EMA history `ema`; both are cleared afterwards and the pass's pending EMA values dropped."""
    ctx = trainer.isopo_backward
    if ema is not None:
        ctx.ema.ema = ema
    ctx.sampler.override = samples
    try:
        return isopo_grads(trainer, inputs)
    finally:
        ctx.sampler.override = None
        ctx.ema.ema = {}
        ctx.ema.discard_step()


def set_settings(trainer, **kw):
    trainer.isopo_backward.settings = ISOPOSettings(**{**trainer.isopo_backward.settings.__dict__, **kw})


def fixed_samples(data, trainer, k=7, seed=3):
    g = torch.Generator().manual_seed(seed)
    valid = data["mask"].reshape(-1).nonzero().squeeze(1)
    # one permutation per layer from the CPU generator, indices moved to the test device
    return {n: valid[torch.randperm(valid.numel(), generator=g)[:k].to(valid.device)]
            for n in trainer.isopo_coverage["covered"]}


SETTINGS = [
    pytest.param(dict(p=-1.0, q=0.0, r=0.0, reg=0.0), id="p=-1,c=0"),
    pytest.param(dict(p=-1.0, q=0.0, r=0.0, reg=1.0), id="p=-1,c=1"),
    pytest.param(dict(p=0.0, q=-1.0, r=0.0, reg=1.0), id="q=-1,c=1"),
    pytest.param(dict(p=0.0, q=-1.0, r=-2.0, reg=0.0), id="p=0,q=-1,r=-2,c=0"),
]


def check_isopo_matches_oracle(setup, knobs, sample_mode, route, tol=tol):
    """The trainer's gradients of every trainable parameter for one setting, route and Fisher sample vs the oracle
    (`tol(name)`: the tolerance of parameter `name`)."""
    trainer, inputs, data = setup
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
        w, _ = dense_weights(data["V"][n], data["X"][n], data["G"][n], samples[n], A, knobs["p"], knobs["q"], knobs["r"], knobs["reg"], mus[n], n_step=len(A))
        expected[n] = w
    # The trainer's regularizer sees the statistics times the loss normalizer (bnpo, GA = 1: the completion tokens),
    # so the EMA history is stored in those units: e and f scale with it, rho does not.
    n_tok = float(inputs["completion_mask"].sum())
    units = {"e": n_tok**2, "f": n_tok**2, "rho": 1.0}
    ema = {f"{n}/{k}": v * units[k] for n, d in mus.items() for k, v in d.items()}
    got = isopo_grads_fixed(trainer, inputs, samples, ema)
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


def check_interacting_matches_dense_solve(setup):
    """The interacting variant's layer gradients, both routes, vs lam (K + lam I)^-1 A by a dense solve."""
    trainer, inputs, data = setup
    ctx = trainer.isopo_backward
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
            alpha = lams[n] * torch.linalg.solve(K + lams[n] * torch.eye(len(A), dtype=K.dtype, device=K.device), A)
            assert rel_err(got[f"{n}.weight"], torch.einsum("b,boi->oi", alpha, V)) < TOL, (route, n)
