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
from trl import GRPOTrainer
from trl.trainer.utils import get_config_model_id

from .config import ISOPOConfig
from .linear import ISOPOContext, ISOPOSettings, MicroBatch, install_isopo_linears
from .head import ISOPOHead
from .other_params import advantage_weighted_head, install_advantage_weighting, other_trainable_modules
from .plain import plain_backward

logger = logging.get_logger(__name__)

ISOPO_STATE_FILE = "isopo_state.json"
# GRPOTrainer internals this class relies on; checked at construction so a TRL upgrade fails loudly.
_REQUIRED_HOOKS = (
    "_compute_loss",
    "_get_per_token_logps_and_entropies",
    "_save_optimizer_and_scheduler",
    "_load_optimizer_and_scheduler",
)
# The "ISOPO has become REINFORCE" warning: isopo/scale_spread (mean coefficient of variation of the per-sequence
# scales) below SPREAD_WARN_THRESHOLD for SPREAD_WARN_STEPS consecutive optimizer steps; repeated at most every
# SPREAD_WARN_EVERY steps while it lasts.
SPREAD_WARN_THRESHOLD = 0.01
SPREAD_WARN_STEPS = 5
SPREAD_WARN_EVERY = 100


def unsupported_sharding(fsdp: bool, fsdp2: bool, zero_stage: int, beta: float) -> str | None:
    """Why ISOPO cannot run under this sharding (the error message), or None.

    ISOPO's per-layer backward needs the whole weight inside the module's forward and backward: FSDP2 and ZeRO-1/2
    give that (FSDP2 all-gathers around each sharded module; ZeRO-1/2 keep full weights), FSDP1's flat parameters and
    ZeRO-3's gathering outside the module are not supported. beta > 0 adds the KL gradient by a second autograd pass
    inside the loss and parameter hooks: not adapted to FSDP2's sharded parameters yet, and under ZeRO-1/2 the pass
    sets off DeepSpeed's end-of-backward gradient reduction with nothing accumulated (DeepSpeed 0.19.8:
    IndexError in `reduce_ipg_grads`; tests/test_isopo_zero2.py)."""
    if (fsdp and not fsdp2) or zero_stage == 3:
        return (
            "ISOPO supports one process, DDP, DeepSpeed ZeRO-1/2 and FSDP2. FSDP1 (flat parameters) and ZeRO-3 "
            "gather weights outside the module's forward, where ISOPO's per-layer backward runs, and are not "
            "supported: use FSDP2 (fsdp_version: 2, recipes/accelerate/fsdp2.yaml), DDP or ZeRO-1/2."
        )
    if fsdp2 and beta != 0.0:
        return (
            "ISOPO with beta > 0 adds the KL gradient through parameter hooks, not supported under FSDP2 yet: set "
            "beta=0 or use DDP."
        )
    if zero_stage in (1, 2) and beta != 0.0:
        return (
            "ISOPO with beta > 0 computes the KL gradient with a second autograd pass inside the loss, which DeepSpeed "
            "ZeRO-1/2 takes for the end of the backward (its gradient reduction then fails): set beta=0 or use DDP."
        )
    return None


class ISOPOTrainer(GRPOTrainer):
    """Trainer for Isometric Policy Optimization (ISOPO, arXiv 2512.23353).

    Same constructor and workflow as [`~trl.GRPOTrainer`]. Inside the policy-loss backward, every trainable
    `nn.Linear` (full weights, or PEFT LoRA's `lora_A` / `lora_B`) returns the ISOPO weight gradient: sequence i's
    gradient of the advantage-free surrogate, re-weighted by A_i and its regularized Fisher / Euclidean norms (or, with
    `isopo_interacting=True`, by lam (K + lam I)^-1 A). The backward seed is -sum(log pi) normalized like the
    configured `loss_type`; advantages enter only through these coefficients. Other trainable parameters receive what
    `isopo_other_params` says; the LM head too, unless `isopo_lm_head=True` transforms it with ISOPO inside TRL's
    fused log-prob kernel (`head.py`). With `beta > 0`, TRL's k3 KL term to the reference model is added as an ordinary
    gradient (one extra backward pass over the same graph, see `_isopo_kl_term`). See `docs/isopo.md`.

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

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: ISOPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        # GRPOTrainer 1.16's signature, names, order and defaults (tests/test_isopo_trainer.py checks it).
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = ISOPOConfig(f"{model_name.split('/')[-1]}-ISOPO")
        if not isinstance(args, ISOPOConfig):
            raise TypeError(f"ISOPOTrainer needs an ISOPOConfig, got {type(args).__name__}")
        for hook in _REQUIRED_HOOKS:
            if not callable(getattr(GRPOTrainer, hook, None)):
                raise RuntimeError(f"GRPOTrainer.{hook} is missing: this TRL version is not supported by trl-isopo")
        super().__init__(
            model, reward_funcs, args, train_dataset, eval_dataset, processing_class, reward_processing_classes,
            callbacks, optimizers, quantization_config, peft_config, tools, rollout_func, environment_factory,
        )
        if self.aux_loss_enabled:
            raise ValueError("ISOPO does not support MoE router aux losses: set router_aux_loss_coef=0.")
        fsdp2 = self.is_fsdp_enabled and getattr(self.accelerator, "is_fsdp2", False)
        zero_stage = self._zero_stage() if self.is_deepspeed_enabled else 0
        problem = unsupported_sharding(self.is_fsdp_enabled, fsdp2, zero_stage, args.beta)
        if problem:
            raise NotImplementedError(problem)
        if fsdp2:
            logger.warning(
                "ISOPO under FSDP2: the per-layer backward is tested with torch's fully_shard on 2 CPU processes "
                "(same parameters as one process), not yet through accelerate on GPUs."
            )
        self.isopo_context = ISOPOContext(
            ISOPOSettings(
                p=args.isopo_p,
                q=args.isopo_q,
                r=args.isopo_r,
                reg=args.isopo_reg,
                reg_reference=args.isopo_reg_reference,
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
        self._isopo_uniform_steps = 0  # consecutive optimizer steps with isopo/scale_spread < SPREAD_WARN_THRESHOLD
        self._isopo_last_spread_warning = None
        self._isopo_kl_hooks = []  # (parameter, KL gradient, hook handle, [fired]) of the current micro-batch

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
        isopo_head = self.args.isopo_lm_head
        if isopo_head and not head_trainable:
            raise ValueError(
                "isopo_lm_head=True transforms the LM head's weight gradient, but this model's LM head has no trainable "
                "parameter (LoRA freezes it). Train the head (full fine-tuning) or set isopo_lm_head=False."
            )
        mode = self.args.isopo_other_params
        if mode == "frozen":
            for _, module in others:
                module.requires_grad_(False)
            if head_trainable and not isopo_head:
                head.requires_grad_(False)
            if self.args.gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()  # reentrant checkpointing with a frozen embedding
        elif mode == "advantage_weighted":
            install_advantage_weighting(others, self.isopo_context)
        self._isopo_head_weighted = head_trainable and (isopo_head or mode == "advantage_weighted")
        head_name = next((n for n, m in model.named_modules() if m is head), "lm_head")
        self._isopo_head = ISOPOHead(self.isopo_context, head_name) if isopo_head else None
        n_cov = sum(p.numel() for m in covered_modules for p in m.parameters())
        n_other = sum(p.numel() for _, m in others for p in m.parameters(recurse=False) if p.requires_grad or mode == "frozen")
        n_head = sum(p.numel() for p in head.parameters()) if head_trainable else 0
        coverage = {
            "isopo_layers": len(covered),
            "isopo_params": n_cov,
            "other_modules": len(others) + (1 if head_trainable else 0),
            "other_params": n_other + n_head,
            "other_params_mode": mode,
            "lm_head": "isopo" if isopo_head else (mode if head_trainable else "frozen"),
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
        head = advantage_weighted_head(ctx, self._isopo_head) if self._isopo_head_weighted else contextlib.nullcontext()
        try:
            with head:
                yield
            if self._isopo_head is not None and ctx.calls and self._isopo_head.name not in ctx.calls:
                raise RuntimeError(
                    "ISOPO: isopo_lm_head=True, but the LM head's gradient did not pass through TRL's fused log-prob "
                    "kernel in this micro-batch (the logits were computed another way), so it would not be "
                    "re-weighted. Set isopo_lm_head=False."
                )
            missing = ctx.uncovered_layers()
            if missing:
                # Their weights got an ordinary, reward-free gradient from some other use (e.g. `F.linear(x,
                # layer.weight)` in a custom forward): silently wrong, so stop.
                raise RuntimeError(
                    f"ISOPO: the covered layer(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} had no ISOPO "
                    "backward in this micro-batch while other covered layers did: their weight is used outside the "
                    "module's own forward (a custom forward calling F.linear on it, a tied weight, FSDP1 flat "
                    "parameters), so its gradient would not be re-weighted. Freeze these layers, exclude them from "
                    "the LoRA target_modules, or call the module itself."
                )
        finally:
            ctx.active = False
            ctx.clear()
            self._isopo_flush_kl_hooks()

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
        names = ("euclidean_norm", "fisher_norm", "rel_overlap", "scale_mean", "scale_std", "scale_spread",
                 "ntk_lambda", "nonfinite_coefficients")
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
        spread = dict(zip(names, local.tolist())).get("scale_spread", (0.0, 0.0))
        self._isopo_check_spread(spread[0] / spread[1] if spread[1] > 0 else None)

    def _isopo_check_spread(self, spread: float | None) -> None:
        """Warn when the per-sequence scales have been uniform for SPREAD_WARN_STEPS optimizer steps in a row."""
        s = self.isopo_context.settings
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

    def _isopo_loss_normalizer(self, inputs, mask: torch.Tensor, mode: str) -> torch.Tensor:
        """(B,) n_i with d(loss)/d(log pi_it) = -mask_it / n_i for GRPO's loss with advantages 1 and ratio 1.

        Mirrors TRL 1.16 `GRPOTrainer._compute_loss`'s normalization of each supported loss_type (a test checks it
        against autograd of that loss): bnpo: the micro-batch's completion tokens x GA; grpo: the sequence's own
        tokens x B x GA; dr_grpo: B x max_completion_length x GA; dapo: the accumulation window's tokens per process.
        """
        B = mask.shape[0]
        ga = float(self.current_gradient_accumulation_steps) if mode == "train" else 1.0
        mask = mask.to(torch.float64)
        lt = self.loss_type
        if lt == "grpo":
            return mask.sum(-1).clamp(min=1.0) * (B * ga)
        if lt == "bnpo":
            n = mask.sum().clamp(min=1.0) * ga
        elif lt == "dr_grpo":
            n = torch.tensor(float(B * self.max_completion_length) * ga, dtype=torch.float64, device=mask.device)
        elif lt == "dapo":
            n = inputs["num_items_in_batch"].to(torch.float64).clamp(min=1.0) / self.accelerator.num_processes
            if mode == "train":
                n = n * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        else:  # pragma: no cover - rejected by ISOPOConfig
            raise ValueError(f"unsupported loss_type {lt!r}")
        return n.to(mask.device).expand(B)

    def _compute_loss(self, model, inputs):
        """The advantage-free surrogate -sum(log pi), normalized like `loss_type`, through GRPO's own loss code.

        With advantages = 1 and pi_old = sg(pi) GRPO's clipped surrogate has ratio 1 and gradient exactly
        grad(-sum log pi) / normalizer, so GRPO's forward, masks (tool, truncation) and normalization are reused
        unchanged (vLLM's IS correction is rejected by ISOPOConfig); the real advantages reach the covered layers
        through the micro-batch context.

        With beta > 0, GRPO's KL term is kept out of that loss (its gradient would be re-weighted) and added as an
        ordinary gradient instead: see `_isopo_kl_term`.
        """
        mode = "train" if self.model.training else "eval"
        advantages = torch.nan_to_num(inputs["advantages"].detach().float(), nan=0.0)
        if advantages.dim() != 1:
            raise ValueError("ISOPO needs one advantage per sequence (advantages of shape (B,))")
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1).bool()
        loss_mask = inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        normalizer = self._isopo_loss_normalizer(inputs, loss_mask, mode)
        if mode == "train":
            settings = self.isopo_context.settings
            seed = hash((settings.seed, self.accelerator.process_index, self.state.global_step, self._isopo_micro_step))
            self.isopo_context.micro_batch = MicroBatch(
                mask=attention_mask,
                advantages=advantages,
                seed=seed % (2**62),
                logits_to_keep=inputs["completion_ids"].size(1),
                stat_scale=normalizer.detach(),
            )
        surrogate_inputs = dict(inputs)
        surrogate_inputs["advantages"] = torch.ones_like(inputs["advantages"])
        surrogate_inputs["old_per_token_logps"] = None
        self._isopo_logps = None
        beta, self.beta = self.beta, 0.0  # GRPO's loss without its KL term (added below, outside the re-weighting)
        try:
            loss = super()._compute_loss(model, surrogate_inputs)
        finally:
            self.beta = beta
        kl_value = 0.0
        if self.beta != 0.0:
            kl_value = self._isopo_kl_term(model, inputs, loss_mask, normalizer, mode)
        logps = self._isopo_logps.detach()
        # Monitoring value: the REINFORCE loss -mean_tokens(A * log pi) that the ISOPO step improves (plus the KL
        # term's value when beta > 0). ISOPO's gradient is not the gradient of any scalar loss; adding a constant
        # leaves the backward untouched.
        mask = inputs["completion_mask"].to(logps.dtype)
        weighted = torch.stack([-(advantages.to(logps.dtype).unsqueeze(1) * logps * mask).sum(), mask.sum()])
        totals = self.accelerator.reduce(weighted.clone(), reduction="sum")
        self._metrics[mode]["policy_loss"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        display = weighted[0] / weighted[1].clamp(min=1.0)
        if mode == "train":
            display = display / self.current_gradient_accumulation_steps
        return loss + (display + kl_value - loss.detach())

    def _isopo_kl_term(self, model, inputs, mask, normalizer, mode):
        """beta x TRL's k3 KL to the reference model, as an ordinary gradient. Returns its (detached) value.

        Per token, exactly as `GRPOTrainer._compute_loss` with beta > 0: k3 = exp(ref - logp) - (ref - logp) - 1, times
        the ratio exp(logp - old) if `use_bias_correction_kl` (old = the rollout's log-probs if TRL kept them, else
        sg(logp): value 1), normalized like the loss_type (`_isopo_loss_normalizer`). GRPO's "kl" metric is logged.

        Design (docs/isopo.md "KL to a reference model"): the covered layers rebuild their weight gradient from the
        backward seed, so the KL seed must not reach them in the same pass. Its gradient is taken here, right after
        the forward, by `torch.autograd.grad(..., retain_graph=True)` over the same graph while
        `plain.plain_backward()` makes every ISOPO backward function ordinary; no second forward. The result is held
        (one gradient-sized buffer) and added to each parameter's gradient by a one-shot hook when the policy-loss
        backward reaches it: before gradient accumulation and DDP's all-reduce, so both see one ordinary gradient.
        `autograd.grad` accumulates nothing into `.grad`, so DDP's reducer sees exactly one backward pass.
        """
        logps = self._isopo_logps
        ref = inputs["ref_per_token_logps"]
        per_token_kl = torch.exp(ref - logps) - (ref - logps) - 1
        if self.args.use_bias_correction_kl:
            old = inputs.get("old_per_token_logps")
            old = logps.detach() if old is None else old
            per_token_kl = per_token_kl * torch.exp(logps - old)
        mask = mask.to(per_token_kl.dtype)
        local = torch.stack([(per_token_kl.detach() * mask).sum(), mask.sum()])
        totals = self.accelerator.reduce(local, reduction="sum")
        self._metrics[mode]["kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        kl_loss = self.beta * (per_token_kl * mask / normalizer.to(per_token_kl.dtype).unsqueeze(1)).sum()
        if mode == "train" and torch.is_grad_enabled() and kl_loss.requires_grad:
            params = [p for p in model.parameters() if p.requires_grad]
            with plain_backward():
                grads = torch.autograd.grad(kl_loss, params, retain_graph=True, allow_unused=True)
            for p, g in zip(params, grads):
                if g is not None:
                    self._isopo_add_kl_hook(p, g)
        return kl_loss.detach()

    def _isopo_add_kl_hook(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        fired = [False]

        def hook(incoming):
            if fired[0]:
                return incoming
            fired[0] = True
            return incoming + grad.to(incoming.dtype)

        self._isopo_kl_hooks.append((param, grad, param.register_hook(hook), fired))

    def _isopo_flush_kl_hooks(self) -> None:
        """Remove this micro-batch's KL hooks; a parameter the policy backward never reached gets its KL gradient
        added to `.grad` directly (single process; under DDP that part would miss the all-reduce: warned)."""
        missed = 0
        for param, grad, handle, fired in self._isopo_kl_hooks:
            handle.remove()
            if not fired[0]:
                missed += 1
                g = grad.to(param.dtype)
                param.grad = g.clone() if param.grad is None else param.grad.add_(g)
        self._isopo_kl_hooks.clear()
        if missed and self.accelerator.num_processes > 1:
            logger.warning("ISOPO: the KL gradient of %d parameters was added outside the backward pass (not "
                           "all-reduced).", missed)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        self._isopo_logps = out[0]
        return out

    # --------------------------------------------------------------------------------------------- checkpoints
    def _save_optimizer_and_scheduler(self, output_dir):
        """Write ISOPO's EMA state next to the optimizer's: inside `Trainer._save_checkpoint`, so before the
        checkpoint is pushed to the Hub and before older checkpoints are rotated out (a pushed or kept checkpoint
        always carries the state its resume needs)."""
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, ISOPO_STATE_FILE), "w") as f:
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
