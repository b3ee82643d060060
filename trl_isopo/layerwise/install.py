"""Installing a per-layer backward (ISOPO's, PROMA's) on a trainer's model: which modules it covers, what the other
trainable parameters and the LM head get (`<method>_other_params`, `<method>_lm_head`), and the coverage the trainer
reports."""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers.utils import logging

from .engine import coverable_linears
from .rule import MethodName
from .other_params import other_trainable_modules

logger = logging.get_logger(__name__)


def install_layerwise(backward, model: torch.nn.Module, *, other_params: str, lm_head: bool,
                      gradient_checkpointing: bool) -> dict:
    """Install `backward` (a `LayerBackward`: ISOPO's or PROMA's) on `model`; `other_params` and `lm_head` say what the
    other trainable parameters and the LM head get (the method's `*_other_params`, `*_lm_head`); errors and coverage
    keys carry the method's name (`backward.method`). Returns the coverage: counts of covered layers / parameters
    (`<method>_layers`, `<method>_params`) and of the other trainable ones, their modes, the covered names."""
    method = backward.method
    check_vanilla_lora(model, method)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    exclude = frozenset({id(head)} if head is not None else ())
    covered_modules = [m for _, m in coverable_linears(model, exclude)]
    if not covered_modules:
        raise ValueError(
            f"{method.title} found no trainable nn.Linear in the model (other than the LM head). Unfreeze linear "
            "layers or use a LoRA peft_config."
        )
    others = other_trainable_modules(model, {id(m) for m in covered_modules}, head)
    head_trainable = head is not None and any(p.requires_grad for p in head.parameters())
    if lm_head and not head_trainable:
        flag = method.field("lm_head")
        raise ValueError(
            f"{flag}=True transforms the LM head's weight gradient, but this model's LM head has no trainable "
            f"parameter (LoRA freezes it). Train the head (full fine-tuning) or set {flag}=False."
        )
    mode = other_params
    if mode == "frozen":
        for _, module in others:
            module.requires_grad_(False)
        if head_trainable and not lm_head:
            head.requires_grad_(False)
        if gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()  # reentrant checkpointing with a frozen embedding
    head_mode = None
    if head_trainable and (lm_head or mode == "advantage_weighted"):
        head_mode = "method" if lm_head else "advantage_weighted"
    covered = backward.install(
        model, exclude=exclude, weighted=others if mode == "advantage_weighted" else (),
        head_mode=head_mode, head_name=next((n for n, m in model.named_modules() if m is head), "lm_head"),
    )  # fmt: skip
    n_cov = sum(p.numel() for m in covered_modules for p in m.parameters())
    n_other = sum(p.numel() for _, m in others for p in m.parameters(recurse=False) if p.requires_grad or mode == "frozen")
    n_head = sum(p.numel() for p in head.parameters()) if head_trainable else 0
    coverage = {
        method.field("layers"): len(covered),
        method.field("params"): n_cov,
        "other_modules": len(others) + (1 if head_trainable else 0),
        "other_params": n_other + n_head,
        "other_params_mode": mode,
        "lm_head": method.prefix if lm_head else (mode if head_trainable else "frozen"),
        "covered": covered,
    }
    logger.info(
        "%s covers %d linear layers (%d parameters); %d other trainable modules (%d parameters, incl. LM head: "
        "%s) get %s gradients.",
        method.title,
        len(covered),
        n_cov,
        coverage["other_modules"],
        coverage["other_params"],
        head_trainable,
        mode,
    )
    return coverage


# ------------------------------------------------------------------------------------------------------------------
# Set-ups a per-layer method (ISOPO, PROMA) refuses, checked when the trainer is built: shardings its per-layer
# backward cannot see whole weights under, and LoRA variants whose adapters bypass the covered linears.


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
