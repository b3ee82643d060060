"""`SurrogateLossMixin`: the GRPOTrainer glue of a method whose covered linear layers rebuild their weight gradient
inside the backward pass (a `engine.LayerBackward`): ISOPOTrainer and PROMATrainer.

The loss is GRPO's with advantages 1 and no importance ratio, written here from the per-token log-probs (as TRL's
GMPOTrainer writes its own): the **advantage-free surrogate** -sum_i sum_t m_it log pi_it / n_i, m the completion
(and tool) mask, n_i the normalization of `loss_type` (`loss_normalizer`, below); the advantages reach the
covered layers through the micro-batch bound into the backward object's window. What GRPO adds to that loss and the
method must not transform (the k3 KL to the reference model when `beta > 0`, TRL's entropy bonus, a MoE router aux
loss) is taken as one ordinary gradient in the backward object's `plain()` mode over the same graph
(`KLGradients`, below). `top_entropy_quantile < 1` multiplies m by GRPO's high-entropy mask, so the per-sequence
gradients come from the high-entropy tokens only. GRPO's metrics are logged as GRPO logs them (its clip ratios are 0:
there is no ratio). TRL's no-grad forward for `old_per_token_logps` is skipped unless `_needs_old_logps` says it is
read (`compat.OldLogpsSkip`).

A trainer mixes this in before `GRPOTrainer`, calls `_init_surrogate` with its installed `LayerBackward` (whose
`method` names it in messages) and implements `_make_micro_batch`; `training_step` opens the window around TRL's
step.
"""

from __future__ import annotations

import contextlib

import torch

from transformers.utils import logging

from ..compat import OldLogpsSkip, policy_forward
from ..grpo_terms import aux_loss_term, entropy_bonus_enabled, entropy_bonus_term, k3_per_token
from .micro_batch import MicroBatch

logger = logging.get_logger(__name__)

# GRPOTrainer's clip-ratio metrics for the loss types the surrogate normalizes like (TRL 1.16).
_CLIP_METRICS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "clip_ratio/low_min",
                 "clip_ratio/high_max")


class SurrogateLossMixin:
    """See the module docstring. State: `_surrogate_window` (the ExitStack of the open window, None outside),
    `_surrogate_kl` (held KL gradients), `_surrogate_old_logps_skip`."""

    _window_method = "backward_window"  # the name the trainer's users call the window by (in messages)

    def _init_surrogate(self, backward) -> None:
        self._surrogate_backward = backward
        self._surrogate_window = None
        self._surrogate_kl = KLGradients()
        self._surrogate_old_logps_skip = OldLogpsSkip()

    # ------------------------------------------------------------------------------------------- subclass hooks
    def _make_micro_batch(self, inputs, mask, advantages, normalizer) -> MicroBatch:
        """The micro-batch bound into the window: mask (B, L) valid prompt + completion positions, advantages (B,),
        normalizer (B,) the loss normalizer n_i."""
        raise NotImplementedError

    def _needs_old_logps(self) -> bool:
        """Whether TRL's `old_per_token_logps` are read (else their forward is skipped): the KL term's ratio."""
        return self.beta != 0.0 and bool(self.args.use_bias_correction_kl)

    def _surrogate_metrics(self, inputs, logps, mask) -> list[torch.Tensor]:
        """Extra (numerator, denominator) pairs to log per micro-batch, reduced with the policy loss in one call."""
        return []

    def _log_surrogate_metrics(self, mode: str, totals: list[float]) -> None:
        """Receives the process-summed values of `_surrogate_metrics`' pairs."""

    # ----------------------------------------------------------------------------------------------------- window
    @contextlib.contextmanager
    def backward_window(self):
        """The span of one micro-batch's forward, recompute and backward; `_compute_loss` opens the backward
        object's window inside it, which closes here after the backward with its checks."""
        with contextlib.ExitStack() as window:
            self._surrogate_window = window
            try:
                yield
            finally:
                self._surrogate_window = None
                window.callback(self._flush_kl)

    def _flush_kl(self) -> None:
        if self._surrogate_kl.flush() and self.accelerator.num_processes > 1:
            logger.warning("%s: the KL gradient of some parameters was added outside the backward pass (not "
                           "all-reduced).", self._surrogate_backward.method.title)

    def training_step(self, model, inputs, num_items_in_batch):
        with self.backward_window():
            return super().training_step(model, inputs, num_items_in_batch)

    # ------------------------------------------------------------------------------------------------------- loss
    def _loss_normalizer(self, inputs, mask: torch.Tensor, mode: str) -> torch.Tensor:
        train = mode == "train"
        return loss_normalizer(
            self.loss_type, mask, accumulation=self.current_gradient_accumulation_steps if train else 1,
            max_completion_length=self.max_completion_length, num_items_in_batch=inputs.get("num_items_in_batch"),
            num_processes=self.accelerator.num_processes,
            steps_per_generation=self.args.steps_per_generation if train else None,
        )  # fmt: skip

    def _compute_loss(self, model, inputs):
        """The advantage-free surrogate (module docstring): its gradient is GRPO's loss's with advantages 1 and ratio 1,
        -m_it / n_i per log-prob; the real advantages are bound into the window. The KL term, entropy bonus and aux
        loss are one ordinary gradient (`_extra_terms`)."""
        mode = "train" if self.model.training else "eval"
        advantages = torch.nan_to_num(inputs["advantages"].detach().float(), nan=0.0)
        if advantages.dim() != 1:
            method = self._surrogate_backward.method.title
            raise ValueError(f"{method} needs one advantage per sequence (advantages of shape (B,))")
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1).bool()
        loss_mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            loss_mask = loss_mask * inputs["tool_mask"]
        normalizer = self._loss_normalizer(inputs, loss_mask, mode)
        training = mode == "train" and torch.is_grad_enabled()
        if training and self._surrogate_window is None:
            # Outside the window the covered layers are plain linears: a backward of this loss would silently give
            # them the advantage-free gradient of -log pi.
            raise RuntimeError(
                f"{type(self).__name__}'s loss has no ordinary gradient: the advantages enter only inside the "
                f"{self._surrogate_backward.method.title} backward. Call trainer.training_step(model, inputs, "
                "num_items_in_batch) "
                f"(which opens that window), or wrap compute_loss and backward in `with trainer.{self._window_method}():`; "
                "under torch.no_grad() or in eval mode compute_loss only reports the loss."
            )
        if training:
            mb = self._make_micro_batch(inputs, attention_mask, advantages, normalizer.detach())
            self._surrogate_window.enter_context(self._surrogate_backward.micro_batch(mb))
        logps, entropies, aux = policy_forward(self, model, inputs, compute_entropy=True,
                                               compute_aux_loss=self.aux_loss_enabled)
        seed_mask = loss_mask
        if self.top_entropy_quantile < 1.0:
            seed_mask = loss_mask * self.get_high_entropy_mask(entropies, loss_mask, 1 - self.top_entropy_quantile)
        loss = -(logps * seed_mask.to(logps.dtype) / normalizer.to(logps.dtype).unsqueeze(1)).sum()
        extra_value = self._extra_terms(model, inputs, logps, entropies, aux, loss_mask, seed_mask, normalizer, mode)
        # Monitoring value: the REINFORCE loss -mean_tokens(A log pi) (plus the extra terms' value); the method's
        # gradient is no scalar loss's, and adding a constant leaves the backward untouched.
        detached, mask = logps.detach(), inputs["completion_mask"].to(logps.dtype)
        m = loss_mask.to(logps.dtype)
        pairs = [-(advantages.to(logps.dtype).unsqueeze(1) * detached * mask).sum(), mask.sum(),
                 (entropies.detach() * m).sum(), m.sum()]  # GRPO's "entropy" metric
        pairs += self._surrogate_metrics(inputs, detached, mask)
        local = torch.stack([p.to(logps.dtype).reshape(()) for p in pairs])
        totals = self.accelerator.reduce(local.clone(), reduction="sum").tolist()
        self._metrics[mode]["policy_loss"].append(totals[0] / max(totals[1], 1.0))
        self._metrics[mode]["entropy"].append(totals[2] / max(totals[3], 1.0))
        for key in _CLIP_METRICS:  # GRPO logs them for these loss types; without a ratio nothing is clipped
            self._metrics[mode][key].append(0.0)
        self._log_surrogate_metrics(mode, totals[4:])
        display = local[0] / local[1].clamp(min=1.0)
        if mode == "train":
            display = display / self.current_gradient_accumulation_steps
        return loss + (display + extra_value - loss.detach())

    def _extra_terms(self, model, inputs, logps, entropies, aux, mask, seed_mask, normalizer, mode):
        """The KL term (on `mask`), TRL's entropy bonus (on `seed_mask`, the tokens the seed acts on) and the router
        aux loss, summed and taken as one ordinary gradient (one extra backward pass over the same graph); returns
        their (detached) value."""
        extra = []
        if self.beta != 0.0:
            extra.append(self._kl_term(inputs, logps, mask, normalizer, mode))
        if entropy_bonus_enabled(self.args):
            extra.append(entropy_bonus_term(self, entropies, seed_mask, mode))
        if self.aux_loss_enabled:
            extra.append(aux_loss_term(self, aux, mode))
        if not extra:
            return 0.0
        total = sum(t.reshape(()) for t in extra)
        if mode == "train" and torch.is_grad_enabled() and total.requires_grad:
            params = [p for p in model.parameters() if p.requires_grad]
            self._surrogate_kl.take(total, params, self._surrogate_backward)
        return total.detach()

    def _kl_term(self, inputs, logps, mask, normalizer, mode):
        """beta x TRL's k3 KL to the reference model (`grpo_terms.k3_per_token`), normalized like the loss_type;
        differentiable. Logs GRPO's "kl" metric."""
        per_token = k3_per_token(logps, inputs["ref_per_token_logps"], inputs.get("old_per_token_logps"),
                                 self.args.use_bias_correction_kl)  # fmt: skip
        m = mask.to(per_token.dtype)
        totals = self.accelerator.reduce(torch.stack([(per_token.detach() * m).sum(), m.sum()]), reduction="sum")
        self._metrics[mode]["kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        return self.beta * (per_token * m / normalizer.to(per_token.dtype).unsqueeze(1)).sum()

    # ------------------------------------------------------------------------------------- rollout log-probs
    def _generate_and_score_completions(self, inputs):
        """GRPO's rollout without the no-grad forward for `old_per_token_logps` when nothing reads them."""
        with self._surrogate_old_logps_skip.rollout(self, wanted=self._needs_old_logps()):
            return super()._generate_and_score_completions(inputs)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        skip = getattr(self, "_surrogate_old_logps_skip", None)  # None while GRPOTrainer.__init__ runs
        if skip is not None and skip.take(self, model):
            return None, None, None  # old_per_token_logps = None: the loss then uses sg(log pi), ratio 1
        return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)


# ------------------------------------------------------------------------------------------------------------------
# The KL-to-reference term (`beta > 0`) of ISOPOTrainer, added as an ordinary gradient.  Per token, exactly as TRL
# 1.16's `GRPOTrainer._compute_loss` with beta > 0 (`grpo_terms.k3_per_token`), normalized like the loss_type.  Design
# (docs/isopo.md, "KL to a reference model"): the covered layers rebuild their weight gradient from the backward seed,
# so the KL seed must not reach them in the same pass. Its gradient is taken right after the forward by
# `torch.autograd.grad(..., retain_graph=True)` over the same graph while the backward object's `plain()` mode makes
# every ISOPO backward function ordinary; no second forward. The result is held (one gradient-sized buffer) and added
# to each parameter's gradient by a one-shot hook when the policy-loss backward reaches it: before gradient
# accumulation and DDP's all-reduce, so both see one ordinary gradient. `autograd.grad` accumulates nothing into
# `.grad`, so DDP's reducer sees exactly one backward pass.


class KLGradients:
    """The KL gradients of the current micro-batch (with the entropy bonus and router aux loss, when on, in the same
    pass), held until the policy-loss backward reaches their parameters."""

    def __init__(self):
        self.pending: list = []  # (parameter, KL gradient, hook handle, [fired])

    def take(self, kl_loss: torch.Tensor, params: list[torch.Tensor], backward) -> None:
        """Compute d kl_loss / d params in `backward`'s plain mode (the graph retained) and hold them as hooks."""
        with backward.plain():
            grads = torch.autograd.grad(kl_loss, params, retain_graph=True, allow_unused=True)
        for p, g in zip(params, grads):
            if g is not None:
                self._hook(p, g)

    def _hook(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        fired = [False]

        def hook(incoming):
            if fired[0]:
                return incoming
            fired[0] = True
            return incoming + grad.to(incoming.dtype)

        self.pending.append((param, grad, param.register_hook(hook), fired))

    def flush(self) -> int:
        """Remove this micro-batch's hooks; a parameter the policy backward never reached gets its KL gradient added
        to `.grad` directly. Returns how many did (under DDP that part misses the all-reduce: the caller warns)."""
        missed = 0
        for param, grad, handle, fired in self.pending:
            handle.remove()
            if not fired[0]:
                missed += 1
                g = grad.to(param.dtype)
                param.grad = g.clone() if param.grad is None else param.grad.add_(g)
        self.pending.clear()
        return missed


# ------------------------------------------------------------------------------------------------------------------
# The loss normalizer n_i of ISOPO's backward seed: d(loss)/d(log pi_it) = -mask_it / n_i for GRPO's loss with
# advantages 1 and ratio 1 (`MicroBatch.stat_scale`).


def loss_normalizer(
    loss_type: str,
    mask: torch.Tensor,
    *,
    accumulation: float,
    max_completion_length: int,
    num_items_in_batch: torch.Tensor | None,
    num_processes: int,
    steps_per_generation: int | None,
) -> torch.Tensor:
    """(B,) n_i for the completion mask (B, C), mirroring TRL 1.16 `GRPOTrainer._compute_loss`'s normalization of each
    supported loss_type (a test checks it against autograd of that loss): bnpo: the micro-batch's completion tokens x
    GA; grpo: the sequence's own tokens x B x GA; dr_grpo: B x max_completion_length x GA; dapo: the accumulation
    window's tokens per process (`num_items_in_batch` / processes, x GA / `steps_per_generation` in training).
    accumulation: GA in training, 1 in evaluation; steps_per_generation: None in evaluation.
    """
    B = mask.shape[0]
    ga = float(accumulation)
    mask = mask.to(torch.float64)
    if loss_type == "grpo":
        return mask.sum(-1).clamp(min=1.0) * (B * ga)
    if loss_type == "bnpo":
        n = mask.sum().clamp(min=1.0) * ga
    elif loss_type == "dr_grpo":
        n = torch.tensor(float(B * max_completion_length) * ga, dtype=torch.float64, device=mask.device)
    elif loss_type == "dapo":
        n = num_items_in_batch.to(torch.float64).clamp(min=1.0) / num_processes
        if steps_per_generation is not None:
            n = n * accumulation / steps_per_generation
    else:  # pragma: no cover - rejected by ISOPOConfig
        raise ValueError(f"unsupported loss_type {loss_type!r}")
    return n.to(mask.device).expand(B)
