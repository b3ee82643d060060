"""`ISOPOConfig`: GRPOConfig plus the ISOPO knobs (paper arXiv 2512.23353; `docs/isopo.md`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from ..layerwise.costs import ROUTES
from ..layerwise.other_params import OTHER_PARAMS_MODES
from ..layerwise.rules import SURROGATE_LOSS_TYPES, surrogate_config_errors
from .isopo_backward import ISOPOSettings
from .reweight import REG_REFERENCES


@dataclass
class ISOPOConfig(GRPOConfig):
    r"""
    Configuration class for [`ISOPOTrainer`] (Isometric Policy Optimization, arXiv 2512.23353).

    Inherits every [`~trl.GRPOConfig`] field. ISOPO has no pi_old and no clipping: `epsilon`, `epsilon_high`, `delta`
    and `importance_sampling_level` play no role. Per covered linear layer and micro-batch, sequence i's gradient V_i of
    the advantage-free surrogate is re-weighted by

        A_i * R(f_i)^p * R(e_i)^q * R(f_i / e_i)^r,       R(x) = sqrt(x^2 / (c * mu_x) + 1)  (c > 0),  |x|  (c = 0),

    with f_i its Fisher-norm estimate, e_i its Euclidean norm and mu_x a reference point for x^2 (by default an EMA of
    the batch mean of x^2, see `isopo_reg_reference`). For c > 0 the statistics are taken of the un-normalized
    per-sequence gradients (times the loss normalizer) and there is no absolute guard, so the coefficients do not
    depend on the token count, gradient accumulation, process count, loss_type or any constant factor on V. With
    `isopo_interacting=True` the coefficients are lam (K + lam I)^-1 A instead, K_ik = <V_i, V_k>.

    `beta > 0` adds TRL's k3 KL-to-reference term (as GRPO computes it) as an ordinary gradient, not re-weighted by
    ISOPO: it costs one extra backward pass over the same forward graph (no second forward) and one gradient-sized
    buffer. TRL's entropy bonus (`entropy_coef`, `use_adaptive_entropy`) and a MoE model's router aux loss
    (`router_aux_loss_coef`) are added the same way, in that same pass. `top_entropy_quantile < 1` restricts the
    advantage-free seed, hence every per-sequence gradient V_i, to the high-entropy tokens (GRPO's token mask).

    Batch semantics (docs/isopo.md, "Batch semantics"): as with GRPO's loss types, the optimizer step's update does
    not depend on how its sequences are split over processes and micro-batches. For c = 0 the coefficients are
    multiplied by N^(p+q), N the sequences per process and optimizer step, which makes the update the mean over the
    step's sequences for the named settings; c > 0 keeps the loss normalization of `loss_type`. The Fisher estimate
    (token sample J) and the interacting variant's kernel K are per micro-batch (like the reference), so these depend
    on which sequences share a micro-batch.

    Several optimizer steps per rollout (`steps_per_generation` > `gradient_accumulation_steps`, or `num_iterations`
    > 1, each rollout then passed over `num_iterations` times): every pass recomputes the per-sequence gradients at
    the current policy, with no importance ratio (ISOPO has no pi_old); TRL's no-grad forward for
    `old_per_token_logps` is skipped unless the KL term's bias correction (`beta > 0`, `use_bias_correction_kl`)
    reads it.

    Parameters:
        isopo_p (`float`, *optional*, defaults to `-1.0`):
            Exponent p of the Fisher norm (paper: "Fisher normalization, p=-1").
        isopo_q (`float`, *optional*, defaults to `0.0`):
            Exponent q of the Euclidean norm (paper: "q=-1").
        isopo_r (`float`, *optional*, defaults to `0.0`):
            Exponent r of the ratio Fisher / Euclidean (paper Fig. 6: p=0, q=-1, r=-2 with c=0).
        isopo_reg (`float`, *optional*, defaults to `0.0`):
            Regularization factor c ("keep small invariant"). `0` (default) gives pure normalization R(x) = |x|: each
            sequence's layer gradient is divided by its norm. The reference implementation's c = 1 with the
            `"ema_mean"` reference point makes R ~ 1 for almost every sequence, i.e. numerically REINFORCE on the
            toy task (0 of 4 seeds solved against 2 of 4 for c = 0; docs/isopo-regularizer.md).
        isopo_reg_reference (`str`, *optional*, defaults to `"ema_mean"`):
            The reference point mu_x of the regularizer (c > 0), per layer and statistic: `"ema_mean"` (the
            reference implementation's rule: EMA over previous optimizer steps of the step mean of x^2; each sequence's
            own x^2 on the first step), `"ema_median"` (EMA over previous steps of the step's median of x^2, robust to
            a few large-norm sequences; the current micro-batch's median on the first step) or `"batch_median"` (the
            current micro-batch's median of x^2, no history). Medians are over sequences with a nonzero gradient in
            the layer.
        isopo_reg_ema_decay (`float`, *optional*, defaults to `0.9`):
            Decay of the EMA over previous optimizer steps (reference points `"ema_mean"` and `"ema_median"`).
        isopo_fisher_tokens (`int`, *optional*, defaults to `250`):
            Size of the token sample J of the Fisher estimate, drawn from all valid positions of the micro-batch;
            `0` uses all tokens. Seeded from `seed`, the process index and the step, so runs are reproducible.
        isopo_other_params (`str`, *optional*, defaults to `"advantage_weighted"`):
            What trainable parameters outside the covered linear weights receive: `"advantage_weighted"` (the
            ordinary REINFORCE gradient), `"surrogate"` (the reference's advantage-free gradient of -log pi) or
            `"frozen"` (no update). Biases of covered layers are re-weighted like their weights.
        isopo_lm_head (`bool`, *optional*, defaults to `False`):
            Also transform the LM head's weight gradient with ISOPO, like a covered linear layer (the reference
            implementation does; its statistics are accumulated over TRL's fused vocabulary tiles, about one more head
            GEMM per micro-batch). Needs a trainable head (full fine-tuning). Off, the head follows
            `isopo_other_params`. A head tied to the input embedding also receives the embedding's gradient.
        isopo_interacting (`bool`, *optional*, defaults to `False`):
            Use the interacting (layer-wise MinSR-like) variant.
        isopo_interacting_reg (`float`, *optional*, defaults to `1.0`):
            Factor c_K of lam = c_K * EMA(mean eigenvalue of K).
        isopo_route (`str`, *optional*, defaults to `"auto"`):
            How per-sequence statistics are computed: `"gram"` (token Gram matrices), `"mat"` (materialized
            per-sequence gradients, chunked) or `"auto"` (cheaper in FLOPs per layer and shape). Results agree to
            float rounding.
        isopo_chunk_mb (`float`, *optional*, defaults to `256`):
            Memory budget (MiB) for any intermediate of the statistics (Gram row blocks, per-sequence gradients).
        loss_type (`str`, *optional*, defaults to `"bnpo"`):
            Selects only the normalization of the advantage-free surrogate: one of "bnpo" (token mean over the
            micro-batch, the reference's), "grpo", "dr_grpo", "dapo".
    """

    isopo_p: float = field(default=-1.0, metadata={"help": "Exponent p of the Fisher norm (paper's p; -1 = Fisher normalization)."})
    isopo_q: float = field(default=0.0, metadata={"help": "Exponent q of the Euclidean norm (paper's q)."})
    isopo_r: float = field(default=0.0, metadata={"help": "Exponent r of the Fisher/Euclidean ratio (paper's r)."})
    isopo_reg: float = field(
        default=0.0,
        metadata={
            "help": "Regularization factor c in R(x) = sqrt(x^2/(c*mu_x) + 1); 0 (default) = pure normalization |x|; "
            "1 with isopo_reg_reference='ema_mean' is the reference implementation's rule."
        },
    )
    isopo_reg_reference: str = field(
        default="ema_mean",
        metadata={
            "help": "Reference point mu_x of the regularizer: ema_mean (EMA of the step mean of x^2, the reference "
            "implementation's), ema_median (EMA of the step median) or batch_median (the micro-batch median).",
            "choices": list(REG_REFERENCES),
        },
    )
    isopo_reg_ema_decay: float = field(
        default=0.9, metadata={"help": "EMA decay (over optimizer steps) of the statistic used as mu_x."}
    )
    isopo_fisher_tokens: int = field(
        default=250, metadata={"help": "Token sample size |J| for the Fisher-norm estimate; 0 = all tokens."}
    )
    isopo_other_params: str = field(
        default="advantage_weighted",
        metadata={
            "help": "Gradient for trainable parameters outside covered linear weights.",
            "choices": list(OTHER_PARAMS_MODES),
        },
    )
    isopo_lm_head: bool = field(
        default=False,
        metadata={"help": "Transform the LM head's weight gradient with ISOPO too (as the reference does); needs a "
                          "trainable head. Off: the head follows isopo_other_params."},
    )
    isopo_interacting: bool = field(
        default=False, metadata={"help": "Interacting (layer-wise MinSR) variant: alpha = lam (K + lam I)^-1 A."}
    )
    isopo_interacting_reg: float = field(
        default=1.0, metadata={"help": "c_K in lam = c_K * EMA(mean eigenvalue of the per-layer kernel K)."}
    )
    isopo_route: str = field(
        default="auto",
        metadata={"help": "Statistics route: gram, mat or auto (cheapest per layer).", "choices": list(ROUTES)},
    )
    isopo_chunk_mb: float = field(
        default=256.0, metadata={"help": "Memory budget (MiB) for any chunked intermediate of the statistics."}
    )
    vllm_importance_sampling_correction: bool = field(
        default=False,
        metadata={
            "help": "Off for ISOPO (TRL's default is True): ISOPO has no importance ratio for TRL's truncated "
            "pi_train/pi_vLLM weight to act on; log-probs are recomputed by the training model. True is refused."
        },
    )
    loss_type: str = field(
        default="bnpo",
        metadata={
            "help": "Normalization of the advantage-free surrogate (ISOPO has no ratio or clipping).",
            "choices": list(SURROGATE_LOSS_TYPES),
        },
    )

    def __post_init__(self):
        super().__post_init__()
        errors = []
        if self.isopo_reg < 0:
            errors.append(f"isopo_reg must be >= 0 (got {self.isopo_reg}).")
        if self.isopo_reg_reference not in REG_REFERENCES:
            errors.append(f"isopo_reg_reference must be one of {REG_REFERENCES} (got {self.isopo_reg_reference!r}).")
        if not 0.0 <= self.isopo_reg_ema_decay < 1.0:
            errors.append(f"isopo_reg_ema_decay must be in [0, 1) (got {self.isopo_reg_ema_decay}).")
        if self.isopo_fisher_tokens < 0:
            errors.append(f"isopo_fisher_tokens must be >= 0 (0 = all tokens), got {self.isopo_fisher_tokens}.")
        if self.isopo_other_params not in OTHER_PARAMS_MODES:
            errors.append(f"isopo_other_params must be one of {OTHER_PARAMS_MODES} (got {self.isopo_other_params!r}).")
        if self.isopo_route not in ROUTES:
            errors.append(f"isopo_route must be one of {ROUTES} (got {self.isopo_route!r}).")
        if self.isopo_chunk_mb <= 0:
            errors.append(f"isopo_chunk_mb must be > 0 (got {self.isopo_chunk_mb}).")
        if self.isopo_interacting:
            if self.isopo_interacting_reg <= 0:
                errors.append(f"isopo_interacting_reg must be > 0 (got {self.isopo_interacting_reg}).")
            if self.isopo_q != 0 or self.isopo_r != 0 or self.isopo_p not in (-1.0, 0.0):
                errors.append(
                    "isopo_p / isopo_q / isopo_r do not apply to the interacting variant; leave them at their "
                    "defaults or set isopo_interacting=False."
                )
        errors += surrogate_config_errors(self, "ISOPO", entropy_bonus=True)
        if errors:
            raise ValueError("Invalid ISOPOConfig:\n- " + "\n- ".join(errors))

    def isopo_settings(self) -> ISOPOSettings:
        """The math knobs as the per-layer functions take them (the one place they are built from a config)."""
        return ISOPOSettings(
            p=self.isopo_p, q=self.isopo_q, r=self.isopo_r, reg=self.isopo_reg, reg_reference=self.isopo_reg_reference,
            ema_decay=self.isopo_reg_ema_decay, fisher_tokens=self.isopo_fisher_tokens,
            interacting=self.isopo_interacting, interacting_reg=self.isopo_interacting_reg, route=self.isopo_route,
            budget_bytes=int(self.isopo_chunk_mb * 2**20), seed=self.seed, force_half_operands=False,
        )
