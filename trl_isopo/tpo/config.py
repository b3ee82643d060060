"""Configuration of the Target Policy Optimization trainer (arXiv 2604.06159)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from .grouping import validate_group_batching
from .scores import AGGREGATIONS, SCALE_REWARDS

__all__ = ["TPOConfig", "tpo_ignored_options", "tpo_unsupported_options"]

# GRPO loss knobs that have no meaning for TPO (no importance ratio, no clipping). They must stay at GRPOConfig's
# defaults so nothing is silently ignored; the value is the reason given to the user.
_GRPO_ONLY_FIELDS = {
    "epsilon": "TPO has no importance-ratio clipping",
    "epsilon_high": "TPO has no importance-ratio clipping",
    "delta": "TPO has no importance-ratio clipping",
    "importance_sampling_level": "TPO uses no importance ratio (q is frozen, log p is recomputed)",
}
# loss_type values that only choose how GRPO's per-token surrogate is averaged (per sequence, per token of the
# micro-batch, per max_completion_length). TPO has no per-token surrogate, so they are accepted with a warning.
_NORMALIZATION_ONLY_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")


def tpo_ignored_options(args) -> list[str]:
    """Warnings for options set on `args` that TPO accepts but that change nothing (empty list if none)."""
    default = GRPOConfig.__dataclass_fields__["loss_type"].default
    if args.loss_type != default and args.loss_type in _NORMALIZATION_ONLY_LOSS_TYPES:
        return [
            f"`loss_type={args.loss_type!r}` is ignored by TPO: it only changes how GRPO's per-token surrogate is "
            "averaged, and TPO's loss is a cross-entropy over each group's sequence log-probs (mean over groups). "
            "The `beta` KL term keeps TPO's per-sequence token mean."
        ]
    return []


def tpo_unsupported_options(args) -> list[str]:
    """Messages for every option set on `args` that TPO cannot honour (empty list if none)."""
    problems = []
    defaults = GRPOConfig.__dataclass_fields__
    for name, reason in _GRPO_ONLY_FIELDS.items():
        default = defaults[name].default
        value = getattr(args, name)
        if value != default:
            problems.append(f"`{name}={value!r}` is not supported: {reason}. Leave it at its default ({default!r}).")
    if args.loss_type not in _NORMALIZATION_ONLY_LOSS_TYPES:
        problems.append(
            f"`loss_type={args.loss_type!r}` is not supported: it transforms GRPO's importance ratio, which TPO does "
            f"not have (its loss is a group cross-entropy). Use one of {list(_NORMALIZATION_ONLY_LOSS_TYPES)} (all "
            "give the same TPO loss) or leave the default."
        )
    if args.scale_rewards not in SCALE_REWARDS:
        problems.append(f"`scale_rewards={args.scale_rewards!r}` must be one of {list(SCALE_REWARDS)}.")
    if args.multi_objective_aggregation not in AGGREGATIONS:
        problems.append(
            f"`multi_objective_aggregation={args.multi_objective_aggregation!r}` must be one of {list(AGGREGATIONS)}."
        )
    if args.off_policy_mask_threshold is not None:
        problems.append(
            f"`off_policy_mask_threshold={args.off_policy_mask_threshold}` is not supported: the off-policy sequence "
            "mask needs advantages and ratios that TPO does not have. Set off_policy_mask_threshold=None."
        )
    if args.use_vllm and args.vllm_importance_sampling_correction:
        problems.append(
            "`vllm_importance_sampling_correction=True` is not supported: TPO always takes p_old from the training "
            "model's recomputed log-probs and applies no importance ratio. Leave vllm_importance_sampling_correction "
            "at its TPO default, False."
        )
    return problems


@dataclass
class TPOConfig(GRPOConfig):
    r"""
    Configuration class for [`~trl_isopo.TPOTrainer`], Target Policy Optimization (TPO, Kaddour 2026,
    [arXiv 2604.06159](https://huggingface.co/papers/2604.06159)). Unrelated to TRL's *Triple* Preference
    Optimization (`trl.experimental.tpo.TPOConfig`).

    For each prompt, the K = `num_generations` completions are scored, the weighted sum of the reward functions is
    standardized within the group (u), and the policy renormalised over the group is fitted by cross-entropy to the
    target q = softmax(log p_old + u / eta). `TPOConfig` inherits every parameter of [`trl.GRPOConfig`]; only the
    fields below are new. GRPO's ratio knobs (`epsilon`, `epsilon_high`, `delta`, `importance_sampling_level`,
    ratio-transforming `loss_type`s, `off_policy_mask_threshold`, vLLM importance-sampling correction) have no TPO
    meaning and are rejected if changed; the normalization-only `loss_type`s (`grpo`, `bnpo`, `dr_grpo`) are accepted
    with a warning and change nothing. `beta` adds GRPO's k3 KL to the reference model (per-sequence token mean, mean
    over rows); `entropy_coef` / `use_adaptive_entropy` add TRL's entropy bonus; `top_entropy_quantile < 1` lets the
    policy gradient flow only through the high-entropy tokens of each l_i; `scale_rewards` and
    `multi_objective_aggregation` choose how u is formed (see docs/tpo.md, "GRPOConfig fields").

    Batch sizes: every group must stay whole in each micro-batch and on each process, so
    `per_device_train_batch_size` must be a multiple of `num_generations` (and `per_device_eval_batch_size` of
    `num_generations_eval` when evaluating). `num_iterations` > 1 reuses each rollout batch with q frozen.

    Parameters:
        tpo_eta (`float`, *optional*, defaults to `1.0`):
            Target temperature eta > 0: q is proportional to p_old * exp(u / eta). Smaller values give sharper
            targets; `float("inf")` gives q = p_old (no update). The paper finds 0.25-2 all work.
        tpo_anchor (`bool`, *optional*, defaults to `True`):
            Anchor the target on the rollout-time policy, q = softmax(log p_old + u / eta). `False` gives the paper's
            TPO-no-anchor ablation q = softmax(u / eta).
        tpo_length_normalize (`bool`, *optional*, defaults to `False`):
            How a completion's log-probability l_i is formed. `False` (the paper's eq. 3): the sum of its token
            log-probs. `True`: the per-token mean (the author's TRL port default for LLMs). Sums make p_old nearly
            one-hot on long, varied completions (a few nats per token add up), so u can barely move q; means avoid
            that but change the objective to a geometric-mean "probability" and weight every completion's tokens by
            1/length.
    """

    tpo_eta: float = field(
        default=1.0,
        metadata={
            "help": "Target temperature eta > 0: q is proportional to p_old * exp(u / eta). inf gives q = p_old."
        },
    )
    tpo_anchor: bool = field(
        default=True,
        metadata={
            "help": "Anchor the target on the rollout-time policy p_old (TPO). False: q = softmax(u / eta), the "
            "paper's TPO-no-anchor ablation."
        },
    )
    vllm_importance_sampling_correction: bool = field(
        default=False,
        metadata={
            "help": "Off for TPO (TRL's default is True): p_old is always the training model's recomputed log-probs "
            "and TPO applies no importance ratio. True is refused."
        },
    )
    tpo_length_normalize: bool = field(
        default=False,
        metadata={
            "help": "False (paper): sequence log-prob = sum of token log-probs. True: per-token mean (the author's "
            "LLM default; avoids near one-hot p_old for long completions but changes the objective)."
        },
    )

    def __post_init__(self):
        if isinstance(self.tpo_eta, bool) or not isinstance(self.tpo_eta, (int, float)):
            raise ValueError(f"tpo_eta must be a number > 0, got {self.tpo_eta!r}.")
        if math.isnan(self.tpo_eta) or self.tpo_eta <= 0:
            raise ValueError(f"tpo_eta (the target temperature eta) must be > 0, got {self.tpo_eta}.")
        self.tpo_eta = float(self.tpo_eta)
        if self.num_generations is None or self.num_generations < 2:
            raise ValueError(
                f"TPO needs num_generations >= 2 (the target is a softmax over each prompt's group of completions); "
                f"got num_generations={self.num_generations}."
            )
        super().__post_init__()
        validate_group_batching(
            self.per_device_train_batch_size,
            self.num_generations,
            self.num_generations_eval,
            self.gradient_accumulation_steps,
            self.steps_per_generation,
        )
        problems = tpo_unsupported_options(self)
        if problems:
            raise ValueError("TPOConfig: " + " ".join(problems))
        for message in tpo_ignored_options(self):
            warnings.warn("TPOConfig: " + message, UserWarning, stacklevel=2)
