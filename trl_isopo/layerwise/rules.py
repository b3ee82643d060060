"""The GRPOConfig rules shared by the methods that train on the advantage-free surrogate (ISOPO, PROMA).

Their loss is GRPO's with advantages 1 and no importance ratio (`layerwise/surrogate.py`), and each covered layer's
gradient is built inside the backward by the method's own autograd Function. So every GRPOConfig option that acts on
the ratio, the clip or the loss's per-token weights has nothing to act on, and the options that bypass or compile
`nn.Linear.forward` would bypass the method: each is refused here, once, with what to change. The one difference
between the methods is passed in: whether the method takes TRL's entropy bonus (ISOPO does, as an ordinary gradient
beside its own; PROMA does not).
"""

from __future__ import annotations

from trl import GRPOConfig

# GRPO's loss normalizations; the ratio transforms (cispo, sapo, vespo, luspo) have no ratio to transform here.
SURROGATE_LOSS_TYPES = ("bnpo", "grpo", "dr_grpo", "dapo")


def surrogate_config_errors(args, method: str, entropy_bonus: bool) -> list[str]:
    """What is wrong with `args` (a GRPOConfig subclass) for `method` ("ISOPO", "PROMA"), one message per problem,
    each naming the option and what to set it to. `entropy_bonus`: whether the method supports TRL's entropy bonus
    (`entropy_coef`, `use_adaptive_entropy`, `top_entropy_quantile`)."""
    errors = []
    if args.loss_type not in SURROGATE_LOSS_TYPES:
        errors.append(f"loss_type={args.loss_type!r} is a ratio transform {method} does not use; choose a "
                      f"normalization from {SURROGATE_LOSS_TYPES} (default 'bnpo', the reference's token mean).")
    if args.beta < 0.0:
        errors.append(f"beta (the KL-to-reference coefficient) must be >= 0 (got {args.beta}).")
    if args.beta != 0.0 and args.gradient_checkpointing and (args.gradient_checkpointing_kwargs or {}).get(
            "use_reentrant"):
        errors.append("beta > 0 back-propagates the KL term in a separate torch.autograd.grad pass, which reentrant "
                      "gradient checkpointing does not support: set gradient_checkpointing_kwargs="
                      "{'use_reentrant': False}.")
    for name in ("epsilon", "epsilon_high"):
        default = GRPOConfig.__dataclass_fields__[name].default
        if getattr(args, name) != default:
            errors.append(f"{name}={getattr(args, name)!r} has no effect: {method} does not clip (it has no importance "
                          f"ratio). Leave it at its default ({default!r}).")
    if args.delta is not None:
        errors.append(f"{method} has no importance ratio to clip: set delta=None.")
    if args.importance_sampling_level != "token":
        errors.append(f"importance_sampling_level='sequence' would turn {method}'s seed into a per-sequence token "
                      f"mean; {method} has no ratio: leave it at 'token' and pick the normalization with loss_type.")
    if args.off_policy_mask_threshold is not None:
        errors.append(f"{method} has no pi_old ratio to mask: set off_policy_mask_threshold=None.")
    if args.use_vllm and args.vllm_importance_sampling_correction:
        errors.append(f"vllm_importance_sampling_correction=True is not supported: {method} has no importance ratio "
                      "for the correction's weight (log-probs are recomputed by the training model). Leave it at "
                      f"its {method} default, False.")
    if not entropy_bonus and (args.entropy_coef != 0.0 or args.use_adaptive_entropy):
        errors.append(f"{method} does not support an entropy bonus: set entropy_coef=0 and use_adaptive_entropy=False.")
    if not entropy_bonus and args.top_entropy_quantile < 1.0:
        errors.append(f"{method} does not support top_entropy_quantile < 1: set it to 1.0.")
    if args.fp16:
        errors.append(f"fp16 uses a GradScaler, whose scale would reach {method}'s per-layer rule inside the backward "
                      "before it is unscaled: use bf16=True or full precision.")
    if args.torch_compile:
        errors.append(f"{method}'s per-layer autograd Function does not compile: set torch_compile=False.")
    if args.use_liger_kernel:
        errors.append(f"Liger kernels may bypass nn.Linear.forward, which {method} hooks: set use_liger_kernel=False.")
    return errors
