"""Optimizers for the lab: the paper's Muon/AdamW routing, or plain AdamW.

Paper routing (arXiv 2604.06159 §3; reference code: `optax.contrib.muon(lr=1e-3)`): Muon (momentum 0.95, Nesterov, 5
Newton-Schulz steps with coefficients (3.4445, -4.775, 2.0315), weight decay 0) on every 2-D leaf of the Flax model,
AdamW (0.9, 0.999, eps 1e-8, wd 0) on the rest. In Flax the attention q/k/v/out kernels are 3-D, so they get AdamW;
token and positional embeddings, MLP and head matrices get Muon. We copy that routing onto the torch model by name.

Muon's shape scale: optax scales the update by sqrt(max(1, out/in)) with Flax's (in, out) kernels; torch.optim.Muon
uses sqrt(max(1, rows/cols)). For `nn.Linear` (out, in) both agree. For embeddings, Flax's (num, features) table is
scaled by sqrt(max(1, features/num)) while torch would give 1, so we put each embedding in its own group with the lr
multiplied by that factor. Differences we keep: torch's Newton-Schulz runs in bfloat16 (optax in the input dtype),
optax's Adam part uses Nesterov momentum (torch AdamW has none).
"""

from __future__ import annotations

import math

import torch
from torch import nn

OPTIMIZERS = ("muon", "adamw")

# Matrices that are 3-D (heads x ...) kernels in the reference Flax model and therefore get AdamW there.
_ATTENTION_NAMES = ("attn", "self_attn")


def muon_param_groups(model: nn.Module, lr: float, embedding_rows: dict | None = None) -> tuple[list[dict], list[dict]]:
    """Split trainable parameters into (Muon groups, AdamW groups) following the paper's routing.

    Muon: 2-D weights outside attention (MLP, head) at `lr`; each embedding table in its own group at
    `lr * sqrt(max(1, features / rows))`, rows = `embedding_rows[name]` if given (the rows the reference model has,
    e.g. V symbols without our special tokens) else the table's size. AdamW: attention matrices, biases, LayerNorms.
    """
    embedding_rows = embedding_rows or {}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    muon_plain, adam = [], []
    muon_groups = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        is_attention = any(f".{a}." in f".{name}" for a in _ATTENTION_NAMES)
        if p.ndim == 2 and id(p) in embeddings:
            num, features = embedding_rows.get(name, p.shape[0]), p.shape[1]
            muon_groups.append({"params": [p], "lr": lr * math.sqrt(max(1.0, features / num)), "name": name})
        elif p.ndim == 2 and not is_attention:
            muon_plain.append(p)
        else:
            adam.append(p)
    if muon_plain:
        muon_groups.insert(0, {"params": muon_plain, "lr": lr})
    return muon_groups, [{"params": adam, "lr": lr}] if adam else []


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer object holding a `torch.optim.Muon` and a `torch.optim.AdamW` (what HF Trainer expects).

    `param_groups` is the concatenation of the inner optimizers' groups (the same dicts), so LR schedulers act on both.
    """

    def __init__(self, muon_groups, adam_groups, muon_kwargs=None, adam_kwargs=None):
        self.muon = torch.optim.Muon(muon_groups, **(muon_kwargs or {})) if muon_groups else None
        self.adamw = torch.optim.AdamW(adam_groups, **(adam_kwargs or {})) if adam_groups else None
        inner = [o for o in (self.muon, self.adamw) if o is not None]
        super().__init__([p for o in inner for g in o.param_groups for p in g["params"]], {})
        self.param_groups = [g for o in inner for g in o.param_groups]
        self._inner = inner

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for o in self._inner:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for o in self._inner:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"inner": [o.state_dict() for o in self._inner]}

    def load_state_dict(self, state_dict):
        for o, s in zip(self._inner, state_dict["inner"]):
            o.load_state_dict(s)


def _reference_embedding_rows(model: nn.Module) -> dict:
    """Rows of the reference model's embedding tables for a lab model: V symbols (not our specials) and 2H positions."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "trl_isopo_lab":
        return {}
    return {
        "transformer.wte.weight": len(config.allowed_token_ids),
        "transformer.wpe.weight": config.n_positions,
    }


def build_optimizer(model: nn.Module, name: str = "muon", lr: float = 1e-3) -> torch.optim.Optimizer:
    """The lab optimizer: "muon" = the paper's routing (Muon + AdamW, wd 0), "adamw" = AdamW (wd 0) on everything."""
    adam_kwargs = {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    if name == "adamw":
        return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], **adam_kwargs)
    if name == "muon":
        muon_groups, adam_groups = muon_param_groups(model, lr, _reference_embedding_rows(model))
        muon_kwargs = {"lr": lr, "weight_decay": 0.0, "momentum": 0.95, "nesterov": True, "ns_steps": 5}
        return MuonAdamW(muon_groups, adam_groups, muon_kwargs, adam_kwargs)
    raise ValueError(f"unknown optimizer {name!r}; choose from {OPTIMIZERS}")
