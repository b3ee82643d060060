"""From reward functions to TPO's standardized scores u, for each of GRPOConfig's reward-scaling options.

Pure tensor functions. The paper (arXiv 2604.06159 §2 and App. A) standardizes the weighted sum of the rewards
within each group with the *population* std and no epsilon; a group whose std is <= 1e-6 gets its centred scores
(exactly 0 for a constant group). GRPOConfig's `scale_rewards` and `multi_objective_aggregation` are given a TPO
meaning that keeps those rules (docs/tpo.md, "GRPOConfig fields"):

- `scale_rewards="group"` (default): u = (s - mean_g) / std_g, the paper.
- `scale_rewards="none"`: u = s - mean_g. The reward's own units set the target's sharpness (q ~ p_old exp((s -
  mean_g) / eta)); a group with a tiny spread is no longer blown up to unit variance (arXiv 2604.06159 §6, limitations).
- `scale_rewards="batch"`: u = (s - mean_g) / std_B with std_B the population std of the scores of the whole
  generation batch (all processes); centred scores if std_B <= 1e-6.
- `multi_objective_aggregation="normalize_then_sum"`: each reward function is first standardized within the group
  by the same rule, then weighted and summed; `scale_rewards` then applies to that sum.
"""

from __future__ import annotations

import torch

from .target import ZERO_STD_THRESHOLD, standardize_group_scores

__all__ = ["SCALE_REWARDS", "AGGREGATIONS", "combine_rewards", "batch_population_std", "scores_to_u"]

SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


def combine_rewards(
    rewards_per_func: torch.Tensor,
    weights: torch.Tensor,
    group_size: int,
    aggregation: str = "sum_then_normalize",
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """The score s of each completion from its rewards.

    A NaN reward (the function returned None) counts as 0 in the sum, as in TRL; a row where every function returned
    None, or with an infinite reward, is unscorable and gets s = NaN. With "normalize_then_sum", each function's
    rewards are standardized within the group first (population std, 1e-6 rule), over the rows that are `valid` and
    have a finite reward for it.

    Args:
        rewards_per_func: `(N, F)` rewards, N a multiple of `group_size` (whole groups, K consecutive rows each).
        weights: `(F,)` reward weights.
        group_size: K.
        aggregation: "sum_then_normalize" or "normalize_then_sum".
        valid: optional `(N,)` bool, rows that take part in the group statistics (e.g. non-empty completions).

    Returns:
        `(N,)` scores in at least float32, NaN for unscorable rows.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    dtype = torch.promote_types(rewards_per_func.dtype, torch.float32)
    r = rewards_per_func.to(dtype)
    finite = torch.isfinite(r)
    unscorable = torch.isnan(r).all(dim=1) | torch.isinf(r).any(dim=1)
    if aggregation == "normalize_then_sum":
        n, f = r.shape
        rows_ok = torch.ones(n, dtype=torch.bool, device=r.device) if valid is None else valid.to(r.device).bool()
        keep = (finite & rows_ok[:, None]).T.reshape(f, -1, group_size)  # (F, G, K)
        z = standardize_group_scores(r.T.reshape(f, -1, group_size), keep)  # invalid entries get 0
        r = z.reshape(f, n).T
        finite = keep.reshape(f, n).T
    w = weights.to(device=r.device, dtype=dtype)
    scores = torch.where(finite, r * w, torch.zeros((), dtype=dtype, device=r.device)).sum(dim=1)
    return scores.masked_fill(unscorable, float("nan"))


def batch_population_std(scores: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Population std (divide by the count, no epsilon) of the finite, valid entries of `scores` (any shape);
    0 when there are none."""
    s = scores.reshape(-1).to(torch.promote_types(scores.dtype, torch.float32))
    v = torch.isfinite(s)
    if valid is not None:
        v = v & valid.reshape(-1).to(s.device).bool()
    n = v.sum().clamp(min=1).to(s.dtype)
    s0 = torch.where(v, s, torch.zeros((), dtype=s.dtype, device=s.device))
    mean = s0.sum() / n
    centred = torch.where(v, s0 - mean, torch.zeros((), dtype=s.dtype, device=s.device))
    return torch.sqrt((centred * centred).sum() / n)


def scores_to_u(
    scores: torch.Tensor,
    valid: torch.Tensor | None = None,
    scale_rewards: str = "group",
    batch_std: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """u and the group's population std (for the zero-variance metric) for one `scale_rewards` option.

    Args:
        scores: `(..., K)` raw scores, one group per last-dim slice.
        valid: optional `(..., K)` bool mask (invalid and non-finite members get u = 0 and stay out of the stats).
        scale_rewards: "group", "batch" or "none" (module docstring).
        batch_std: for "batch", the batch std (a scalar or a tensor broadcasting to `scores`, e.g. one value per row).

    Returns:
        (u `(..., K)`, group std `(...,)`), in at least float32.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    u, std = standardize_group_scores(scores, valid, return_std=True)
    if scale_rewards == "group":
        return u, std
    # The centred scores: with an infinite threshold every group counts as zero-variance, so the rule returns them.
    centred = standardize_group_scores(scores, valid, zero_std_threshold=float("inf"))
    if scale_rewards == "none":
        return centred, std
    if batch_std is None:
        raise ValueError('scale_rewards="batch" needs the batch std')
    b = torch.as_tensor(batch_std, dtype=centred.dtype, device=centred.device)
    ok = b > ZERO_STD_THRESHOLD
    return torch.where(ok, centred / torch.where(ok, b, torch.ones_like(b)), centred), std
