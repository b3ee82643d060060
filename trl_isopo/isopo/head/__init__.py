"""The LM head inside TRL's fused log-prob kernel (it never forms the logits, so the head is handled apart from the
covered linears):

- `kernel.py`: TRL's kernel with a per-row scale on the weight gradient (`RowScaledChunkedLogProb`);
- `rows.py`: which kernel row belongs to which sequence, in TRL's two row layouts;
- `isopo.py`: ISOPO's statistics and coefficients of the head over vocabulary tiles (`isopo_lm_head=True`);
- `interception.py`: how an installed backward object swaps the kernel in (and why that needs TRL's module global).
"""

from .interception import FusedHeadInterception, RowValues
from .isopo import ISOPOHead, head_statistics
from .kernel import RowScaledChunkedLogProb, backward_tile_inplace, tile_fold
from .rows import head_row_values, scored_positions, scored_rows

__all__ = [
    "FusedHeadInterception",
    "ISOPOHead",
    "RowScaledChunkedLogProb",
    "RowValues",
    "backward_tile_inplace",
    "head_row_values",
    "head_statistics",
    "scored_positions",
    "scored_rows",
    "tile_fold",
]
