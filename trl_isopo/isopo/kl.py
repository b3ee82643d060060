"""The KL-to-reference term (`beta > 0`) of ISOPOTrainer, added as an ordinary gradient.

Per token, exactly as TRL 1.16's `GRPOTrainer._compute_loss` with beta > 0 (`grpo_terms.k3_per_token`), normalized
like the loss_type.

Design (docs/isopo.md, "KL to a reference model"): the covered layers rebuild their weight gradient from the backward
seed, so the KL seed must not reach them in the same pass. Its gradient is taken right after the forward by
`torch.autograd.grad(..., retain_graph=True)` over the same graph while the backward object's `plain()` mode makes
every ISOPO backward function ordinary; no second forward. The result is held (one gradient-sized buffer) and added to
each parameter's gradient by a one-shot hook when the policy-loss backward reaches it: before gradient accumulation
and DDP's all-reduce, so both see one ordinary gradient. `autograd.grad` accumulates nothing into `.grad`, so DDP's
reducer sees exactly one backward pass.
"""

from __future__ import annotations

import torch


class KLGradients:
    """The KL gradients of the current micro-batch (with the entropy bonus and router aux loss, when on, in the same
    pass), held until the policy-loss backward reaches their parameters."""

    def __init__(self):
        self.pending: list = []  # (parameter, KL gradient, hook handle, [fired])

    def take(self, kl_loss: torch.Tensor, params: list[torch.Tensor], backward) -> None:
        """Compute d kl_loss / d params in `backward`'s plain mode (the graph retained) and hold them as hooks."""
        with backward.plain():
            grads = torch.autograd.grad(kl_loss, params, retain_graph=True, allow_unused=True)
        for p, g in zip(params, grads):
            if g is not None:
                self._hook(p, g)

    def _hook(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        fired = [False]

        def hook(incoming):
            if fired[0]:
                return incoming
            fired[0] = True
            return incoming + grad.to(incoming.dtype)

        self.pending.append((param, grad, param.register_hook(hook), fired))

    def flush(self) -> int:
        """Remove this micro-batch's hooks; a parameter the policy backward never reached gets its KL gradient added
        to `.grad` directly. Returns how many did (under DDP that part misses the all-reduce: the caller warns)."""
        missed = 0
        for param, grad, handle, fired in self.pending:
            handle.remove()
            if not fired[0]:
                missed += 1
                g = grad.to(param.dtype)
                param.grad = g.clone() if param.grad is None else param.grad.add_(g)
        self.pending.clear()
        return missed
