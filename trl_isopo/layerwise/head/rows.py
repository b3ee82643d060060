"""Where the fused LM head's kernel rows sit in a micro-batch: TRL's two row layouts, mapped without host reads."""

from __future__ import annotations

import torch


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


def scored_rows(mb, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (B, C) long, valid (B, C) bool): the kernel row of each scored position (b, c), c < C = logits_to_keep,
    in either of TRL's layouts: all B*(L-1) shifted positions, or only the positions whose shifted label is valid
    (row-major; `head_row_values`). Invalid positions point at row 0 (their `valid` is False)."""
    B, L = mb.mask.shape
    C = mb.logits_to_keep
    valid = scored_positions(mb)
    if n_rows == B * (L - 1):
        rows = torch.arange(n_rows, device=valid.device).view(B, L - 1)
    else:
        rows = valid.reshape(-1).cumsum(0).view(B, L - 1) - 1
    rows, valid = rows[:, L - 1 - C :], valid[:, L - 1 - C :]
    return torch.where(valid, rows, 0), valid
