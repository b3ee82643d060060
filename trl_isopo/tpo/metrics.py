"""TPO's logged metrics: the sums behind them, reduced over processes, and when each is logged.

The generation-side metrics (`tpo/target_entropy`, `tpo/frac_zero_variance_groups`, `tpo/frac_invalid_completions`)
are logged once per generation batch; where q is built in the loss forwards, their sums are deferred until the last
micro-batch of the batch. The loss-side group metrics (`policy_loss`, `tpo/kl_q_p`, `tpo/max_abs_p_minus_q`, the last
a max over the optimizer step) come from `tpo_group_stats` over whole groups.
"""

from __future__ import annotations

import torch

from .target import ZERO_STD_THRESHOLD, tpo_group_stats

__all__ = ["target_sums", "TPOMetrics"]


def target_sums(old_logps: torch.Tensor, q: torch.Tensor, valid: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """The generation-side metric sums of whole groups; sums over disjoint sets of groups add up.

    Args:
        old_logps, q, valid: `(G, K)` p_old's sequence log-probs, the target, the valid members.
        std: `(G,)` the population std of each group's scores.

    Returns:
        `(6,)`: target entropy summed over groups, groups with a valid member, zero-variance groups, groups,
        invalid members, members (float32, or float64 for float64 inputs).
    """
    stats = tpo_group_stats(old_logps, q, valid)
    dtype = stats["target_entropy_sum"].dtype
    count = lambda n: torch.tensor(float(n), dtype=dtype, device=valid.device)  # noqa: E731
    return torch.stack(
        [
            stats["target_entropy_sum"],
            stats["num_groups"],
            (std <= ZERO_STD_THRESHOLD).sum().to(dtype),
            count(valid.shape[0]),
            (~valid).sum().to(dtype),
            count(valid.numel()),
        ]
    )


class TPOMetrics:
    """Deferred generation-side sums per mode and the running max of |p - q| over an optimizer step.

    Every method that reduces runs a collective: call it on every rank, in the same order.
    """

    def __init__(self):
        self.deferred = {"train": [None, 0], "eval": [None, 0]}  # [summed target_sums or None, micro-batches left]
        self.max_abs_p_minus_q = 0.0

    def log_target(self, accelerator, metrics, sums: torch.Tensor, reduce: bool = True) -> None:
        """Append the generation-side metrics (`reduce=False`: `sums` already covers every process)."""
        totals = accelerator.reduce(sums, reduction="sum") if reduce else sums
        metrics["tpo/target_entropy"].append((totals[0] / totals[1].clamp(min=1)).item())
        metrics["tpo/frac_zero_variance_groups"].append((totals[2] / totals[3].clamp(min=1)).item())
        metrics["tpo/frac_invalid_completions"].append((totals[4] / totals[5].clamp(min=1)).item())

    def defer(self, mode: str, micro_batches: int) -> None:
        """The next `micro_batches` loss forwards of `mode` build q and add their sums."""
        self.deferred[mode] = [None, micro_batches]

    def add_deferred(self, accelerator, metrics, mode: str, sums: torch.Tensor) -> None:
        """Add one micro-batch's sums; log them at the last micro-batch of the generation batch."""
        entry = self.deferred[mode]
        entry[0] = sums if entry[0] is None else entry[0] + sums
        entry[1] -= 1
        if entry[1] <= 0:
            self.flush(accelerator, metrics, mode)

    def flush(self, accelerator, metrics, mode: str) -> None:
        """Log deferred sums left over (a generation batch not fully consumed, e.g. at the end of an epoch)."""
        sums, _ = self.deferred[mode]
        self.deferred[mode] = [None, 0]
        if sums is not None:
            self.log_target(accelerator, metrics, sums)

    def log_groups(self, accelerator, metrics, stats, num_groups: int, reduce: bool, step_end: bool) -> None:
        """Append policy_loss and tpo/kl_q_p from `tpo_group_stats` over `num_groups` groups (`reduce`: over all
        processes), and tpo/max_abs_p_minus_q, the max since the last `step_end`."""
        device = stats["kl_q_p_sum"].device
        sums = torch.stack(
            [
                stats["cross_entropy_sum"].float(),
                torch.tensor(float(num_groups), device=device),
                stats["kl_q_p_sum"].float(),
                stats["num_groups"].float(),
            ]
        )
        max_abs = stats["max_abs_p_minus_q"].float().reshape(1)
        if reduce:
            sums = accelerator.reduce(sums, reduction="sum")
            max_abs = accelerator.gather(max_abs)
        metrics["policy_loss"].append((sums[0] / sums[1].clamp(min=1)).item())
        metrics["tpo/kl_q_p"].append((sums[2] / sums[3].clamp(min=1)).item())
        self.max_abs_p_minus_q = max(self.max_abs_p_minus_q, max_abs.max().item())
        if step_end:
            metrics["tpo/max_abs_p_minus_q"].append(self.max_abs_p_minus_q)
            self.max_abs_p_minus_q = 0.0
