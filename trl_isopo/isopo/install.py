"""Installing a per-layer backward (ISOPO's, PROMA's) on a trainer's model: which modules it covers, what the other
trainable parameters and the LM head get (`<method>_other_params`, `<method>_lm_head`), and the coverage the trainer
reports."""

from __future__ import annotations

import torch
from transformers.utils import logging

from .backward import coverable_linears
from .other_params import other_trainable_modules
from .support import check_vanilla_lora

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
