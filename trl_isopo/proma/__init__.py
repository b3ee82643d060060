"""PROMA, Projected Microbatch Accumulation (arXiv 2601.10498), for TRL's GRPOTrainer.

The math (`accumulation`, `intra`, `projection`) imports without TRL; `PROMAConfig` and `PROMATrainer` are loaded
lazily.
"""

from ..lazy import lazy_getattr
from .accumulation import (
    accumulation_coefficients,
    dense_accumulation_step,
    gram_schmidt_coefficients,
    normalized_kernel,
    ridge_coefficients,
    running_overlaps,
)
from .intra import factored_basis, project, range_basis, sequence_cores
from .projection import (
    METRIC_NAMES,
    MODES,
    PROMALayerState,
    PROMASettings,
    PROMAStep,
    projection_active,
    proma_layer_step,
    sketch_seed,
)

_LAZY = {"PROMAConfig": ".config", "PROMATrainer": ".trainer"}

__all__ = [
    "METRIC_NAMES",
    "MODES",
    "PROMAConfig",
    "PROMALayerState",
    "PROMASettings",
    "PROMAStep",
    "PROMATrainer",
    "accumulation_coefficients",
    "dense_accumulation_step",
    "factored_basis",
    "gram_schmidt_coefficients",
    "normalized_kernel",
    "project",
    "projection_active",
    "proma_layer_step",
    "range_basis",
    "ridge_coefficients",
    "running_overlaps",
    "sequence_cores",
    "sketch_seed",
]

__getattr__ = lazy_getattr(__name__, _LAZY)
