"""Target Policy Optimization (TPO, arXiv 2604.06159) for TRL's GRPOTrainer.

Not TRL's `trl.experimental.tpo` (Triple Preference Optimization). The math in `target` and `grouping` imports
without TRL; `TPOConfig` / `TPOTrainer` are loaded lazily.
"""

from ..lazy import lazy_getattr
from .grouping import check_whole_groups, shuffle_groups, validate_group_batching
from .target import (
    sequence_logps,
    standardize_group_scores,
    tpo_group_stats,
    tpo_loss,
    tpo_row_coefficients,
    tpo_target,
)

_LAZY = {"TPOConfig": ".config", "TPOTrainer": ".trainer", "tpo_unsupported_options": ".config"}

__all__ = [
    "TPOConfig",
    "TPOTrainer",
    "check_whole_groups",
    "sequence_logps",
    "shuffle_groups",
    "standardize_group_scores",
    "tpo_group_stats",
    "tpo_loss",
    "tpo_row_coefficients",
    "tpo_target",
    "tpo_unsupported_options",
    "validate_group_batching",
]

__getattr__ = lazy_getattr(__name__, _LAZY)
