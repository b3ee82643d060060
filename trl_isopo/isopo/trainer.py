"""`ISOPOTrainer`: GRPOTrainer whose linear-layer gradients are rebuilt by ISOPO inside the one backward pass.

Thin glue: the math is in `reweight.py` / `routes.py`, the mechanism in `linear.py` / `other_params.py`.
"""

from __future__ import annotations

import contextlib
import json
from transformers.utils import logging
import os
import textwrap

import torch
import torch.nn as nn
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import GRPOTrainer
from trl.trainer.utils import get_config_model_id

from .config import ISOPOConfig
from .linear import ISOPOContext, ISOPOSettings, MicroBatch, install_isopo_linears
from .other_params import advantage_weighted_head, install_advantage_weighting, other_trainable_modules

logger = logging.get_logger(__name__)

ISOPO_STATE_FILE = "isopo_state.json"
# GRPOTrainer internals this class relies on; checked at construction so a TRL upgrade fails loudly.
_REQUIRED_HOOKS = ("_compute_loss", "_get_per_token_logps_and_entropies", "_save_checkpoint", "_load_optimizer_and_scheduler")


class ISOPOTrainer(GRPOTrainer):
    """Trainer for Isometric Policy Optimization (ISOPO, arXiv 2512.23353).

    Same constructor and workflow as [`~trl.GRPOTrainer`]. Inside the policy-loss backward, every trainable
    `nn.Linear` (full weights, or PEFT LoRA's `lora_A` / `lora_B`) returns the ISOPO weight gradient: sequence i's
    gradient of the advantage-free surrogate, re-weighted by A_i and its regularized Fisher / Euclidean norms (or, with
    `isopo_interacting=True`, by lam (K + lam I)^-1 A). The backward seed is -sum(log pi) normalized like the
    configured `loss_type`; advantages enter only through these coefficients. Other trainable parameters receive what
    `isopo_other_params` says. See `docs/isopo.md`.

    Coefficients are computed per micro-batch and per process (a local estimator); the EMA statistics are averaged
    over processes at each optimizer step, so all ranks regularize identically.
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

    def __init__(self, model, reward_funcs, args: ISOPOConfig | None = None, **kwargs):
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = ISOPOConfig(f"{model_name.split('/')[-1]}-ISOPO")
        if not isinstance(args, ISOPOConfig):
            raise TypeError(f"ISOPOTrainer needs an ISOPOConfig, got {type(args).__name__}")
        for hook in _REQUIRED_HOOKS:
            if not callable(getattr(GRPOTrainer, hook, None)):
                raise RuntimeError(f"GRPOTrainer.{hook} is missing: this TRL version is not supported by trl-isopo")
        super().__init__(model, reward_funcs, args=args, **kwargs)
        if self.aux_loss_enabled:
            raise ValueError("ISOPO does not support MoE router aux losses: set router_aux_loss_coef=0.")
        if self.is_fsdp_enabled or (self.is_deepspeed_enabled and self._zero_stage() == 3):
            raise NotImplementedError(
                "ISOPO is tested with one process and DDP only; FSDP and DeepSpeed ZeRO-3 shard or gather weights "
                "around the layer backward and are not supported yet. Use DDP or ZeRO-1/2 (recipes/accelerate/)."
            )
        self.isopo_context = ISOPOContext(
            ISOPOSettings(
                p=args.isopo_p,
                q=args.isopo_q,
                r=args.isopo_r,
                reg=args.isopo_reg,
                ema_decay=args.isopo_reg_ema_decay,
                fisher_tokens=args.isopo_fisher_tokens,
                interacting=args.isopo_interacting,
                interacting_reg=args.isopo_interacting_reg,
                route=args.isopo_route,
                budget_bytes=int(args.isopo_chunk_mb * 2**20),
                seed=args.seed,
            )
        )
        self.isopo_coverage = self._install_isopo()
        self._isopo_micro_step = 0
        self._isopo_skipped = 0

    # ----------------------------------------------------------------------------------------------------- set-up
    def _zero_stage(self) -> int:
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        return int(getattr(plugin, "zero_stage", 0) or 0)

    def _install_isopo(self) -> dict:
        model = self.model
        _check_vanilla_lora(model)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        head = base.get_output_embeddings()
        exclude = {id(head)} if head is not None else set()
        covered = install_isopo_linears(model, self.isopo_context, exclude=exclude)
        if not covered:
            raise ValueError(
                "ISOPO found no trainable nn.Linear in the model (other than the LM head). Unfreeze linear layers or "
                "use a LoRA peft_config."
            )
        covered_modules = [m for n, m in model.named_modules() if n in set(covered)]
        covered_ids = {id(m) for m in covered_modules}
        others = other_trainable_modules(model, covered_ids, head)
        head_trainable = head is not None and any(p.requires_grad for p in head.parameters())
        mode = self.args.isopo_other_params
        if mode == "frozen":
            for _, module in others:
                module.requires_grad_(False)
            if head_trainable:
                head.requires_grad_(False)
            if self.args.gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()  # reentrant checkpointing with a frozen embedding
        elif mode == "advantage_weighted":
            install_advantage_weighting(others, self.isopo_context)
        self._isopo_head_weighted = mode == "advantage_weighted" and head_trainable
        n_cov = sum(p.numel() for m in covered_modules for p in m.parameters())
        n_other = sum(p.numel() for _, m in others for p in m.parameters(recurse=False) if p.requires_grad or mode == "frozen")
        n_head = sum(p.numel() for p in head.parameters()) if head_trainable else 0
        coverage = {
            "isopo_layers": len(covered),
            "isopo_params": n_cov,
            "other_modules": len(others) + (1 if head_trainable else 0),
            "other_params": n_other + n_head,
            "other_params_mode": mode,
            "covered": covered,
        }
        logger.info(
            "ISOPO covers %d linear layers (%d parameters); %d other trainable modules (%d parameters, incl. LM head: "
            "%s) get %s gradients.",
            coverage["isopo_layers"],
            n_cov,
            coverage["other_modules"],
            coverage["other_params"],
            head_trainable,
            mode,
        )
        return coverage

    # ------------------------------------------------------------------------------------------------- training
    @contextlib.contextmanager
    def isopo_active(self):
        """The window in which covered layers use the ISOPO backward: one micro-batch's forward, recompute, backward."""
        ctx = self.isopo_context
        ctx.active = True
        head = advantage_weighted_head(ctx) if self._isopo_head_weighted else contextlib.nullcontext()
        try:
            with head:
                yield
        finally:
            ctx.active = False
            ctx.clear()

    def training_step(self, model, inputs, num_items_in_batch):
        with self.isopo_active():
            output = super().training_step(model, inputs, num_items_in_batch)
        self._isopo_micro_step += 1
        if self.accelerator.sync_gradients:
            self._isopo_end_step()
        return output

    def _isopo_end_step(self):
        ctx = self.isopo_context
        reduce = None
        if self.accelerator.num_processes > 1:
            device = self.accelerator.device

            def reduce(t):
                return self.accelerator.reduce(t.to(device), reduction="sum").cpu()

        ctx.ema.end_step(reduce, self.accelerator.num_processes)
        names = ("euclidean_norm", "fisher_norm", "rel_overlap", "scale_mean", "scale_std", "ntk_lambda",
                 "nonfinite_coefficients")
        step = ctx.step_metrics()
        local = torch.tensor([list(step.get(n, (0.0, 0.0))) for n in names], dtype=torch.float64)
        if self.accelerator.num_processes > 1:
            local = self.accelerator.reduce(local.to(self.accelerator.device), reduction="sum").cpu()
        for n, (total, count) in zip(names, local.tolist()):
            if count > 0:  # means over layer calls; the dropped-coefficient count is a total over the step
                self._metrics["train"][f"isopo/{n}"].append(total if n == "nonfinite_coefficients" else total / count)
        # counts (summed, not averaged): sequences whose coefficient was not finite (this process), EMA folds skipped
        bad = step.get("nonfinite_coefficients", (0.0, 0.0))[0]
        skipped, self._isopo_skipped = ctx.ema.skipped - self._isopo_skipped, ctx.ema.skipped
        if bad:
            logger.warning("ISOPO step %d: %d non-finite per-sequence coefficients dropped (those sequences did not "
                           "contribute to their layer).", self.state.global_step, int(bad))
        if skipped:
            logger.info("ISOPO step %d: %d EMA folds skipped (zero or non-finite step statistics).",
                        self.state.global_step, skipped)

    def _compute_loss(self, model, inputs):
        """The advantage-free surrogate -sum(log pi), normalized like `loss_type`, through GRPO's own loss code.

        With advantages = 1 and pi_old = sg(pi) GRPO's clipped surrogate has ratio 1 and gradient exactly
        grad(-sum log pi) / normalizer, so GRPO's forward, masks (tool, truncation) and normalization are reused
        unchanged (vLLM's IS correction is rejected by ISOPOConfig); the real advantages reach the covered layers
        through the micro-batch context.
        """
        mode = "train" if self.model.training else "eval"
        advantages = torch.nan_to_num(inputs["advantages"].detach().float(), nan=0.0)
        if advantages.dim() != 1:
            raise ValueError("ISOPO needs one advantage per sequence (advantages of shape (B,))")
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1).bool()
        if mode == "train":
            settings = self.isopo_context.settings
            seed = hash((settings.seed, self.accelerator.process_index, self.state.global_step, self._isopo_micro_step))
            self.isopo_context.micro_batch = MicroBatch(
                mask=attention_mask,
                advantages=advantages,
                seed=seed % (2**62),
                logits_to_keep=inputs["completion_ids"].size(1),
            )
        surrogate_inputs = dict(inputs)
        surrogate_inputs["advantages"] = torch.ones_like(inputs["advantages"])
        surrogate_inputs["old_per_token_logps"] = None
        self._isopo_logps = None
        loss = super()._compute_loss(model, surrogate_inputs)
        logps = self._isopo_logps.detach()
        # Monitoring value: the REINFORCE loss -mean_tokens(A * log pi) that the ISOPO step improves. ISOPO's
        # gradient is not the gradient of any scalar loss; adding a constant leaves the backward untouched.
        mask = inputs["completion_mask"].to(logps.dtype)
        weighted = torch.stack([-(advantages.to(logps.dtype).unsqueeze(1) * logps * mask).sum(), mask.sum()])
        totals = self.accelerator.reduce(weighted.clone(), reduction="sum")
        self._metrics[mode]["policy_loss"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        display = weighted[0] / weighted[1].clamp(min=1.0)
        if mode == "train":
            display = display / self.current_gradient_accumulation_steps
        return loss + (display - loss.detach())

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self._isopo_logps = out[0]
        return out

    # --------------------------------------------------------------------------------------------- checkpoints
    def _save_checkpoint(self, model, trial):
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
            with open(os.path.join(folder, ISOPO_STATE_FILE), "w") as f:
                json.dump({"ema": self.isopo_context.ema.state_dict(), "micro_step": self._isopo_micro_step}, f)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, ISOPO_STATE_FILE)
        if not os.path.exists(path):
            logger.warning("%s is missing (not an ISOPOTrainer checkpoint): ISOPO's EMA statistics start afresh.", path)
            return
        with open(path) as f:
            state = json.load(f)
        self.isopo_context.ema.load_state_dict(state["ema"])
        self._isopo_micro_step = int(state["micro_step"])


def _check_vanilla_lora(model: nn.Module) -> None:
    """ISOPO wraps lora_A / lora_B as plain linears: DoRA, other variants and merged adapters bypass them."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if any(getattr(module, "use_dora", {}).values()):
            raise ValueError(f"ISOPO supports vanilla LoRA only; {name} uses DoRA (set use_dora=False).")
        if getattr(module, "merged", False):
            raise ValueError(f"ISOPO needs unmerged LoRA adapters; {name} is merged (call unmerge_adapter()).")
        variants = getattr(module, "lora_variant", {}) or {}
        if any(v is not None for v in variants.values()):
            raise ValueError(f"ISOPO supports vanilla LoRA only; {name} uses a LoRA variant ({variants}).")
