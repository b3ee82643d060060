"""The package's one seam to the internals of TRL and transformers.

Every private TRL / transformers name trl-isopo reads or writes, and every assumption on the order in which
GRPOTrainer calls its own methods, is here under a name of this package's; the rest of `trl_isopo` calls these. The
seam is written for pyproject.toml's range (TRL 1.16.x; transformers 5.17 and newer). `tests/test_compat.py` checks
each assumption against the installed TRL, and its failure names the TRL version and the assumption: a TRL upgrade
starts there, and ends here.

What is not here: the GRPOTrainer methods the trainers override as TRL's own GRPOTrainer subclasses do
(`_compute_loss`, `_generate_and_score_completions`, ...); their signatures are checked by `check_grpo_hooks` when a
trainer is built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch
import trl
import trl.kernels.chunked_logprob as _kernel
import trl.trainer.utils as _trl_utils
from transformers import TrainingArguments

TRL_SERIES = "1.16"  # the TRL release series this seam was written and tested against


def broken(assumption: str) -> str:
    """The message of a failed assumption: which TRL broke what, and where the seam is."""
    return (f"TRL {trl.__version__} no longer {assumption} (trl-isopo is written for TRL {TRL_SERIES}.x; see "
            "trl_isopo/compat.py)")


# -------------------------------------------------------------------------------------------------- transformers
_TRAINING_FIELDS = {f.name for f in dataclasses.fields(TrainingArguments)}
# transformers >= 5.18 names it `activation_checkpointing` (`gradient_checkpointing` stays as a deprecated alias that
# prints a FutureWarning); transformers 5.17 only has `gradient_checkpointing`.
CHECKPOINTING_FIELD = "activation_checkpointing" if "activation_checkpointing" in _TRAINING_FIELDS else (
    "gradient_checkpointing")

# ----------------------------------------------------------------------- TRL's fused LM-head kernel (trl.kernels)
# The head's row-scaled kernel (layerwise/head/kernel.py) runs TRL's forward and TRL's backward pieces in TRL's loop.
_KERNEL_NAMES = ("ChunkedLogProbFunction", "TOKEN_CHUNK_SIZE", "_backward_kernel", "_backward_tile", "_use_triton",
                 "_addmm_fp32", "_BLOCK_SIZE")
_missing = [name for name in _KERNEL_NAMES if not hasattr(_kernel, name)]
if _missing:  # pragma: no cover - only with an unsupported TRL
    raise ImportError(broken(f"has {_missing} in trl.kernels.chunked_logprob") + ": pip install 'trl~=1.16.0'")

ChunkedLogProbFunction = _kernel.ChunkedLogProbFunction  # forward(ctx, hidden, weight, bias, targets, *args)
TOKEN_CHUNK_SIZE = _kernel.TOKEN_CHUNK_SIZE  # rows per tile of TRL's backward loop
FOLD_BLOCK_COLUMNS = _kernel._BLOCK_SIZE  # the Triton fold's column block
addmm_fp32 = _kernel._addmm_fp32  # acc (fp32) += a @ b, without rounding the product to a half dtype first
maybe_gather_lm_head_ctx = _trl_utils.maybe_gather_lm_head_ctx  # ZeRO-3: gathers the head for a recompute


def triton_tile_fold(device: torch.device, n_rows: int, n_cols: int):
    """TRL's Triton tile fold launched over an [n_rows, n_cols] tile where TRL itself uses it (CUDA / XPU), else None.
    Same arguments as TRL's `_backward_tile` (looked up at each call, so a test can switch the path)."""
    if _kernel._use_triton(device):
        return _kernel._backward_kernel[(n_rows, -(-n_cols // FOLD_BLOCK_COLUMNS))]
    return None


# `GRPOTrainer._fused_forward` (trl/trainer/utils.py) reads the kernel from this module global at every call, and
# `lm_head.weight` inside it: replacing the global is the only way to reach the head's weight gradient.
def logprob_kernel():
    """The kernel object TRL's fused head forward calls `.apply` on (TRL's, or an installed stand-in)."""
    return _trl_utils._ChunkedLogProbFunction


def set_logprob_kernel(kernel) -> None:
    """Make TRL's fused head forward call `kernel.apply` from its next call on (process-wide)."""
    _trl_utils._ChunkedLogProbFunction = kernel


# ----------------------------------------------------------------------------- the entropy bonus's controller
# GRPOTrainer keeps the adaptive controller's state in two private attributes and saves / restores
# `_last_world_entropy` with `entropy_coef` in its checkpoints (`entropy_ctrl_state.json`): writing the same
# attributes keeps resuming exact for trainers that compute the bonus themselves (grpo_terms.py).
def entropy_controller_state(trainer) -> tuple[float, torch.Tensor | None]:
    """(entropy measured over the previous optimizer step, this step's (sum, count) so far or None)."""
    return trainer._last_world_entropy, trainer._entropy_window_stats


def set_entropy_controller_state(trainer, last_world_entropy: float, window: torch.Tensor | None) -> None:
    trainer._last_world_entropy, trainer._entropy_window_stats = last_world_entropy, window


# ---------------------------------------------------------------------------- TRL's colocated vLLM (vllm_cpu.py)
def vllm_sync_weights_iter(generation):
    """What TRL's own `VLLMGeneration.sync_weights` pushes: (name, tensor) pairs with vLLM's names, LoRA merged,
    gathered under ZeRO-3 / FSDP. Every process must iterate it."""
    return generation._iter_named_params()


def mark_vllm_weights_awake(generation) -> None:
    """Tell TRL's generate() that the weights are mapped again (it re-pushes them after a level-2 sleep otherwise)."""
    generation._llm_weights_sleeping = False


# ------------------------------------------------------------------ GRPOTrainer's generation buffer (TPO's shuffle)
def buffered_inputs(trainer, generation_batch, shuffle, on_buffer=None):
    """`GRPOTrainer._prepare_inputs` (TRL 1.16) with `shuffle(batch) -> batch` in place of its row shuffle.

    Training: every `steps_per_generation * num_iterations` steps (or when the buffer is empty, as after a resume) a
    generation batch is generated, shuffled and split into `steps_per_generation` micro-batches; each step returns the
    next one. `on_buffer(buffer, fresh)` is called in training before a micro-batch is returned (`fresh`: the buffer
    was just filled). Evaluation: the batch is generated and returned as it is.
    """
    if not trainer.model.training:
        return trainer._generate_and_score_completions(generation_batch)
    spg = trainer.args.steps_per_generation
    fresh = trainer._step % (spg * trainer.num_iterations) == 0 or trainer._buffered_inputs is None
    if fresh:
        batch = _trl_utils.split_pixel_values_by_grid(trainer._generate_and_score_completions(generation_batch))
        parts = _trl_utils.split_tensor_dict(shuffle(batch), spg)
        trainer._buffered_inputs = [_trl_utils.unsplit_pixel_values_by_grid(part) for part in parts]
    if on_buffer is not None:
        on_buffer(trainer._buffered_inputs, fresh)
    return trainer._buffered_inputs[trainer._step % spg]


# ------------------------------------------------------------------------- the rollout's old-log-prob forward
def runs_old_logps_forward(trainer) -> bool:
    """Whether GRPOTrainer's `_generate_and_score_completions` runs its no-grad forward for `old_per_token_logps`:
    when generation and optimizer steps are misaligned, or for vLLM's importance-sampling correction."""
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    return trainer.args.gradient_accumulation_steps % generate_every != 0 or (
        trainer.use_vllm and trainer.vllm_importance_sampling_correction)


class OldLogpsSkip:
    """Skips that forward for a trainer that never reads `old_per_token_logps`.

    Relies on TRL 1.16's order inside `_generate_and_score_completions`: after generation, the first call of
    `_get_per_token_logps_and_entropies` on `trainer.model` without gradients is that forward (the reference
    model's comes after it), and a None result reads as "no old log-probs" (the loss then uses sg(log pi)).
    Use: `with skip.rollout(trainer, wanted): super()._generate_and_score_completions(...)`, and in the trainer's
    `_get_per_token_logps_and_entropies`, `if skip.take(trainer, model): return None, None, None`.
    """

    def __init__(self):
        self.armed = False

    @contextlib.contextmanager
    def rollout(self, trainer, wanted: bool):
        self.armed = not wanted and runs_old_logps_forward(trainer)
        try:
            yield
        finally:
            missed, self.armed = self.armed, False
        if missed:
            raise RuntimeError(broken("computes old_per_token_logps in this rollout, which trl-isopo skips") +
                               f": {type(trainer).__name__} cannot run on it.")

    def take(self, trainer, model) -> bool:
        """Whether this forward is the one to skip (consumes the flag)."""
        if self.armed and model is trainer.model and not torch.is_grad_enabled():
            self.armed = False
            return True
        return False


# ---------------------------------------------------------------------------- the overridden GRPOTrainer methods
# Forward kwargs GRPOTrainer._compute_loss passes to `_get_per_token_logps_and_entropies` (TRL 1.16).
FORWARD_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes", "num_tiles",
                "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def policy_forward(trainer, model, inputs, compute_entropy=False, compute_aux_loss=False, batch_size=None):
    """(per-token log-probs (B, C), entropies (B, C) or None, aux loss or None) of the completions in `inputs` (a
    micro-batch of GRPOTrainer's), through `trainer._get_per_token_logps_and_entropies` called as GRPOTrainer's own
    loss calls it (multimodal inputs included)."""
    completion_ids = inputs["completion_ids"]
    return trainer._get_per_token_logps_and_entropies(
        model, torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
        torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1), completion_ids.size(1),
        batch_size=batch_size, compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss,
        **{key: inputs.get(key) for key in FORWARD_KEYS})


# GRPOTrainer methods some trainer of this package overrides or calls, with the parameters it passes or reads.
GRPO_HOOKS = {
    "_prepare_inputs": ("generation_batch",),
    "_generate_and_score_completions": ("inputs",),
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
    "_compute_loss": ("model", "inputs"),
    "training_step": ("model", "inputs", "num_items_in_batch"),
    "_save_optimizer_and_scheduler": ("output_dir",),
    "_load_optimizer_and_scheduler": ("checkpoint",),
    "_get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask", "logits_to_keep", "batch_size",
                                           "compute_entropy", "compute_aux_loss") + FORWARD_KEYS,
}
# GRPOTrainer state (set by its __init__) the package reads or writes.
GRPO_STATE = ("_buffered_inputs", "_step", "_metrics", "_last_world_entropy", "_entropy_window_stats", "entropy_coef",
              "num_iterations", "num_generations", "num_generations_eval", "reward_weights", "beta", "aux_loss_enabled",
              "router_aux_loss_coef", "use_vllm", "vllm_importance_sampling_correction")


def check_grpo_hooks(trainer_name: str) -> None:
    """Fail loudly, before anything is built, if the GRPOTrainer methods the package relies on have changed."""
    from trl import GRPOTrainer

    for name, params in GRPO_HOOKS.items():
        fn = getattr(GRPOTrainer, name, None)
        if fn is None:
            raise RuntimeError(f"{trainer_name}: " + broken(f"has GRPOTrainer.{name}"))
        missing = [p for p in params if p not in inspect.signature(fn).parameters]
        if missing:
            raise RuntimeError(f"{trainer_name}: " + broken(f"passes {missing} to GRPOTrainer.{name}"))
    if not getattr(GRPOTrainer, "loss_is_scaled_for_ga", False):
        raise RuntimeError(f"{trainer_name}: " + broken("sets GRPOTrainer.loss_is_scaled_for_ga = True"))


def check_grpo_state(trainer) -> None:
    """Fail loudly after GRPOTrainer.__init__ if the state the package reads was not set."""
    missing = [name for name in GRPO_STATE if not hasattr(trainer, name)]
    if missing:
        raise RuntimeError(f"{type(trainer).__name__}: " + broken(f"sets GRPOTrainer attributes {missing}"))
