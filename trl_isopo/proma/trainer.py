"""`PROMATrainer`: GRPOTrainer whose linear-layer gradients are PROMA's (arXiv 2601.10498), built inside the backward.

Thin glue: the math is `projection.proma_layer_step`, the per-layer state `backward.PROMABackward` (a
`LayerBackward` of the method-neutral engine, `trl_isopo/layerwise/`), the trainer `LayerwiseTrainer`.
"""

from __future__ import annotations

import textwrap

from transformers.utils import logging

from ..layerwise.install import unsupported_sharding
from ..layerwise.trainer import LayerwiseTrainer
from .backward import PROMA, PROMABackward, PROMAMicroBatch
from .config import PROMAConfig
from .projection import projection_active, sketch_seed

logger = logging.get_logger(__name__)


class PROMATrainer(LayerwiseTrainer):
    """Trainer for Projected Microbatch Accumulation (PROMA, arXiv 2601.10498).

    Same constructor and workflow as [`~trl.GRPOTrainer`]. The loss is the advantage-free surrogate -sum(log pi),
    normalized like `loss_type`; inside its backward every trainable `nn.Linear` (full weights, or PEFT LoRA's
    `lora_A` / `lora_B`; not the LM head) returns the increment of its PROMA running gradient S (`proma_mode`):

    - accumulation: before micro-batch m's policy gradient G_m = sum_i A_i V_i is added, S loses its ridge fit by the
      micro-batch's unit per-sequence gradients V_i / ||V_i|| (arXiv 2601.10498 v4 §2);
    - intra: G_m loses its projection onto the top singular directions of the layer's inputs and output gradients;
    - both.

    S is private to each process and reset at the first micro-batch of every optimizer step (one chain per process;
    DDP averages the chains). Other trainable parameters receive what `proma_other_params` says. With `beta > 0`,
    TRL's k3 KL term to the reference model is added as an ordinary gradient, outside the projected chain. See
    `docs/proma.md`.
    """

    _tag_names = ["trl", "trl-isopo", "proma"]
    _name = "PROMA"
    _paper = {
        "title": "PROMA: Projected Microbatch Accumulation for Reference-Free Proximal Policy Updates",
        "id": "2601.10498",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{abrahamsen2026proma,
                title        = {{PROMA: Projected Microbatch Accumulation for Reference-Free Proximal Policy Updates}},
                author       = {Nilin Abrahamsen},
                year         = 2026,
                eprint       = {arXiv:2601.10498},
            }"""),
    }

    config_class = PROMAConfig

    def make_backward(self, args: PROMAConfig) -> PROMABackward:
        return PROMABackward(args.proma_settings())

    def _check_args(self, args: PROMAConfig) -> None:
        super()._check_args(args)
        if args.proma_lm_head:
            raise NotImplementedError(
                "proma_lm_head=True is not implemented yet: the LM head's gradient is formed inside TRL's fused "
                "log-prob kernel, where PROMA does not run. Set proma_lm_head=False (the head then gets what "
                "proma_other_params says)."
            )

    @property
    def proma_backward(self) -> PROMABackward:
        return self._surrogate_backward

    @property
    def proma_coverage(self) -> dict:
        """What PROMA covers (`install.install_layerwise`'s coverage)."""
        return self.layer_coverage

    @property
    def _proma_index(self) -> int:
        """This micro-batch's position in the optimizer step."""
        return self._step_index

    @_proma_index.setter
    def _proma_index(self, value: int) -> None:
        self._step_index = value

    def _unsupported_setup(self, backward=None) -> str | None:
        fsdp2 = self.is_fsdp_enabled and getattr(self.accelerator, "is_fsdp2", False)
        if self.is_deepspeed_enabled or (self.is_fsdp_enabled and not fsdp2):
            return (
                "PROMA is tested on one process, under DDP and under FSDP2, not under DeepSpeed or FSDP1 (whose flat "
                "parameters are gathered outside the module's forward, where PROMA's per-layer step runs). Use DDP "
                "(recipes/accelerate/ddp.yaml), FSDP2 (recipes/accelerate/fsdp2.yaml) or one process."
            )
        extra = ("a router aux loss",) if self.aux_loss_enabled else ()
        problem = unsupported_sharding(PROMA, self.is_fsdp_enabled, fsdp2, 0, self.args.beta, extra)
        if problem is None and fsdp2:
            logger.warning(
                "PROMA under FSDP2: the per-layer step is tested with torch's fully_shard on 2 CPU processes (the mean "
                "of the per-process chains), not yet through accelerate on GPUs.%s",
                " Accumulation keeps one full-size (unsharded) float32 running gradient per covered layer on every "
                "process." if self.args.proma_settings().needs_running else "",
            )
        return problem

    def remove_proma(self) -> None:
        """Uninstall PROMA's backward (the model's own forwards and TRL's kernel are restored); this trainer cannot
        train afterwards."""
        self.remove_layerwise()

    # ------------------------------------------------------------------------------------------------- training
    def _make_micro_batch(self, inputs, mask, advantages, normalizer) -> PROMAMicroBatch:
        index = self._step_index
        steps = self.current_gradient_accumulation_steps
        key = (self.args.seed, self.accelerator.process_index, self.state.global_step, index)
        return PROMAMicroBatch(
            mask=mask,
            advantages=advantages,
            seed=sketch_seed(*key),
            logits_to_keep=inputs["completion_ids"].size(1),
            stat_scale=normalizer,
            step_sequences=float(advantages.shape[0] * steps),
            index=index,
            active=projection_active(index, steps, self.args.proma_skip_fraction),
            sketch_key=key,
        )

    # ------------------------------------------------------------------------------------------------- metrics
    def _needs_old_logps(self) -> bool:
        # Reused samples (num_iterations > 1): their log-probs at generation give the logged per-step KL.
        return super()._needs_old_logps() or self.num_iterations > 1

    def _surrogate_metrics(self, inputs, logps, mask):
        old = inputs.get("old_per_token_logps")
        if self.num_iterations == 1 or old is None:
            return []
        return [((old.to(logps.dtype) - logps) * mask).sum(), mask.sum()]

    def _log_surrogate_metrics(self, mode, totals):
        if totals:
            self._metrics[mode]["proma/step_kl"].append(totals[0] / max(totals[1], 1.0))
