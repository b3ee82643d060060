"""The GRPOTrainer internals (TRL 1.16) that `TPOTrainer` overrides or reads, checked at construction so that a TRL
upgrade fails loudly instead of training with a silently changed loop."""

from __future__ import annotations

import inspect

from trl import GRPOTrainer

# Forward kwargs GRPOTrainer._compute_loss passes to `_get_per_token_logps_and_entropies` (TRL 1.16).
FORWARD_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)

_REQUIRED_HOOKS = {
    "_prepare_inputs": ("generation_batch",),
    "_generate_and_score_completions": ("inputs",),
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
    "_compute_loss": ("model", "inputs"),
    "_get_per_token_logps_and_entropies": (
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    )
    + FORWARD_KEYS,
}


# GRPOTrainer state read or written by the overrides (checked after GRPOTrainer.__init__).
REQUIRED_STATE = (
    "_buffered_inputs",
    "_step",
    "_metrics",
    "num_iterations",
    "num_generations",
    "num_generations_eval",
    "reward_weights",
    "beta",
    "aux_loss_enabled",
)


def check_trl_hooks() -> None:
    """Fail loudly if the GRPOTrainer internals TPOTrainer relies on have changed."""
    import trl

    for name, params in _REQUIRED_HOOKS.items():
        fn = getattr(GRPOTrainer, name, None)
        if fn is None:
            raise RuntimeError(
                f"TPOTrainer needs GRPOTrainer.{name}, missing in trl {trl.__version__} (built for 1.16)."
            )
        have = inspect.signature(fn).parameters
        missing = [p for p in params if p not in have]
        if missing:
            raise RuntimeError(
                f"TPOTrainer needs GRPOTrainer.{name} with parameters {missing}; trl {trl.__version__} changed it "
                "(built for 1.16)."
            )
    if not getattr(GRPOTrainer, "loss_is_scaled_for_ga", False):
        raise RuntimeError(f"TPOTrainer expects GRPOTrainer.loss_is_scaled_for_ga = True (trl {trl.__version__}).")
