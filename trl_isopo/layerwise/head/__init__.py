"""The LM head inside TRL's fused log-prob kernel (it never forms the logits, so the head is handled apart from the
covered linears):

- `kernel.py`: TRL's kernel with a per-row scale on the weight gradient (`RowScaledChunkedLogProb`);
- `rows.py`: which kernel row belongs to which sequence, in TRL's two row layouts;
- `interception.py`: how an installed backward object swaps the kernel in (and why that needs TRL's module global).

A method's own head transform (ISOPO's: `trl_isopo/isopo/head.py`) supplies the per-row values.
"""

from .interception import FusedHeadInterception, RowValues
from .kernel import RowScaledChunkedLogProb, backward_tile_inplace, tile_fold
from .rows import head_row_values, scored_positions, scored_rows

__all__ = [
    "FusedHeadInterception",
    "RowScaledChunkedLogProb",
    "RowValues",
    "backward_tile_inplace",
    "head_row_values",
    "scored_positions",
    "scored_rows",
    "tile_fold",
]
