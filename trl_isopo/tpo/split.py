"""Groups split over micro-batches and processes (`per_device_train_batch_size % K != 0`).

TPO's group loss L_g = -sum_i q_i log softmax(l)_i is not a sum over members, so a micro-batch holding part of a
group cannot form it. Where the parameters are fixed over one use of a generation batch (each use inside one optimizer
step), its gradient at that point is sum_i (p_i - q_i) grad l_i with p from a forward at those parameters: a sum over
members with constant coefficients (`tpo_row_coefficients`), computed once per use from the whole group.
"""

from __future__ import annotations

import torch
from trl.models.utils import disable_gradient_checkpointing

from ..compat import policy_forward
from .grouping import splits_groups
from .target import sequence_logps, tpo_group_stats, tpo_row_coefficients

__all__ = ["member_loss", "gather_groups", "SplitGroupsMixin"]


def member_loss(
    coef: torch.Tensor, row_ce: torch.Tensor, logps: torch.Tensor, group_size: int
) -> torch.Tensor:
    """One micro-batch's TPO loss from its group members: gradient sum_i c_i grad l_i, value sum_i r_i, both divided by
    the micro-batch's share of groups (rows / K), as the whole-group loss is a mean over the micro-batch's groups.

    Args:
        coef: `(B,)` constant coefficients c_i = p_i - q_i.
        row_ce: `(B,)` each member's share r_i = -q_i log p_i of its group's loss.
        logps: `(B,)` sequence log-probs at the current parameters (differentiable).
        group_size: K.

    Returns:
        a scalar in the dtype of `coef * logps`.
    """
    surrogate = (coef * logps).sum()
    return (surrogate - surrogate.detach() + row_ce.sum()) * group_size / logps.shape[0]


def gather_groups(accelerator, rows: torch.Tensor, tensors, group_size: int) -> list[torch.Tensor]:
    """Every process's members of one generation batch, ordered by their row in the gathered batch, as groups.

    Args:
        accelerator: the trainer's `Accelerator` (a collective: call on every rank).
        rows: `(B,)` each local member's row in the generation batch gathered over processes (`tpo_row`).
        tensors: `(B,)` tensors of the local members (bool tensors are gathered as integers).
        group_size: K.

    Returns:
        one `(G, K)` tensor per entry of `tensors`, G = the generation batch's groups.
    """
    order = torch.argsort(accelerator.gather(rows))  # the gathered rows are a permutation of 0..N-1
    out = []
    for x in tensors:
        y = accelerator.gather(x.long() if x.dtype == torch.bool else x)[order]
        out.append((y.bool() if x.dtype == torch.bool else y).view(-1, group_size))
    return out


class SplitGroupsMixin:
    """TPOTrainer's split-group steps (needs its `_loss_mask`, `_tpo_build_targets` and `_tpo_metrics`)."""

    def _tpo_splits_groups(self, mode) -> bool:
        """Whether this mode's micro-batches cut groups (then every member carries its loss coefficient)."""
        if mode == "train":
            return splits_groups(self.args.per_device_train_batch_size, self.num_generations)
        return splits_groups(self.args.per_device_eval_batch_size, self.num_generations_eval)

    def _tpo_split_targets(self, output, old_logps, non_empty, scores, score_scale, group_size, mode):
        """The targets of this process's rows (q (B,), valid (B,)) of the generation batch `output`, from the whole
        groups gathered over processes: `old_logps` (B,) this process's p_old sequence log-probs; `non_empty`,
        `scores`, `score_scale` (N,) every process's. Every member's loss coefficient is fixed here: the parameters do
        not move before the loss uses them (`grouping.group_batch_size_error`), so p_old == p_theta there."""
        rows = old_logps.shape[0]
        local = slice(self.accelerator.process_index * rows, (self.accelerator.process_index + 1) * rows)
        old_g, q, valid, sums = self._tpo_build_targets(
            self.accelerator.gather(old_logps), non_empty, scores, group_size, score_scale
        )
        self._tpo_metrics.log_target(self.accelerator, self._metrics[mode], sums, reduce=False)
        output["tpo_row"] = torch.arange(q.numel(), device=q.device)[local]  # the row in the gathered batch
        self._tpo_set_coefficients([output], old_g, q, valid, mode)
        return q.reshape(-1)[local], valid.reshape(-1)[local]

    def _tpo_set_coefficients(self, batches, logps, q, valid, mode) -> None:
        """Give every member in `batches` (micro-batches with `tpo_row`) its `tpo_coef` and `tpo_row_ce` from the whole
        groups `(G, K)`: `logps` at the parameters of the coming loss forwards, `q`, `valid`; log the group metrics."""
        self._tpo_metrics.log_groups(
            self.accelerator, self._metrics[mode], tpo_group_stats(logps, q, valid), q.shape[0], reduce=False,
            step_end=True,
        )
        coef, row_ce = (x.reshape(-1) for x in tpo_row_coefficients(logps, q, valid))
        for b in batches:
            b["tpo_coef"], b["tpo_row_ce"] = coef[b["tpo_row"]], row_ce[b["tpo_row"]]

    @torch.no_grad()
    def _tpo_refresh_coefficients(self, batches) -> None:
        """A reuse of a generation batch (`num_iterations > 1`) after the parameters moved: the coefficients
        p_theta - q at the current parameters from one no-grad forward of its micro-batches `batches` (q stays
        frozen). A collective."""
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            normalize = self.args.tpo_length_normalize
            logps = [sequence_logps(policy_forward(self, self.model, b)[0], self._loss_mask(b), normalize)
                     for b in batches]
        logps, q, valid = gather_groups(
            self.accelerator,
            torch.cat([b["tpo_row"] for b in batches]),
            [torch.cat(logps)] + [torch.cat([b[k] for b in batches]) for k in ("tpo_targets", "tpo_valid_mask")],
            self.num_generations,
        )
        self._tpo_set_coefficients(batches, logps, q, valid, "train")
