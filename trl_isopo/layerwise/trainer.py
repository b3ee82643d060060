"""`LayerwiseTrainer`: the GRPOTrainer of a per-layer gradient rule (a `LayerBackward` subclass, `rule.py`).

A method becomes a trainer by subclassing it and implementing `make_backward(args)`; ISOPOTrainer and PROMATrainer
are such subclasses, and docs/layerwise.md walks through a third. What it does around TRL: the seam's checks of the
GRPOTrainer hooks and state it relies on, vLLM's CPU weight sync, the set-ups the engine refuses, installing the
backward object on the model, the advantage-free loss (`SurrogateLossMixin`), the rule's step hooks (`start_step`
before the first micro-batch of an optimizer step, `end_step` after its last backward, `log_metrics` at each log)
and their metrics.
"""

from __future__ import annotations

import torch
from transformers.utils import logging

from ..base_trainer import PackageTrainer
from ..grpo_terms import entropy_bonus_enabled
from .engine import LayerBackward
from .install import install_layerwise, unsupported_sharding
from .micro_batch import MicroBatch
from .rules import surrogate_config_errors
from .surrogate import SurrogateLossMixin

logger = logging.get_logger(__name__)


class LayerwiseTrainer(SurrogateLossMixin, PackageTrainer):
    """GRPOTrainer whose covered linear layers (trainable `nn.Linear`s, full weights or LoRA's `lora_A` / `lora_B`;
    not the LM head) get the gradient of the rule `make_backward` returns, inside the one backward pass.

    Same constructor and workflow as [`~trl.GRPOTrainer`] (`base_trainer.PackageTrainer`). Subclasses set
    `config_class` (a `GRPOConfig` subclass: the type `args` must have, and the default config's) and `_name`, and
    implement `make_backward`; they may override `other_params_mode` / `transforms_lm_head` (what the other trainable
    parameters and the LM head get), `_check_args` (refusals before TRL builds anything) and `_make_micro_batch` (a
    `MicroBatch` subclass with the rule's own per-micro-batch values).
    """

    _name = "Layerwise"

    def _after_init(self, args) -> None:
        backward = self.make_backward(args)
        problem = self._unsupported_setup(backward)
        if problem:
            raise NotImplementedError(problem)
        self._init_surrogate(backward)
        self.layer_coverage = install_layerwise(
            backward, self.model, other_params=self.other_params_mode, lm_head=self.transforms_lm_head,
            gradient_checkpointing=self.args.gradient_checkpointing,
        )  # fmt: skip
        self._step_index = 0  # this micro-batch's position in the optimizer step
        self._micro_step = 0  # micro-batches trained so far (seeds; checkpointed by methods that need it)

    # ------------------------------------------------------------------------------------------ a method's hooks
    def make_backward(self, args) -> LayerBackward:
        """The method's backward object (a `LayerBackward` implementing `grads`), built from `args`."""
        raise NotImplementedError(f"{type(self).__name__} must implement make_backward(args)")

    @property
    def other_params_mode(self) -> str:
        """What the trainable parameters outside the covered layers get (`other_params.py`): the config's
        `<prefix>_other_params` field (`isopo_other_params`, ...) where it has one, else "surrogate" (their ordinary
        gradient of the advantage-free loss, i.e. no reward signal)."""
        return getattr(self.args, self.layer_backward.method.field("other_params"), "surrogate")

    @property
    def transforms_lm_head(self) -> bool:
        """Whether the rule also transforms the LM head inside TRL's fused kernel (`LayerBackward.head_provider`):
        the config's `<prefix>_lm_head` field where it has one, else False."""
        return getattr(self.args, self.layer_backward.method.field("lm_head"), False)

    def _check_args(self, args) -> None:
        """Refuse a configuration before TRL builds the trainer, with what to change: the GRPOConfig options the
        advantage-free surrogate gives no meaning to (`rules.py`; a method's own config may check them already)."""
        errors = surrogate_config_errors(args, self._name, entropy_bonus=True)
        if errors:
            raise ValueError(f"Invalid {type(args).__name__} for {type(self).__name__}:\n- " + "\n- ".join(errors))

    def _unsupported_setup(self, backward: LayerBackward) -> str | None:
        """Why this sharding cannot run the per-layer backward (`install.unsupported_sharding`), or None."""
        fsdp2 = self.is_fsdp_enabled and getattr(self.accelerator, "is_fsdp2", False)
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None) if self.is_deepspeed_enabled else None
        zero_stage = int(getattr(plugin, "zero_stage", 0) or 0)
        extra = (("an entropy bonus",) if entropy_bonus_enabled(self.args) else ()) + (
            ("a router aux loss",) if self.aux_loss_enabled else ()
        )
        problem = unsupported_sharding(backward.method, self.is_fsdp_enabled, fsdp2, zero_stage, self.args.beta, extra)
        if problem is None and fsdp2:
            logger.warning(
                "%s under FSDP2: the per-layer backward is tested with torch's fully_shard on 2 CPU processes, not yet "
                "through accelerate on GPUs.", backward.method.title,
            )
        return problem

    # ------------------------------------------------------------------------------------------------- training
    @property
    def layer_backward(self) -> LayerBackward:
        """The installed backward object (the rule and its state)."""
        return self._surrogate_backward

    def training_step(self, model, inputs, num_items_in_batch):
        if self._step_index == 0:
            self.layer_backward.start_step()
        output = super().training_step(model, inputs, num_items_in_batch)  # inside the window
        self._step_index += 1
        self._micro_step += 1
        if self.accelerator.sync_gradients:
            self._step_index = 0
            self._end_step()
        return output

    def _make_micro_batch(self, inputs, mask, advantages, normalizer) -> MicroBatch:
        seed = hash((self.args.seed, self.accelerator.process_index, self.state.global_step, self._micro_step))
        return MicroBatch(
            mask=mask,
            advantages=advantages,
            seed=seed % (2**62),
            logits_to_keep=inputs["completion_ids"].size(1),
            stat_scale=normalizer,
            # This process's sequences in the optimizer step: TRL's micro-batches of one step have equal size.
            step_sequences=float(advantages.shape[0] * self.current_gradient_accumulation_steps),
        )

    def _process_sum(self, t: torch.Tensor) -> torch.Tensor:
        """t summed over the processes, on the host."""
        if self.accelerator.num_processes > 1:
            t = self.accelerator.reduce(t.to(self.accelerator.device), reduction="sum")
        return t.cpu()

    def _end_step(self) -> None:
        """After the optimizer step's last backward: the rule's `end_step` and its metrics."""
        for key, value in self.layer_backward.end_step(self._process_sum).items():
            self._metrics["train"][key].append(value)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add the rule's `log_metrics` (over all processes) to TRL's."""
        if self.model.training:
            for key, value in self.layer_backward.log_metrics(self._process_sum).items():
                self._metrics["train"][key].append(value)
        super().log(logs, start_time)

    def remove_layerwise(self) -> None:
        """Uninstall the per-layer backward (the model's own forwards and TRL's kernel are restored, e.g. to use the
        trained model elsewhere in this process); this trainer cannot train afterwards."""
        self.layer_backward.remove()
