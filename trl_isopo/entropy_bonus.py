"""GRPOConfig's entropy bonus (`entropy_coef`, `use_adaptive_entropy`) for trainers that replace
`GRPOTrainer._compute_loss`, with TRL 1.16's definition.

TRL defines the bonus independently of the loss type: the objective is L - c * H, H the mean per-token entropy of the
policy over the tokens the policy loss acts on (completion tokens, times the high-entropy mask when
`top_entropy_quantile < 1`) of one micro-batch, divided only by the gradient accumulation steps. With
`use_adaptive_entropy`, c is applied only while the entropy measured over the previous optimizer step (all
micro-batches and processes, token-weighted) is <= `entropy_target`, and c moves by `entropy_coef_delta` within
[`entropy_coef_min`, `entropy_coef_max`] at each optimizer step (up below the target, down above it).

The controller's state stays on the trainer where GRPOTrainer keeps it (`entropy_coef` and the state behind
`compat.entropy_controller_state`), so GRPOTrainer's checkpoint saving and resuming of that state keep working.
"""

from __future__ import annotations

import torch

from .compat import entropy_controller_state, set_entropy_controller_state

__all__ = ["entropy_bonus_enabled", "entropy_bonus_term"]


def entropy_bonus_enabled(args) -> bool:
    """Whether `args` (a GRPOConfig) asks for an entropy bonus."""
    return args.entropy_coef != 0.0 or bool(args.use_adaptive_entropy)


def entropy_bonus_term(trainer, entropies: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """The term to add to the micro-batch's loss, `-c * H / accumulation`, and the controller's update.

    Call once per micro-batch on every process (the update reduces across processes at optimizer-step boundaries).

    Args:
        trainer: a GRPOTrainer subclass (reads `args`, `accelerator`, `current_gradient_accumulation_steps`,
            `_metrics`; updates the controller state named in the module docstring).
        entropies: `(B, T)` per-token entropies of the policy, differentiable.
        mask: `(B, T)` the tokens the bonus acts on (0/1 or bool).
        mode: "train" or "eval" (eval neither accumulates nor updates the controller).

    Returns:
        0-dim tensor in the dtype of `entropies`; its gradient is that of `-c * H / accumulation`.
    """
    m = mask.to(entropies.dtype)
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    mean_entropy = (entropies * m).sum() / m.sum().clamp(min=1.0)
    args = trainer.args
    # The coefficient and gate fixed at the end of the previous optimizer step: every micro-batch of this step
    # applies the same bonus.
    coef = trainer.entropy_coef
    last_world_entropy, window = entropy_controller_state(trainer)
    if args.use_adaptive_entropy and last_world_entropy > args.entropy_target:
        coef = 0.0
    term = -coef * mean_entropy / accumulation
    if args.use_adaptive_entropy and mode == "train":
        stats = torch.stack([(entropies * m).sum(), m.sum()]).detach()
        window = stats if window is None else window + stats
        if trainer.accelerator.sync_gradients:
            total = trainer.accelerator.reduce(window, reduction="sum")
            world_entropy = (total[0] / total[1].clamp(min=1.0)).item()
            if world_entropy <= args.entropy_target:
                trainer.entropy_coef = min(trainer.entropy_coef + args.entropy_coef_delta, args.entropy_coef_max)
            else:
                trainer.entropy_coef = max(trainer.entropy_coef - args.entropy_coef_delta, args.entropy_coef_min)
            last_world_entropy, window = world_entropy, None
        set_entropy_controller_state(trainer, last_world_entropy, window)
    if mode == "train" and trainer.accelerator.sync_gradients:
        trainer._metrics[mode]["entropy_coef"].append(trainer.entropy_coef)
    return term
