"""Pure tensor math of Target Policy Optimization (TPO, arXiv 2604.06159).

No trainer imports: every function maps tensors to tensors. Groups are laid out as the last dimension, so a batch of
`G` groups of `K` completions is a `(G, K)` tensor (any leading shape works for the group-wise functions).

For one group with sequence log-probs `l_i = log pi(y_i | x)`, scores `s_i` and temperature `eta`:

    u       = standardize(s)                         population std, no epsilon; std <= 1e-6 -> centred scores
    q       = softmax(log_softmax(l_old) + u / eta)  the target (anchor); no-anchor ablation: softmax(u / eta)
    p_theta = softmax(l_theta)
    L       = -sum_i q_i log p_theta_i               dL/dl_theta = p_theta - q  (sum(q) = 1)

Invalid members (unscorable or empty completions) are excluded from every group statistic and from both softmaxes;
they get `q = 0`, `u = 0` and zero gradient. A group without a valid member gives `q = 0`, loss 0 and no NaN.
All math runs in at least float32 (bf16/fp16 inputs are upcast); float64 inputs stay float64.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "ZERO_STD_THRESHOLD",
    "sequence_logps",
    "standardize_group_scores",
    "tpo_target",
    "tpo_loss",
    "tpo_row_coefficients",
    "tpo_group_stats",
]

# The TPO paper's rule (arXiv 2604.06159 App. A, and its reference code): a group whose population std is <= this is
# "zero variance" (its standardized scores are u = 0).
ZERO_STD_THRESHOLD = 1e-6


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        if t is not None and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def _valid_mask(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    if valid is None:
        return torch.ones_like(x, dtype=torch.bool)
    if valid.shape != x.shape:
        raise ValueError(f"valid mask shape {tuple(valid.shape)} does not match {tuple(x.shape)}")
    return valid.to(device=x.device, dtype=torch.bool)


def sequence_logps(
    per_token_logps: torch.Tensor, mask: torch.Tensor, length_normalize: bool = False
) -> torch.Tensor:
    """Sequence log-probabilities from per-token log-probabilities.

    Args:
        per_token_logps: `(B, T)` log pi(y_t | x, y_<t); values at masked positions are ignored (even inf/NaN).
        mask: `(B, T)` 1 for completion tokens that belong to the sequence, 0 for padding / tool tokens.
        length_normalize: False (paper, eq. 3): the sum over tokens. True: the per-token mean (sum / number of tokens).

    Returns:
        `(B,)` in at least float32. Rows without tokens give 0 (mark them invalid downstream).
    """
    dtype = _compute_dtype(per_token_logps)
    m = mask.to(device=per_token_logps.device).bool()
    x = torch.where(m, per_token_logps.to(dtype), torch.zeros((), dtype=dtype, device=per_token_logps.device))
    total = x.sum(-1)
    if length_normalize:
        total = total / m.sum(-1).clamp(min=1).to(dtype)
    return total


def standardize_group_scores(
    scores: torch.Tensor,
    valid: torch.Tensor | None = None,
    zero_std_threshold: float = ZERO_STD_THRESHOLD,
    return_std: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Within-group standardization u = (s - mean) / std with the paper's rules.

    Population std (divide by the number of valid members), no epsilon. If std <= `zero_std_threshold` the centred
    scores are returned (exactly 0 for a constant group). Invalid members (`valid == False`, or non-finite scores)
    are left out of the mean and std and get u = 0.

    Args:
        scores: `(..., K)` raw scores, one group per last-dim slice.
        valid: optional `(..., K)` bool mask.
        zero_std_threshold: std at or below which a group counts as zero-variance.
        return_std: also return the `(...,)` population std over the valid members (0 for an empty group).

    Returns:
        `(..., K)` standardized scores in at least float32 (and the std if `return_std`).
    """
    dtype = _compute_dtype(scores)
    s = scores.to(dtype)
    v = _valid_mask(s, valid) & torch.isfinite(s)
    zero = torch.zeros((), dtype=dtype, device=s.device)
    s0 = torch.where(v, s, zero)
    n = v.sum(-1, keepdim=True).clamp(min=1).to(dtype)
    mean = s0.sum(-1, keepdim=True) / n
    centred = torch.where(v, s0 - mean, zero)
    std = torch.sqrt((centred * centred).sum(-1, keepdim=True) / n)
    informative = std > zero_std_threshold
    u = torch.where(informative, centred / torch.where(informative, std, torch.ones_like(std)), centred)
    if return_std:
        return u, std.squeeze(-1)
    return u


def _masked_fill_value(dtype: torch.dtype) -> float:
    # Finite (not -inf): an all-invalid row then gives a finite log_softmax and finite (zero) gradients.
    return torch.finfo(dtype).min


def tpo_target(
    old_logps: torch.Tensor | None,
    u: torch.Tensor,
    valid: torch.Tensor | None = None,
    eta: float = 1.0,
    anchor: bool = True,
) -> torch.Tensor:
    """The TPO target q = softmax(log p_old + u / eta) over each group (no gradient flows through it).

    Args:
        old_logps: `(..., K)` sequence log-probs under the rollout-time policy (any per-group constant cancels); may
            be None when `anchor=False`.
        u: `(..., K)` standardized scores.
        valid: optional `(..., K)` bool mask; invalid members get q = 0 and are left out of the normalisation.
        eta: target temperature, > 0 (float('inf') gives q = p_old).
        anchor: False gives the paper's TPO-no-anchor ablation q = softmax(u / eta).

    Returns:
        `(..., K)` detached target, rows sum to 1 (0 for a group without valid members), in at least float32.
    """
    if not (isinstance(eta, (int, float)) and eta > 0) or math.isnan(eta):
        raise ValueError(f"eta must be > 0, got {eta!r}")
    if anchor and old_logps is None:
        raise ValueError("old_logps is required when anchor=True")
    dtype = _compute_dtype(u, old_logps) if anchor else _compute_dtype(u)
    u = u.detach().to(dtype)
    v = _valid_mask(u, valid)
    logits = u / eta if math.isfinite(eta) else torch.zeros_like(u)
    if anchor:
        lo = old_logps.detach().to(device=u.device, dtype=dtype)
        v = v & torch.isfinite(lo)
        logits = logits + torch.where(v, lo, torch.zeros((), dtype=dtype, device=u.device))
    logits = logits.masked_fill(~v, _masked_fill_value(dtype))
    q = torch.softmax(logits, dim=-1)
    return torch.where(v, q, torch.zeros((), dtype=dtype, device=u.device))


def tpo_loss(
    logps: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor | None = None, reduction: str = "mean"
) -> torch.Tensor:
    """Cross-entropy of the group-renormalised policy to the target: L_g = -sum_i q_i log softmax_K(l)_i.

    The gradient w.r.t. `logps` is `sum(q) * softmax(l) - q`, i.e. `p - q` for a group with valid members and 0 for
    a group without any. Invalid members are excluded from the softmax and receive zero gradient.

    Args:
        logps: `(..., K)` sequence log-probs at the current parameters (differentiable; bf16 is upcast).
        targets: `(..., K)` target q (treated as a constant).
        valid: optional `(..., K)` bool mask.
        reduction: "mean" (mean over all groups, the paper's L), "sum", or "none" (per-group `(...,)`).

    Returns:
        scalar for "mean"/"sum", else `(...,)`, in at least float32.
    """
    dtype = _compute_dtype(logps, targets)
    lp = logps.to(dtype)
    q = targets.detach().to(device=lp.device, dtype=dtype)
    v = _valid_mask(lp, valid)
    log_p = torch.log_softmax(lp.masked_fill(~v, _masked_fill_value(dtype)), dim=-1)
    per_group = -torch.where(v, q * log_p, torch.zeros((), dtype=dtype, device=lp.device)).sum(-1)
    if reduction == "mean":
        return per_group.mean()
    if reduction == "sum":
        return per_group.sum()
    if reduction == "none":
        return per_group
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _detached_group_log_softmax(logps, targets, valid):
    """(log softmax over the valid members, q, valid, a zero), detached, in the compute dtype of both inputs."""
    dtype = _compute_dtype(logps, targets)
    lp = logps.detach().to(dtype)
    q = targets.detach().to(device=lp.device, dtype=dtype)
    v = _valid_mask(lp, valid)
    log_p = torch.log_softmax(lp.masked_fill(~v, _masked_fill_value(dtype)), dim=-1)
    return log_p, q, v, torch.zeros((), dtype=dtype, device=lp.device)


@torch.no_grad()
def tpo_row_coefficients(
    old_logps: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-member form of `tpo_loss` at the parameters where `old_logps` were taken, for groups split over
    micro-batches.

    At l_theta = l_old the group loss has gradient dL_g/dl_i = p_old_i - q_i, so sum_i c_i l_theta_i with the constant
    c_i = p_old_i - q_i has the same gradient, and the values r_i = -q_i log p_old_i add up to L_g. Both are sums over
    members, so any partition of a group's members (micro-batches, processes) gives the group's gradient and loss.

    Args:
        old_logps: `(..., K)` sequence log-probs at the parameters the loss will be differentiated at.
        targets: `(..., K)` target q.
        valid: optional `(..., K)` bool mask.

    Returns:
        `(c, r)`, both `(..., K)` in at least float32; 0 for invalid members (and for every member of a group without
        a valid one).
    """
    log_p, q, v, zero = _detached_group_log_softmax(old_logps, targets, valid)
    coef = torch.where(v, log_p.exp() - q, zero)
    row_ce = -torch.where(v, q * log_p, zero)
    return coef, row_ce


@torch.no_grad()
def tpo_group_stats(
    logps: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """Per-group diagnostics (sums, so they can be reduced across micro-batches and processes).

    Args:
        logps: `(G, K)` current sequence log-probs.
        targets: `(G, K)` target q.
        valid: optional `(G, K)` bool mask.

    Returns:
        dict of 0-dim float tensors:
        `num_groups` (groups with a valid member), `target_entropy_sum` (sum over groups of H(q)),
        `kl_q_p_sum` (sum over groups of KL(q || p_theta)), `cross_entropy_sum` (sum of L_g),
        `max_abs_p_minus_q` (max over valid members of |p_theta - q|; 0 if none).
    """
    log_p, q, v, zero = _detached_group_log_softmax(logps, targets, valid)
    p = torch.where(v, log_p.exp(), zero)
    pos = v & (q > 0)
    log_q = torch.log(torch.where(pos, q, torch.ones_like(q)))
    has_valid = v.any(-1)
    entropy = -torch.where(pos, q * log_q, zero).sum(-1)
    kl = torch.where(pos, q * (log_q - log_p), zero).sum(-1)
    ce = -torch.where(v, q * log_p, zero).sum(-1)
    diff = torch.where(v, (p - q).abs(), zero)
    return {
        "num_groups": has_valid.sum().to(zero.dtype),
        "target_entropy_sum": torch.where(has_valid, entropy, zero).sum(),
        "kl_q_p_sum": torch.where(has_valid, kl, zero).sum(),
        "cross_entropy_sum": ce.sum(),
        "max_abs_p_minus_q": diff.max() if diff.numel() else zero,
    }
