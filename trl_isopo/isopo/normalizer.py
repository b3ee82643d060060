"""The loss normalizer n_i of ISOPO's backward seed: d(loss)/d(log pi_it) = -mask_it / n_i for GRPO's loss with
advantages 1 and ratio 1 (`MicroBatch.stat_scale`)."""

from __future__ import annotations

import torch


def loss_normalizer(
    loss_type: str,
    mask: torch.Tensor,
    *,
    accumulation: float,
    max_completion_length: int,
    num_items_in_batch: torch.Tensor | None,
    num_processes: int,
    steps_per_generation: int | None,
) -> torch.Tensor:
    """(B,) n_i for the completion mask (B, C), mirroring TRL 1.16 `GRPOTrainer._compute_loss`'s normalization of each
    supported loss_type (a test checks it against autograd of that loss): bnpo: the micro-batch's completion tokens x
    GA; grpo: the sequence's own tokens x B x GA; dr_grpo: B x max_completion_length x GA; dapo: the accumulation
    window's tokens per process (`num_items_in_batch` / processes, x GA / `steps_per_generation` in training).
    accumulation: GA in training, 1 in evaluation; steps_per_generation: None in evaluation.
    """
    B = mask.shape[0]
    ga = float(accumulation)
    mask = mask.to(torch.float64)
    if loss_type == "grpo":
        return mask.sum(-1).clamp(min=1.0) * (B * ga)
    if loss_type == "bnpo":
        n = mask.sum().clamp(min=1.0) * ga
    elif loss_type == "dr_grpo":
        n = torch.tensor(float(B * max_completion_length) * ga, dtype=torch.float64, device=mask.device)
    elif loss_type == "dapo":
        n = num_items_in_batch.to(torch.float64).clamp(min=1.0) / num_processes
        if steps_per_generation is not None:
            n = n * accumulation / steps_per_generation
    else:  # pragma: no cover - rejected by ISOPOConfig
        raise ValueError(f"unsupported loss_type {loss_type!r}")
    return n.to(mask.device).expand(B)
