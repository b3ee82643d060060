"""What the parameters outside the covered linear layers receive (`isopo_other_params`).

The single backward pass is advantage-free, so without intervention embeddings, norm weights and the LM head would get
the gradient of -sum log pi (the reference's behaviour, "surrogate"). For "advantage_weighted" (the ordinary
REINFORCE gradient, sum_i A_i grad(-log pi_i)), each sequence's contribution to *their weight gradients* is scaled by
A_i while the gradient passed on to lower layers stays advantage-free:

- a leaf module with trainable parameters, y = f(x; theta), is run as
  y = f(x; theta) + RowScale(f(sg x; theta) - sg f(sg x; theta), A - 1)
  (value unchanged, d/dx unscaled, d/dtheta scaled by A per row); if no input needs a gradient (an embedding lookup)
  a single call y = RowScale(f(x; theta), A) suffices. A row is a sequence, or one of its tokens where the module
  sees the (B, L) positions flattened (MoE routers and experts: the token's sequence's A); each tensor of a tuple
  output that carries a gradient is treated alike;
- the LM head, whose weight TRL's fused log-prob kernel reads directly, is handled in `head/` (the kernel with a
  per-row scale on the weight gradient, `head/kernel.py`, swapped in by `head/interception.py`).

The replaced forwards are installed and removed by the backward object (`engine.LayerBackward.install`), and
scale only inside its micro-batch window.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from .rule import MethodName

OTHER_PARAMS_MODES = ("advantage_weighted", "surrogate", "frozen")


class RowScale(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient of row b (dim 0) by scale[b]. y: (B, ...), scale: (B,).

    Inside the `plain()` mode of `owner` (an `engine.LayerBackward`; the KL term's ordinary gradient) the gradient
    is multiplied by the constant `plain` instead: 1 where the row-scaled branch is the module's only output, 0 for
    the correction branch y_theta - sg(y_theta), so that the parameter receives its ordinary gradient exactly once.
    """

    @staticmethod
    def forward(ctx, y, scale, plain: float = 1.0, owner=None):
        ctx.save_for_backward(scale)
        ctx.plain, ctx.owner = plain, owner
        return y.view_as(y)

    @staticmethod
    def backward(ctx, g):
        if ctx.owner is not None and ctx.owner.plain_active:
            return (g if ctx.plain == 1.0 else g * ctx.plain), None, None, None
        (scale,) = ctx.saved_tensors
        return g * scale.to(g.dtype).view(-1, *([1] * (g.dim() - 1))), None, None, None


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


def _row_scale(
    y: torch.Tensor, A: torch.Tensor, length: int, name: str, flag: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, per-row scale): rows are sequences (first dim B), or the B * L tokens of a module that flattens its
    (B, L) input in row-major order (MoE experts and routers), scaled by their sequence's A. `flag`: the method's
    `*_other_params` field, named in the error."""
    batch = A.shape[0]
    if y.shape[0] == batch:
        return y, A
    if y.shape[0] == 1:  # shared over the batch (e.g. learned positions): expand so each row's grad is separable
        return y.expand(batch, *y.shape[1:]), A
    if y.shape[0] == batch * length:
        return y, A.repeat_interleave(length)
    raise RuntimeError(
        f"{flag}='advantage_weighted': module {name} returned shape {tuple(y.shape)}, whose first "
        f"dimension is neither the micro-batch size {batch} nor its {batch * length} tokens, so its gradient cannot "
        f"be split by sequence. Use {flag}='surrogate' or 'frozen'."
    )


def _outputs(y, name: str, flag: str) -> tuple:
    """The module's output as a tuple of tensors (one tensor, or a tuple/list of them, e.g. a router's logits,
    weights and indices)."""
    items = tuple(y) if isinstance(y, (tuple, list)) else (y,)
    if not items or not all(isinstance(t, torch.Tensor) for t in items):
        raise RuntimeError(
            f"{flag}='advantage_weighted' needs module {name} to return tensors with a batch (or token) "
            f"dimension; it returned {type(y).__name__}. Use {flag}='surrogate' or 'frozen'."
        )
    return items


def _repack(y, items: list):
    return items[0] if isinstance(y, torch.Tensor) else type(y)(items)


def advantage_weighted_forward(original, name: str, owner):
    """The forward of an advantage-weighted leaf module: `original` unchanged outside `owner`'s micro-batch window
    (or without gradients); inside it, the module docstring's construction with A = the window's advantages.
    A `functools.partial` (not a closure): a deep copy of the model rebinds it to the copied module."""
    return functools.partial(_advantage_weighted_forward, original, name, owner)


def _advantage_weighted_forward(original, name: str, owner, *args, **kwargs):
    y = original(*args, **kwargs)
    mb = owner.current
    if mb is None or not torch.is_grad_enabled():
        return y
    flag = owner.method.field("other_params")
    items = _outputs(y, name, flag)
    A = mb.advantages.to(device=items[0].device)
    length = mb.mask.shape[1]
    if not _needs_grad((args, kwargs)):
        out = []
        for t in items:  # outputs without a gradient (e.g. routing indices) pass through
            if t.requires_grad:
                t, scale = _row_scale(t, A, length, name, flag)
                t = RowScale.apply(t, scale, 1.0, owner)
            out.append(t)
        return _repack(y, out)
    thetas = _outputs(original(*_detach_tree(args), **_detach_tree(kwargs)), name, flag)
    out = []
    for t, t_theta in zip(items, thetas):
        if t_theta.requires_grad:
            t, scale = _row_scale(t, A, length, name, flag)
            t_theta, _ = _row_scale(t_theta, A, length, name, flag)
            t = t + RowScale.apply(t_theta - t_theta.detach(), scale - 1, 0.0, owner)
        out.append(t)
    return _repack(y, out)


def check_leaf_module(name: str, module: nn.Module, method: MethodName) -> None:
    """Advantage weighting supports modules whose sub-modules hold no trainable parameters (a parent's forward would
    scale its children's gradients a second time); parameter-free children such as an activation are fine."""
    own = any(p.requires_grad for p in module.parameters(recurse=False))
    if own and any(p.requires_grad for child in module.children() for p in child.parameters()):
        raise ValueError(
            f"{method.field('other_params')}='advantage_weighted' supports leaf modules only; {name} "
            f"({type(module).__name__}) owns trainable parameters and has sub-modules that do too. Freeze its "
            f"parameters or use {method.field('other_params')}='surrogate'."
        )


def other_trainable_modules(model: nn.Module, covered: set[int], head: nn.Module | None) -> list[tuple[str, nn.Module]]:
    """Modules owning trainable parameters (directly) that are neither covered linears nor the LM head."""
    found = []
    for name, module in model.named_modules():
        if id(module) in covered or module is head:
            continue
        if any(p.requires_grad for p in module.parameters(recurse=False)):
            found.append((name, module))
    return found
