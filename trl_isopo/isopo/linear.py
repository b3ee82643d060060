"""The per-layer mechanism: an `autograd.Function` around `F.linear` whose backward returns the ordinary input
gradient and the ISOPO weight gradient directly (`isopo-spec.md` §4, `trl-integration.md` §5.2).

Nothing edits `.grad` after the fact: gradient accumulation, DDP's bucketed all-reduce, checkpoint recompute and the
optimizer see the ISOPO gradient exactly as they would see an ordinary one.
"""

from __future__ import annotations

import types
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from .ema import EMAStatistics
from .reweight import (
    fisher_norm,
    interacting_coefficients,
    isopo_sequence_scales,
    isopo_sequence_weights,
    relative_overlap,
)
from .routes import DEFAULT_BUDGET_BYTES, Scratch, reweighted_weight_grad, sequence_statistics


@dataclass(frozen=True)
class ISOPOSettings:
    """The math knobs (see `ISOPOConfig` for their documentation)."""

    p: float = -1.0
    q: float = 0.0
    r: float = 0.0
    reg: float = 1.0
    ema_decay: float = 0.9
    fisher_tokens: int = 250
    interacting: bool = False
    interacting_reg: float = 1.0
    route: str = "auto"
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    seed: int = 0

    @property
    def needs_fisher(self) -> bool:
        return not self.interacting and (self.p != 0 or self.r != 0)


@dataclass(frozen=True)
class MicroBatch:
    """What one micro-batch's backward needs, bound to each Function call at forward time (immutable).

    mask: (B, L) bool, valid (non-padding) positions of prompt + completion: a sequence's tokens T_i.
    advantages: (B,) per-sequence advantages A_i.
    seed: seeds the Fisher token samples of this micro-batch (one stream per layer).
    logits_to_keep: completion length C (the fused LM head scores the last C positions).
    """

    mask: torch.Tensor
    advantages: torch.Tensor
    seed: int = 0
    logits_to_keep: int = 0
    valid_index: torch.Tensor | None = None  # flat indices of valid positions (computed once, not per layer)

    def __post_init__(self):
        if self.valid_index is None:
            object.__setattr__(self, "valid_index", self.mask.reshape(-1).nonzero().squeeze(1))


@dataclass
class ISOPOContext:
    """Shared state of one trainer: settings, EMA statistics, the active micro-batch and per-step metrics."""

    settings: ISOPOSettings
    ema: EMAStatistics = None
    active: bool = False
    micro_batch: MicroBatch | None = None
    layer_index: dict = field(default_factory=dict)
    # Test hooks: a fixed Fisher sample per layer, or weights forced to a value (e.g. all ones).
    sample_override: dict | None = None
    weight_override: object = None
    metrics: dict = field(default_factory=lambda: defaultdict(list))
    # The last masked, upcast layer input (masked only where X is the narrower operand): layers that read the same
    # input, e.g. gate/up, reuse one copy. Cleared with the micro-batch.
    _input_cache: tuple | None = None
    scratch: Scratch = field(default_factory=Scratch)

    def masked_input(self, x: torch.Tensor, mb: MicroBatch, dt: torch.dtype) -> torch.Tensor:
        key = (x.data_ptr(), x._version, tuple(x.shape), x.dtype, id(mb))
        if self._input_cache is not None and self._input_cache[0] == key:
            return self._input_cache[1]
        X = torch.where(mb.mask.unsqueeze(-1), x.to(dt), 0.0)  # `where`, not a product: pad rows may hold NaN
        self._input_cache = (key, X)
        return X

    def clear(self) -> None:
        self.micro_batch = None
        self._input_cache = None
        self.scratch.clear()

    def __post_init__(self):
        if self.ema is None:
            self.ema = EMAStatistics(self.settings.ema_decay)

    def fisher_sample(self, name: str, mb: MicroBatch) -> torch.Tensor:
        """Flat indices (into B*L) of J: uniform without replacement among valid positions, |J| = min(k, N).

        Fresh per layer and micro-batch, from a CPU generator seeded by (micro-batch seed, layer index), so runs
        are reproducible and independent of the global RNG.
        """
        valid = mb.valid_index
        if self.sample_override is not None:
            return self.sample_override[name].to(valid.device)
        k = self.settings.fisher_tokens
        if k <= 0 or k >= valid.numel():
            return valid
        gen = torch.Generator().manual_seed((mb.seed * 1_000_003 + 7919 * self.layer_index.get(name, 0)) % (2**63))
        return valid[torch.randperm(valid.numel(), generator=gen)[:k].to(valid.device, non_blocking=True)]

    def layer_grads(self, name: str, x: torch.Tensor, g: torch.Tensor, mb: MicroBatch, has_bias: bool):
        """ISOPO weight (and bias) gradient of layer `name`. x: (B, L, d_in), g: (B, L, d_out)."""
        s = self.settings
        if x.shape[:2] != mb.mask.shape:
            raise RuntimeError(
                f"ISOPO layer {name} saw inputs of shape {tuple(x.shape)} but the micro-batch mask is "
                f"{tuple(mb.mask.shape)}: ISOPO needs inputs laid out as (batch, sequence) rows of the text tokens. "
                "Packed / padding-free inputs, vision towers and MoE experts (which see flattened tokens) are not "
                "supported: freeze those modules or exclude them from the LoRA target_modules."
            )
        dt = torch.float64 if x.dtype == torch.float64 else torch.float32
        # Padding is dropped by zeroing one operand's rows (routes.py): the narrower one, X on a tie (its masked copy
        # is shared by the layers reading the same input). Autograd's G^T X needs the other finite at padding too.
        if x.shape[-1] <= g.shape[-1]:
            X, G = self.masked_input(x, mb, dt), g.to(dt)
        else:
            X, G = x.to(dt), torch.where(mb.mask.unsqueeze(-1), g.to(dt), 0.0)
        A = mb.advantages.to(device=X.device, dtype=dt)
        sample = self.fisher_sample(name, mb) if s.needs_fisher else None
        stats = sequence_statistics(
            X, G, sample, s.needs_fisher, s.interacting, s.route, s.budget_bytes, has_bias, mb.mask, self.scratch
        )
        e = stats.e2.clamp_min(0).sqrt()
        live = stats.e2 > 0  # sequences with a nonzero gradient in this layer (metrics ignore the others)
        metrics = self.metrics
        metrics["euclidean_norm"].append(e.mean())  # tensors: no host sync in backward; reduced per step
        if s.interacting:
            mean_eig = stats.e2.mean()  # trace(K) / B
            lam = s.interacting_reg * self.ema.mu(name, "ntk", mean_eig)
            w = interacting_coefficients(stats.ntk, A, lam).to(dt)
            self.ema.accumulate(name, "ntk", mean_eig.reshape(1))
            metrics["ntk_lambda"].append(torch.as_tensor(lam, dtype=dt, device=X.device))
            ratio = w / torch.where(A != 0, A, 1.0)  # alpha_i / A_i; 1 = REINFORCE
            keep = live & (A != 0)
        else:
            f = fisher_norm(stats.fisher_num, stats.fisher_den) if s.needs_fisher else None
            rho = relative_overlap(f, e) if s.r != 0 else None
            used = {"e": (e, s.q), "f": (f, s.p), "rho": (rho, s.r)}
            mu = {k: self.ema.mu(name, k, v * v) for k, (v, ex) in used.items() if ex != 0}
            ratio = isopo_sequence_scales(e, f, rho, mu, s.p, s.q, s.r, s.reg)
            w = isopo_sequence_weights(A, ratio)
            for k, (v, ex) in used.items():
                if ex != 0:
                    self.ema.accumulate(name, k, v * v)
            if f is not None:
                metrics["fisher_norm"].append(f.mean())
            if rho is not None:
                metrics["rel_overlap"].append(rho.mean())
            keep = live
        n_keep = keep.sum().clamp_min(1)
        mean = torch.where(keep, ratio, 0.0).sum() / n_keep
        metrics["scale_mean"].append(mean)
        metrics["scale_std"].append((torch.where(keep, (ratio - mean) ** 2, 0.0).sum() / n_keep).sqrt())
        if self.weight_override is not None:
            w = self.weight_override(name, A).to(dt)
        # A non-finite coefficient (overflowing statistics) drops that sequence from this layer, never the run.
        finite = torch.isfinite(w)
        metrics["nonfinite_coefficients"].append((~finite).sum().to(dt))
        w = torch.where(finite, w, 0.0)
        gw, gb = reweighted_weight_grad(X, G, w, stats)
        return gw, (gb if has_bias else None)


class ISOPOLinearFunction(torch.autograd.Function):
    """y = x W^T + b; backward: grad_x = g W (unchanged), grad_W = ISOPO gradient, grad_b = re-weighted bias grad."""

    @staticmethod
    def forward(ctx, x, weight, bias, context: ISOPOContext, name: str, mb: MicroBatch):
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            # A custom Function is not autocast-aware: cast like autocast would, then run without it.
            dtype = torch.get_autocast_dtype(device_type)
            x, weight_c = x.to(dtype), weight.to(dtype)
            bias_c = bias.to(dtype) if bias is not None else None
            with torch.autocast(device_type, enabled=False):
                out = F.linear(x, weight_c, bias_c)
        else:
            weight_c = weight
            out = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight_c)
        ctx.context, ctx.name, ctx.mb = context, name, mb
        ctx.has_bias = bias is not None
        ctx.param_dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        grad_x = g.to(weight.dtype) @ weight if ctx.needs_input_grad[0] else None
        grad_w = grad_b = None
        if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
            gw, gb = ctx.context.layer_grads(ctx.name, x, g, ctx.mb, ctx.has_bias)
            grad_w = gw.to(ctx.param_dtypes[0]) if ctx.needs_input_grad[1] else None
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = gb.to(ctx.param_dtypes[1])
        return grad_x, grad_w, grad_b, None, None, None


def _isopo_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    context: ISOPOContext = self._isopo_context
    mb = context.micro_batch
    if context.active and mb is not None and torch.is_grad_enabled() and self.weight.requires_grad:
        return ISOPOLinearFunction.apply(x, self.weight, self.bias, context, self._isopo_name, mb)
    return F.linear(x, self.weight, self.bias)


def install_isopo_linears(model: nn.Module, context: ISOPOContext, exclude: set[int] = frozenset()) -> list[str]:
    """Route every trainable `nn.Linear` of `model` (not in `exclude`, by id) through the ISOPO Function.

    Only the instance's `forward` is replaced, so DDP / FSDP2 wrappers that hold the same module objects keep working.
    Returns the covered module names (stable: used as EMA keys).
    """
    names = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and module.weight.requires_grad and id(module) not in exclude:
            if "forward" in module.__dict__:
                raise ValueError(
                    f"{name} already has an instance-level forward (e.g. accelerate's device_map offload hooks), which "
                    "ISOPO would replace. Load the model without offloading (no device_map='auto' with CPU/disk "
                    "offload) for ISOPO training."
                )
            module._isopo_context = context
            module._isopo_name = name
            module.forward = types.MethodType(_isopo_linear_forward, module)
            context.layer_index[name] = len(names)
            names.append(name)
    return names


def uninstall_isopo_linears(model: nn.Module) -> None:
    for module in model.modules():
        if getattr(module, "_isopo_context", None) is not None:
            del module.forward
            module._isopo_context = None
