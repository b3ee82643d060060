"""The terms GRPO adds to its policy loss, with TRL 1.16's definitions, for the trainers that write their own loss
(ISOPO's and PROMA's surrogate, TPO): the k3 KL to the reference model (`beta > 0`), the entropy bonus
(`entropy_coef`, `use_adaptive_entropy`) and the MoE router's aux loss.

k3, per token: exp(ref - logp) - (ref - logp) - 1, times exp(logp - old) with `use_bias_correction_kl` (old: the
rollout's log-probs, or sg(logp), value 1, when TRL skipped them).

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

__all__ = ["aux_loss_term", "entropy_bonus_enabled", "entropy_bonus_term", "k3_per_token"]


def k3_per_token(logps: torch.Tensor, ref: torch.Tensor, old: torch.Tensor | None, bias_correction: bool,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, C) TRL's k3 estimate of KL(pi || ref) per token from the policy's, the reference's and (with
    `bias_correction`) the rollout's per-token log-probs, each (B, C); old None: sg(logps). With a bool `mask` (B, C)
    the masked-out tokens are 0 and never pass through exp (padding may hold any log-prob)."""
    if mask is None:
        per_token = torch.exp(ref - logps) - (ref - logps) - 1  # TRL's expression, operation for operation
    else:
        diff = torch.where(mask, ref - logps, torch.zeros_like(logps))
        per_token = torch.exp(diff) - diff - 1
    if bias_correction:
        log_ratio = logps - (logps.detach() if old is None else old)
        if mask is not None:
            log_ratio = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
        per_token = per_token * torch.exp(log_ratio)
    if mask is not None:
        per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    return per_token


def aux_loss_term(trainer, aux: torch.Tensor, mode: str) -> torch.Tensor:
    """`router_aux_loss_coef * aux / accumulation`, the MoE router's load-balancing loss as GRPO adds it, and GRPO's
    "aux_loss" metric (a gather: call on every process)."""
    accumulation = trainer.current_gradient_accumulation_steps if mode == "train" else 1.0
    trainer._metrics[mode]["aux_loss"].append(trainer.accelerator.gather_for_metrics(aux.detach()).mean().item())
    return trainer.router_aux_loss_coef * aux / accumulation


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
