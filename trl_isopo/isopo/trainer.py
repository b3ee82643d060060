"""`ISOPOTrainer`: GRPOTrainer whose linear-layer gradients are rebuilt by ISOPO inside the one backward pass.

Thin glue: ISOPO's math is in `layer.py` / `reweight.py`, its backward object in `isopo_backward.py` (installed on
the model here and opened per micro-batch); the method-neutral engine (the autograd Function, the window, the
advantage-free surrogate and the KL term) in `trl_isopo/layerwise/`.
"""

from __future__ import annotations

import json
import os
import textwrap

import torch
from transformers.utils import logging

from ..layerwise.trainer import LayerwiseTrainer
from .config import ISOPOConfig
from .isopo_backward import ISOPO, ISOPOBackward
from .metrics import METRIC_NAMES

logger = logging.get_logger(__name__)

# The "ISOPO has become REINFORCE" warning: isopo/scale_spread (mean coefficient of variation of the per-sequence
# scales) below SPREAD_WARN_THRESHOLD for SPREAD_WARN_STEPS consecutive optimizer steps; repeated at most every
# SPREAD_WARN_EVERY steps while it lasts.
SPREAD_WARN_THRESHOLD = 0.01
SPREAD_WARN_STEPS = 5
SPREAD_WARN_EVERY = 100


class ISOPOTrainer(LayerwiseTrainer):
    """Trainer for Isometric Policy Optimization (ISOPO, arXiv 2512.23353).

    Same constructor and workflow as [`~trl.GRPOTrainer`]. Inside the policy-loss backward, every trainable
    `nn.Linear` (full weights, or PEFT LoRA's `lora_A` / `lora_B`) returns the ISOPO weight gradient: sequence i's
    gradient of the advantage-free surrogate, re-weighted by A_i and its regularized Fisher / Euclidean norms (or, with
    `isopo_interacting=True`, by lam (K + lam I)^-1 A). The backward seed is -sum(log pi) normalized like the
    configured `loss_type`; advantages enter only through these coefficients. Other trainable parameters receive what
    `isopo_other_params` says; the LM head too, unless `isopo_lm_head=True` transforms it with ISOPO inside TRL's
    fused log-prob kernel (`head/`). With `beta > 0`, TRL's k3 KL term to the reference model is added as an ordinary
    gradient (one extra backward pass over the same graph, `surrogate.SurrogateLossMixin`, shared with PROMA); so are
    TRL's entropy bonus and a MoE model's router aux loss (in the same pass). `top_entropy_quantile < 1` masks the advantage-free seed to the
    high-entropy tokens, as GRPO masks its per-token loss. See `docs/isopo.md`.

    Coefficients are computed per micro-batch and per process (a local estimator) and normalized so that the step's
    update does not depend on how its sequences are split over processes and micro-batches (`ISOPOConfig`, "Batch
    semantics"); the EMA statistics are averaged over processes at each optimizer step, so all ranks regularize
    identically.
    """

    _tag_names = ["trl", "trl-isopo", "isopo"]
    _name = "ISOPO"
    _paper = {
        "title": "ISOPO: Proximal policy gradients without pi-old",
        "id": "2512.23353",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{abrahamsen2025isopo,
                title        = {{ISOPO: Proximal policy gradients without pi-old}},
                author       = {Nilin Abrahamsen},
                year         = 2025,
                eprint       = {arXiv:2512.23353},
            }"""),
    }
    _window_method = "isopo_active"
    config_class = ISOPOConfig

    _isopo_skipped = 0  # EMA folds skipped so far (the EMA's count at the last step)
    _isopo_uniform_steps = 0  # consecutive optimizer steps with isopo/scale_spread < SPREAD_WARN_THRESHOLD
    _isopo_last_spread_warning = None  # the step of the last such warning

    def make_backward(self, args: ISOPOConfig) -> ISOPOBackward:
        return ISOPOBackward(args.isopo_settings())

    @property
    def isopo_backward(self) -> ISOPOBackward:
        """The installed backward object (settings, EMA state, metrics)."""
        return self._surrogate_backward

    @property
    def isopo_coverage(self) -> dict:
        """What ISOPO covers (`install_layerwise`'s coverage: layers, parameters, the other parameters' mode)."""
        return self.layer_coverage

    @property
    def _isopo_micro_step(self) -> int:
        """Micro-batches trained so far: seeds the Fisher token samples; saved with every checkpoint."""
        return self._micro_step

    def remove_isopo(self) -> None:
        """Uninstall ISOPO's backward: the model's own forwards and TRL's fused head kernel are restored (e.g. to use
        the trained model elsewhere in this process); this trainer cannot train afterwards."""
        self.remove_layerwise()

    # ------------------------------------------------------------------------------------------------- training
    def isopo_active(self):
        """The span of one micro-batch's forward, recompute and backward (`backward_window`): `_compute_loss` opens
        the backward object's window for the micro-batch it builds inside it; it closes after the backward, with the
        window's checks (every covered layer had its ISOPO backward)."""
        return self.backward_window()

    def _end_step(self) -> None:
        self._isopo_end_step()

    def _isopo_end_step(self):
        ctx = self.isopo_backward
        reduce = None
        if self.accelerator.num_processes > 1:
            device = self.accelerator.device

            def reduce(t):
                return self.accelerator.reduce(t.to(device), reduction="sum").cpu()

        ctx.ema.end_step(reduce, self.accelerator.num_processes)
        step = ctx.step_metrics()
        local = torch.tensor([list(step.get(n, (0.0, 0.0))) for n in METRIC_NAMES], dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            local = self.accelerator.reduce(local.to(self.accelerator.device), reduction="sum").cpu()
        reduced = dict(zip(METRIC_NAMES, local.tolist()))
        for n, (total, count) in reduced.items():
            if count > 0:  # means over layer calls; the dropped-coefficient count is a total over the step
                mean = total if n == "nonfinite_coefficients" else total / count
                self._metrics["train"][ISOPO.metric(n)].append(mean)
        # counts (summed, not averaged): sequences whose coefficient was not finite (this process), EMA folds skipped
        bad = step.get("nonfinite_coefficients", (0.0, 0.0))[0]
        skipped, self._isopo_skipped = ctx.ema.skipped - self._isopo_skipped, ctx.ema.skipped
        if bad:
            logger.warning("ISOPO step %d: %d non-finite per-sequence coefficients dropped (those sequences did not "
                           "contribute to their layer).", self.state.global_step, int(bad))
        if skipped:
            logger.info("ISOPO step %d: %d EMA folds skipped (zero or non-finite step statistics).",
                        self.state.global_step, skipped)
        spread = reduced["scale_spread"]
        self._isopo_check_spread(spread[0] / spread[1] if spread[1] > 0 else None)

    def _isopo_check_spread(self, spread: float | None) -> None:
        """Warn when the per-sequence scales have been uniform for SPREAD_WARN_STEPS optimizer steps in a row."""
        s = self.isopo_backward.settings
        if s.interacting or (s.p == 0 and s.q == 0 and s.r == 0) or spread is None:
            return
        self._isopo_uniform_steps = self._isopo_uniform_steps + 1 if spread < SPREAD_WARN_THRESHOLD else 0
        step = self.state.global_step
        last = self._isopo_last_spread_warning
        if self._isopo_uniform_steps >= SPREAD_WARN_STEPS and (last is None or step - last >= SPREAD_WARN_EVERY):
            self._isopo_last_spread_warning = step
            logger.warning(
                "ISOPO step %d: the per-sequence scales have been uniform for %d steps (isopo/scale_spread = %.2g < "
                "%g): the update is REINFORCE up to a per-layer constant. Lower isopo_reg (currently %g; 0 = pure "
                "normalization) or use isopo_reg_reference='ema_median' or 'batch_median' (currently %r).",
                step, self._isopo_uniform_steps, spread, SPREAD_WARN_THRESHOLD, s.reg, s.reg_reference,
            )

    # --------------------------------------------------------------------------------------------- checkpoints
    def _save_optimizer_and_scheduler(self, output_dir):
        """Write ISOPO's EMA state next to the optimizer's: inside `Trainer._save_checkpoint`, so before the
        checkpoint is pushed to the Hub and before older checkpoints are rotated out (a pushed or kept checkpoint
        always carries the state its resume needs)."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            save_isopo_state(output_dir, self.isopo_backward.ema.state_dict(), self._micro_step)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        state = load_isopo_state(checkpoint)
        if state is None:
            logger.warning("%s has no ISOPO state (not an ISOPOTrainer checkpoint): ISOPO's EMA statistics start "
                           "afresh.", checkpoint)
            return
        self.isopo_backward.ema.load_state_dict(state["ema"])
        self._micro_step = int(state["micro_step"])


# ------------------------------------------------------------------------------------------------------------------
# ISOPO's own checkpoint state: the EMA statistics and the micro-step counter (the Fisher sample's seed), written next
# to the optimizer's state so that a resumed run continues exactly (docs/isopo.md, "Checkpoints").


ISOPO_STATE_FILE = "isopo_state.json"


def save_isopo_state(output_dir: str, ema_state: dict, micro_step: int) -> None:
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, ISOPO_STATE_FILE), "w") as f:
        json.dump({"ema": ema_state, "micro_step": micro_step}, f)


def load_isopo_state(checkpoint: str) -> dict | None:
    """{"ema": ..., "micro_step": ...} of `checkpoint`, or None when it has no ISOPO state file."""
    path = os.path.join(checkpoint, ISOPO_STATE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
