"""What the parameters outside the covered linear layers receive (`isopo_other_params`).

The single backward pass is advantage-free, so without intervention embeddings, norm weights and the LM head would get
the gradient of -sum log pi (the reference's behaviour, "surrogate"). For "advantage_weighted" (the ordinary
REINFORCE gradient, sum_i A_i grad(-log pi_i)), each sequence's contribution to *their weight gradients* is scaled by
A_i while the gradient passed on to lower layers stays advantage-free:

- a leaf module with trainable parameters, y = f(x; theta), is run as
  y = f(x; theta) + RowScale(f(sg x; theta) - sg f(sg x; theta), A - 1)
  (value unchanged, d/dx unscaled, d/dtheta scaled by A per row); if no input needs a gradient (an embedding lookup)
  a single call y = RowScale(f(x; theta), A) suffices;
- TRL's fused log-prob head reads `lm_head.weight` directly inside `ChunkedLogProbFunction`, so during the ISOPO
  window that kernel is replaced by `fused_head.RowScaledChunkedLogProb`: same outputs and hidden-state gradient,
  weight/bias gradient with each token row scaled by its sequence's A, in one pass of tile recomputation.
"""

from __future__ import annotations

import contextlib
import types

import torch
import torch.nn as nn

from .fused_head import RowScaledChunkedLogProb
from .plain import plain_backward_active

OTHER_PARAMS_MODES = ("advantage_weighted", "surrogate", "frozen")


class RowScale(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient of row b (dim 0) by scale[b]. y: (B, ...), scale: (B,).

    Inside `plain.plain_backward()` (the KL term's ordinary gradient) the gradient is multiplied by the constant
    `plain` instead: 1 where the row-scaled branch is the module's only output, 0 for the correction branch
    y_theta - sg(y_theta), so that the parameter receives its ordinary gradient exactly once.
    """

    @staticmethod
    def forward(ctx, y, scale, plain: float = 1.0):
        ctx.save_for_backward(scale)
        ctx.plain = plain
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        if plain_backward_active():
            return (g if ctx.plain == 1.0 else g * ctx.plain), None, None
        (scale,) = ctx.saved_tensors
        return g * scale.to(g.dtype).view(-1, *([1] * (g.dim() - 1))), None, None


def _detach_tree(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detach_tree(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _detach_tree(v) for k, v in obj.items()}
    return obj


def _needs_grad(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.requires_grad
    if isinstance(obj, (list, tuple)):
        return any(_needs_grad(o) for o in obj)
    if isinstance(obj, dict):
        return any(_needs_grad(v) for v in obj.values())
    return False


def _rows(y: torch.Tensor, batch: int, name: str) -> torch.Tensor:
    if not isinstance(y, torch.Tensor):
        raise RuntimeError(
            f"isopo_other_params='advantage_weighted' needs module {name} to return one tensor with a batch "
            f"dimension; it returned {type(y).__name__}. Use isopo_other_params='surrogate' or 'frozen'."
        )
    if y.shape[0] == batch:
        return y
    if y.shape[0] == 1:  # shared over the batch (e.g. learned positions): expand so each row's grad is separable
        return y.expand(batch, *y.shape[1:])
    raise RuntimeError(
        f"isopo_other_params='advantage_weighted': module {name} returned shape {tuple(y.shape)}, whose first "
        f"dimension is not the micro-batch size {batch}, so its gradient cannot be split by sequence. Use "
        "isopo_other_params='surrogate' or 'frozen'."
    )


def _advantage_weighted_forward(self, *args, **kwargs):
    y = self._isopo_orig_forward(*args, **kwargs)
    context = self._isopo_context
    mb = context.micro_batch
    if not (context.active and mb is not None and torch.is_grad_enabled()):
        return y
    A = mb.advantages.to(device=y.device)
    y = _rows(y, A.shape[0], self._isopo_name)
    if not _needs_grad((args, kwargs)):
        return RowScale.apply(y, A)
    y_theta = _rows(self._isopo_orig_forward(*_detach_tree(args), **_detach_tree(kwargs)), A.shape[0], self._isopo_name)
    return y + RowScale.apply(y_theta - y_theta.detach(), A - 1, 0.0)


def other_trainable_modules(model: nn.Module, covered: set[int], head: nn.Module | None) -> list[tuple[str, nn.Module]]:
    """Modules owning trainable parameters (directly) that are neither covered linears nor the LM head."""
    found = []
    for name, module in model.named_modules():
        if id(module) in covered or module is head:
            continue
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            found.append((name, module))
    return found


def install_advantage_weighting(modules: list[tuple[str, nn.Module]], context) -> None:
    for name, module in modules:
        if any(True for _ in module.children()) and any(p.requires_grad for p in module.parameters(recurse=False)):
            raise ValueError(
                f"isopo_other_params='advantage_weighted' supports leaf modules only; {name} "
                f"({type(module).__name__}) owns trainable parameters and has sub-modules. Freeze its parameters or "
                "use isopo_other_params='surrogate'."
            )
        module._isopo_orig_forward = module.forward
        module._isopo_context = context
        module._isopo_name = name
        module.forward = types.MethodType(_advantage_weighted_forward, module)


def uninstall_advantage_weighting(modules: list[tuple[str, nn.Module]]) -> None:
    for _, module in modules:
        if hasattr(module, "_isopo_orig_forward"):
            del module.forward
            del module._isopo_orig_forward


def scored_positions(mb) -> torch.Tensor:
    """(B, L-1) bool: the shifted positions the fused head scores, i.e. valid labels among the last C = logits_to_keep
    positions. In TRL's compact layout (Triton devices) the kernel's rows are these positions, row-major."""
    L = mb.mask.shape[1]
    valid = mb.mask[:, 1:].clone()
    valid[:, : L - 1 - mb.logits_to_keep] = False
    return valid


def head_row_values(n_rows: int, mb, A: torch.Tensor) -> torch.Tensor:
    """Per-sequence values A (B,) spread over the fused head's token rows (n_rows,): all B*(L-1) shifted positions,
    or only the scored ones."""
    B, L = mb.mask.shape
    if n_rows == B * (L - 1):
        return A.repeat_interleave(L - 1)
    # Compact layout (Triton devices): rows are positions whose shifted label is valid (see add_fused_lm_head), in
    # row-major order, so row r belongs to the first sequence whose running count of such positions exceeds r.
    # Without a host read (no boolean indexing, no count check on the host): the count is checked on the device.
    ends = scored_positions(mb).sum(1).cumsum(0)  # (B,)
    torch._assert_async(ends[-1] == n_rows, f"cannot map {n_rows} fused-head rows to the micro-batch's {B} sequences")
    seq = torch.searchsorted(ends, torch.arange(n_rows, device=ends.device), right=True)
    return A.index_select(0, seq.clamp_max(B - 1))


class _AdvantageWeightedHead:
    """Stand-in for TRL's ChunkedLogProbFunction during the ISOPO window (only `.apply` is used by TRL): rows scaled
    by their sequence's advantage, or with `isopo` (an `head.ISOPOHead`) by the head's own ISOPO coefficients."""

    def __init__(self, original, context, isopo=None):
        self.original, self.context, self.isopo = original, context, isopo

    def apply(self, hidden, weight, bias, targets, *rest):
        mb = self.context.micro_batch
        trainable = weight.requires_grad or (bias is not None and bias.requires_grad)
        if not (self.context.active and mb is not None and trainable and torch.is_grad_enabled()):
            return self.original.apply(hidden, weight, bias, targets, *rest)
        if self.isopo is not None:
            return RowScaledChunkedLogProb.apply(hidden, weight, bias, targets, self.isopo, *rest)
        scale = head_row_values(hidden.shape[0], mb, mb.advantages).to(device=hidden.device, dtype=torch.float32)
        return RowScaledChunkedLogProb.apply(hidden, weight, bias, targets, scale, *rest)


@contextlib.contextmanager
def advantage_weighted_head(context, isopo=None):
    """Swap TRL's fused log-prob kernel for the advantage-weighted (or, with `isopo`, ISOPO) stand-in (restored on
    exit)."""
    import trl.trainer.utils as trl_utils

    original = trl_utils._ChunkedLogProbFunction
    trl_utils._ChunkedLogProbFunction = _AdvantageWeightedHead(original, context, isopo)
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction = original
