"""The KL-to-reference oracle of the ISOPO tests (tests/test_isopo_kl.py, tests/test_isopo_entropy.py): ISOPO's
gradients of one batch, plain autograd of beta * TRL's k3 term, and a batch with reference log-probs."""

import torch
from isopo_oracle import surrogate_logps

BETA = 0.3


def isopo_grads(trainer, inputs):
    trainer.model.zero_grad(set_to_none=True)
    with trainer.isopo_active():
        loss = trainer.compute_loss(trainer.model, inputs)
        loss.backward()
    assert not trainer._surrogate_kl.pending and not trainer.isopo_backward.plain_active
    return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def kl_oracle(trainer, inputs, beta, bias_correction):
    """Plain autograd (outside the ISOPO window) of beta * k3, normalized like bnpo (GA = 1), as in GRPO's loss."""
    params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    logps = surrogate_logps(trainer, inputs)
    ref = inputs["ref_per_token_logps"]
    kl = torch.exp(ref - logps) - (ref - logps) - 1
    if bias_correction:
        kl = kl * torch.exp(logps - logps.detach())
    mask = inputs["completion_mask"].to(kl.dtype)
    loss = beta * (kl * mask).sum() / mask.sum()
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return {n: g for n, g in zip(params, grads) if g is not None}, float((kl.detach() * mask).sum() / mask.sum())


def with_reference(trainer, inputs, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logps = surrogate_logps(trainer, inputs)
    out = dict(inputs)
    out["ref_per_token_logps"] = (logps + 0.3 * torch.randn(logps.shape, generator=g, dtype=logps.dtype)).detach()
    return out
