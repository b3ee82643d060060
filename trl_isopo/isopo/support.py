"""Set-ups a per-layer method (ISOPO, PROMA) refuses, checked when the trainer is built: shardings its per-layer
backward cannot see whole weights under, and LoRA variants whose adapters bypass the covered linears."""

from __future__ import annotations

import torch.nn as nn

from ..layerwise.method import MethodName


def unsupported_sharding(
    method: MethodName, fsdp: bool, fsdp2: bool, zero_stage: int, beta: float, extra_terms: tuple[str, ...] = ()
) -> str | None:
    """Why `method` cannot run under this sharding (the error message), or None.

    The per-layer backward needs the whole weight inside the module's forward and backward: FSDP2 and ZeRO-1/2
    give that (FSDP2 all-gathers around each sharded module; ZeRO-1/2 keep full weights), FSDP1's flat parameters and
    ZeRO-3's gathering outside the module are not supported. beta > 0 adds the KL gradient by a second autograd pass
    inside the loss and parameter hooks: not adapted to FSDP2's sharded parameters yet, and under ZeRO-1/2 the pass
    sets off DeepSpeed's end-of-backward gradient reduction with nothing accumulated (DeepSpeed 0.19.8:
    IndexError in `reduce_ipg_grads`; tests/test_isopo_zero2.py). `extra_terms` names the other terms that take the
    same pass (the entropy bonus, a MoE router aux loss): the same limits apply."""
    if (fsdp and not fsdp2) or zero_stage == 3:
        return (
            f"{method.title} supports one process, DDP, DeepSpeed ZeRO-1/2 and FSDP2. FSDP1 (flat parameters) and "
            f"ZeRO-3 gather weights outside the module's forward, where {method.title}'s per-layer backward runs, "
            "and are not supported: use FSDP2 (fsdp_version: 2, recipes/accelerate/fsdp2.yaml), DDP or ZeRO-1/2."
        )
    terms = (["beta > 0 (the KL term)"] if beta != 0.0 else []) + list(extra_terms)
    if not terms:
        return None
    named = " and ".join(terms)
    if fsdp2:
        return (
            f"{method.title} with {named} adds that gradient through parameter hooks, not supported under FSDP2 "
            "yet: remove it (beta=0, entropy_coef=0 and use_adaptive_entropy=False, router_aux_loss_coef=0) or use DDP."
        )
    if zero_stage in (1, 2):
        return (
            f"{method.title} with {named} computes that gradient with a second autograd pass inside the loss, which "
            "DeepSpeed ZeRO-1/2 takes for the end of the backward (its gradient reduction then fails): remove it "
            "(beta=0, entropy_coef=0 and use_adaptive_entropy=False, router_aux_loss_coef=0) or use DDP."
        )
    return None


def check_vanilla_lora(model: nn.Module, method: MethodName) -> None:
    """The per-layer backward wraps lora_A / lora_B as plain linears: DoRA, other variants and merged adapters bypass
    them. `method` names the method in the error."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # pragma: no cover - peft is a dependency
        return
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        if any(getattr(module, "use_dora", {}).values()):
            raise ValueError(f"{method.title} supports vanilla LoRA only; {name} uses DoRA (set use_dora=False).")
        if getattr(module, "merged", False):
            raise ValueError(f"{method.title} needs unmerged LoRA adapters; {name} is merged (call unmerge_adapter()).")
        variants = getattr(module, "lora_variant", {}) or {}
        if any(v is not None for v in variants.values()):
            raise ValueError(f"{method.title} supports vanilla LoRA only; {name} uses a LoRA variant ({variants}).")
