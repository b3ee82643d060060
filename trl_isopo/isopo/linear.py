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
from .plain import plain_backward_active
from .layer import isopo_linear_grad, reference_point
from .reweight import REG_REFERENCES
from .routes import DEFAULT_BUDGET_BYTES, HALF_DTYPES, Scratch, matmul_f32, stat_dtype

# The stored EMA values a layer call may read (`layer.isopo_linear_grad`'s `history`).
_HISTORY_KEYS = ("e", "f", "rho", "ntk", "e@median", "f@median", "rho@median")

# Same-size integer views of the operand dtypes, for the bitwise padding fill (`MicroBatch.zero_padding`).
_BITS = {
    torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16
}


@dataclass(frozen=True)
class ISOPOSettings:
    """The math knobs (see `ISOPOConfig` for their documentation)."""

    p: float = -1.0
    q: float = 0.0
    r: float = 0.0
    reg: float = 1.0
    reg_reference: str = "ema_mean"
    ema_decay: float = 0.9
    fisher_tokens: int = 250
    interacting: bool = False
    interacting_reg: float = 1.0
    route: str = "auto"
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    seed: int = 0

    def __post_init__(self):
        if self.reg_reference not in REG_REFERENCES:
            raise ValueError(f"reg_reference must be one of {REG_REFERENCES}, got {self.reg_reference!r}")

    @property
    def needs_fisher(self) -> bool:
        return not self.interacting and (self.p != 0 or self.r != 0)

    @property
    def needs_euclidean(self) -> bool:
        """Whether e_i is computed: the math needs it (q, r, interacting: free as diag K), or no other statistic is.

        Not for p alone (the default): on wide layers (Gram route) e^2 would add ~0.6x the Fisher numerator's work.
        """
        return self.interacting or self.q != 0 or self.r != 0 or not self.needs_fisher


@dataclass(frozen=True)
class MicroBatch:
    """What one micro-batch's backward needs, bound to each Function call at forward time (immutable).

    mask: (B, L) bool, valid (non-padding) positions of prompt + completion: a sequence's tokens T_i.
    advantages: (B,) per-sequence advantages A_i.
    seed: seeds the Fisher token samples of this micro-batch (one stream per layer).
    logits_to_keep: completion length C (the fused LM head scores the last C positions).
    stat_scale: (B,) or None: the loss normalizer n_i of each sequence, i.e. the backward seed of sequence i is
        -mask / n_i (bnpo: completion tokens x GA; see `ISOPOTrainer._isopo_loss_normalizer`). The regularizer's
        statistics are multiplied by it (K by n_i n_k), so that they are those of the un-normalized per-sequence
        gradient -grad sum_t log pi: the reference point mu (an EMA over steps) is then comparable across steps
        whose token count, accumulation or loss_type differ. None = 1.
    """

    mask: torch.Tensor
    advantages: torch.Tensor
    seed: int = 0
    logits_to_keep: int = 0
    stat_scale: torch.Tensor | None = None
    # Tensors derived from the fields (cast advantages, row masks), made by the first layer that needs them. Nothing
    # here reads a tensor on the host: the backward stays free of device-host synchronizations.
    _derived: dict = field(default_factory=dict, compare=False, repr=False)

    def _cached(self, key: tuple, make):
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]

    def zero_padding(self, t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        """t (B, L, d) as a new contiguous `dt` tensor with its padding rows set to +0.

        A bitwise AND of the values' bits with a per-row mask of all ones (valid) or zeros (padding), not a product
        with the mask: padding rows may hold NaN, and valid rows keep their exact bits. Always a copy, from the
        mask alone: an index list of the padding rows (`nonzero`) or a "no padding" shortcut would read the mask on
        the host. On CPU this measured as fast as the former copy and index fill (2048 x 896 floats: 0.28 ms against
        0.44), where `torch.where` / `masked_fill` with a broadcast mask took 1.0-2.3 ms.
        """
        bits = _BITS[dt]
        keep = self._cached(  # (B, L, 1): -1 (every bit set) at valid positions, 0 at padding
            ("keep", bits, t.device), lambda: torch.where(self.mask.to(t.device), -1, 0).to(bits).unsqueeze(-1)
        )
        if t.dtype != dt:  # the cast copy is masked in place
            out = t.to(dt, memory_format=torch.contiguous_format)
            out.view(bits).bitwise_and_(keep)
            return out
        out = torch.empty(t.shape, dtype=dt, device=t.device)
        torch.bitwise_and(t.view(bits), keep, out=out.view(bits))
        return out

    def advantages_as(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The advantages (B,) in `dtype` on `device`."""
        return self._cached(("A", device, dtype), lambda: self.advantages.to(device=device, dtype=dtype))

    def stat_scale_as(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """`stat_scale` (B,) in `dtype` on `device`, or None."""
        if self.stat_scale is None:
            return None
        return self._cached(("n", device, dtype), lambda: self.stat_scale.to(device=device, dtype=dtype).reshape(-1))

    def positions(self, device: torch.device) -> torch.Tensor:
        """All B*L flat positions (B*L,): the exact Fisher estimate's "sample" (padding rows add exactly 0)."""
        return self._cached(("pos", device), lambda: torch.arange(self.mask.numel(), device=device))


def fisher_token_sample(mask: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """A Fisher token sample of fixed size min(k, B*L) for mask (B, L) bool: flat indices (S,) into B*L.

    Its valid positions are a uniform sample without replacement of min(k, N_valid) of the N_valid valid positions
    (the k smallest of i.i.d. uniform keys, padding keyed +inf); when N_valid < k, the remaining picks are padding
    positions, whose zeroed operand row adds exactly 0 to the Fisher numerator and denominator. So the estimate has
    the distribution of a sample of the valid positions alone, while nothing reads N_valid on the host. float64
    keys: ties (whose order `topk` may break unevenly) have probability ~(B L)^2 / 2^53.
    """
    keys = torch.rand(mask.numel(), generator=generator, device=mask.device, dtype=torch.float64)
    keys.masked_fill_(~mask.reshape(-1), torch.inf)
    return keys.topk(min(k, keys.numel()), largest=False, sorted=False).indices


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
    # Per covered-layer call: one (6, B) record, rows (e, f, rho, scale, A, w), reduced once per step by
    # `step_metrics` (a statistic not computed repeats another: e = f for p alone; interacting: scale = alpha).
    records: list = field(default_factory=list)
    lambdas: list = field(default_factory=list)  # interacting variant: lam per layer call
    # The last masked, upcast layer input (masked only where X is the narrower operand): layers that read the same
    # input, e.g. gate/up, reuse one copy. Cleared with the micro-batch.
    _input_cache: tuple | None = None  # (key, masked X, the input x and micro-batch the key was made from)
    scratch: Scratch = field(default_factory=Scratch)
    # ISOPO backward calls per covered layer in the current micro-batch (a dict update, no tensor op): a covered
    # layer with none while others had theirs had its weight used outside its forward (`uncovered_layers`).
    calls: dict = field(default_factory=dict)
    _generators: dict = field(default_factory=dict)  # device -> the Fisher sample's generator (re-seeded per call)

    def masked_input(self, x: torch.Tensor, mb: MicroBatch, dt: torch.dtype) -> torch.Tensor:
        # The entry keeps x and mb alive: otherwise a freed input's address (and a freed micro-batch's id) could be
        # reused by another layer's input, e.g. one recomputed by gradient checkpointing, and hit a stale copy.
        key = (x.data_ptr(), x._version, tuple(x.shape), x.stride(), x.dtype, x.device, id(mb), dt)
        if self._input_cache is not None and self._input_cache[0] == key:
            return self._input_cache[1]
        X = mb.zero_padding(x, dt)
        self._input_cache = (key, X, x, mb)
        return X

    def clear(self, keep_scratch: bool = False) -> None:
        """End of a micro-batch's backward: drop its state (and the scratch storage, unless `keep_scratch`)."""
        self.micro_batch = None
        self._input_cache = None
        self.calls = {}
        if not keep_scratch:
            self.scratch.clear()

    def __post_init__(self):
        if self.ema is None:
            self.ema = EMAStatistics(self.settings.ema_decay)

    def fisher_sample(self, name: str, mb: MicroBatch, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Flat indices (S,) into B*L of J, drawn on the mask's device (`fisher_token_sample`): uniform without
        replacement among the valid positions, |J| = min(k, N_valid), padded with padding positions to the fixed
        size S = min(k, B*L); all B*L positions (the exact estimate) for k <= 0 or k >= B*L.

        Fresh per layer and micro-batch, from a generator on the data's device seeded by (micro-batch seed, layer
        index): reproducible for a given seed and device type, independent of the global RNG, and no host-device
        copy. (CPU and CUDA generators give different, equally distributed, samples for one seed.)
        `mask`: another (B, L') pool than the micro-batch's positions (the LM head's scored positions).
        """
        if self.sample_override is not None:
            return self.sample_override[name].to(mb.mask.device)
        k = self.settings.fisher_tokens
        pool = mb.mask if mask is None else mask
        device = pool.device
        if k <= 0 or k >= pool.numel():
            return mb.positions(device) if mask is None else torch.arange(pool.numel(), device=device)
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        index = self.layer_index.get(name, len(self.layer_index))  # a module outside the covered layers: its own
        gen.manual_seed((mb.seed * 1_000_003 + 7919 * index) % (2**63))
        return fisher_token_sample(pool, k, gen)

    def uncovered_layers(self) -> list[str]:
        """Covered layers without an ISOPO backward in this micro-batch although others had one (none: [])."""
        if not self.calls:
            return []
        return [name for name in self.layer_index if name not in self.calls]

    def layer_grads(self, name: str, x: torch.Tensor, g: torch.Tensor, mb: MicroBatch, has_bias: bool):
        """ISOPO weight (and bias) gradient of layer `name`. x: (B, L, d_in), g: (B, L, d_out)."""
        self.calls[name] = self.calls.get(name, 0) + 1
        s = self.settings
        if x.shape[:2] != mb.mask.shape:
            raise RuntimeError(
                f"ISOPO layer {name} saw inputs of shape {tuple(x.shape)} but the micro-batch mask is "
                f"{tuple(mb.mask.shape)}: ISOPO needs inputs laid out as (batch, sequence) rows of the text tokens. "
                "Packed / padding-free inputs, vision towers and MoE experts (which see flattened tokens) are not "
                "supported: freeze those modules or exclude them from the LoRA target_modules."
            )
        dt, odt = _layer_dtypes(x, g)
        # Padding is dropped by zeroing one operand's rows (routes.py): the narrower one, X on a tie (its masked copy
        # is shared by the layers reading the same input). Autograd's G^T X needs the other finite at padding too.
        if x.shape[-1] <= g.shape[-1]:
            X, G = self.masked_input(x, mb, odt), g.to(odt)
        else:
            X, G = x.to(odt), mb.zero_padding(g, odt)
        A = mb.advantages_as(dt, X.device)
        sample = self.fisher_sample(name, mb) if s.needs_fisher else None
        # The math is `layer.isopo_linear_grad`; here only the state around it. Few, small tensor ops per layer
        # call (each is a kernel launch on a GPU, ~3 us of dispatch on a CPU): metrics and EMA sums are reduced once
        # per step (`step_metrics`, `EMAStatistics.end_step`), the stored EMA values are read as Python floats.
        out = isopo_linear_grad(
            X, G, mb.mask, A, s, sample=sample, stat_scale=mb.stat_scale_as(dt, X.device), history=self.history(name),
            coefficients=None if self.weight_override is None else self.weight_override(name, A),
            has_bias=has_bias, scratch=self.scratch,
        )  # fmt: skip
        self.keep(name, out.record, out.ema, out.lam)
        return out.grad_weight, out.grad_bias

    def history(self, name: str) -> dict[str, float]:
        """The stored EMA values of module `name` by statistic (those that exist)."""
        found = {k: self.ema.ema.get(f"{name}/{k}") for k in _HISTORY_KEYS}
        return {k: v for k, v in found.items() if v is not None}

    def keep(self, name: str, record: torch.Tensor, ema: list, lam) -> None:
        """Fold one module call's EMA entries and keep its metrics record (and lambda) for the step."""
        for key, values, weights in ema:
            self.ema.accumulate(name, key, values, weights)
        if lam is not None:
            self.lambdas.append(lam)
        self.records.append(record)

    def reference_point(self, name: str, stat: str, x2: torch.Tensor) -> torch.Tensor | float:
        """mu for statistic `stat` of layer `name` from this micro-batch's x^2 (B,) under `isopo_reg_reference`
        (`layer.reference_point`), folding this micro-batch's values into the EMA as a layer call does."""
        prefix = f"{name}/{stat}"
        mu, entries = reference_point(
            self.settings.reg_reference, x2, self.ema.ema.get(prefix), self.ema.ema.get(prefix + "@median")
        )
        for suffix, values, weights in entries:
            self.ema.accumulate(name, stat + suffix, values, weights)
        return mu

    def plain_grads(self, x: torch.Tensor, g: torch.Tensor, mb: MicroBatch, has_bias: bool):
        """Ordinary weight (and bias) gradient G^T X of one layer, padding rows of both operands dropped (they may
        hold NaN). x: (B, L, d_in), g: (B, L, d_out). Used inside `plain.plain_backward()` (no statistics).
        Returns (d_out, d_in) and (d_out,) or None, in float64 for float64 x, else float32."""
        dt, odt = _layer_dtypes(x, g)
        X, G = self.masked_input(x, mb, odt), mb.zero_padding(g, odt)
        d_in, d_out = X.shape[-1], G.shape[-1]
        gw = matmul_f32(G.reshape(-1, d_out).T, X.reshape(-1, d_in))
        if not has_bias:
            return gw, None
        return gw, (G.sum((0, 1)) if G.dtype == dt else G.sum((0, 1), dtype=dt))

    def step_metrics(self) -> dict[str, tuple[float, float]]:
        """{metric: (sum over layer calls, number of layer calls)} of this step's records; clears them.

        Per layer call: euclidean_norm (when e is computed, see `ISOPOSettings.needs_euclidean`) / fisher_norm /
        rel_overlap are means over the micro-batch's sequences;
        scale_mean / scale_std the mean and std of the per-sequence scale (the coefficient over the advantage; 1 =
        REINFORCE) over sequences with a nonzero layer gradient (and, interacting, a nonzero advantage);
        scale_spread the coefficient of variation scale_std / scale_mean of the same sequences (a layer call with
        fewer than 2 such sequences or a zero mean is left out): ~0 means the layer's update is REINFORCE times a
        per-layer constant;
        nonfinite_coefficients counts dropped coefficients; ntk_lambda is lam (interacting), in the units of the
        normalization-free kernel (`MicroBatch.stat_scale`).
        """
        s = self.settings
        out = {}
        groups = defaultdict(list)
        for rec in self.records:
            groups[tuple(rec.shape)].append(rec)
        for recs in groups.values():
            e, f, rho, scale, A, w = torch.stack(recs).to("cpu", torch.float64).unbind(1)  # each (n, B)
            keep = e > 0  # sequences with a nonzero gradient in this layer (f > 0 when e is not computed)
            if s.interacting:
                scale = scale / torch.where(A != 0, A, 1.0)  # alpha_i / A_i
                keep = keep & (A != 0)
            n_keep = keep.sum(1).clamp_min(1)
            mean = torch.where(keep, scale, 0.0).sum(1) / n_keep
            std = (torch.where(keep, (scale - mean.unsqueeze(1)) ** 2, 0.0).sum(1) / n_keep).sqrt()
            parts = {"scale_mean": mean, "scale_std": std}
            spread_ok = (keep.sum(1) >= 2) & (mean != 0) & torch.isfinite(std / mean)
            if bool(spread_ok.any()):
                parts["scale_spread"] = (std / mean).abs()[spread_ok]
            if s.needs_euclidean:
                parts["euclidean_norm"] = e.mean(1)
            if s.needs_fisher:
                parts["fisher_norm"] = f.mean(1)
            if not s.interacting and s.r != 0:
                parts["rel_overlap"] = rho.mean(1)
            parts["nonfinite_coefficients"] = (~torch.isfinite(w)).sum(1).double()
            for k, v in parts.items():
                total, count = out.get(k, (0.0, 0.0))
                out[k] = (total + float(v.sum()), count + v.numel())
        if self.lambdas:
            lam = torch.stack([torch.as_tensor(x, dtype=torch.float64).cpu() for x in self.lambdas])
            out["ntk_lambda"] = (float(lam.sum()), float(lam.numel()))
        self.records.clear()
        self.lambdas.clear()
        return out


def _layer_dtypes(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(statistics dtype, operand dtype) of one layer call: float64 / float64 for float64 inputs; bf16 / fp16 inputs
    (x and g alike) stay half (the statistics upcast them where the device has no float32-output half GEMM, and the
    final GEMM is a half one: `routes.statistics_operands`, `routes._half_reweighted_gemm`); everything else is
    computed in float32."""
    dt = stat_dtype(x.dtype)
    return dt, (x.dtype if x.dtype in HALF_DTYPES and g.dtype == x.dtype else dt)


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
        grad_w = grad_b = None
        # A backward run inside an autocast region would otherwise turn the statistics' float32 products into
        # bf16 / fp16 ones; dtypes are chosen explicitly here (`_layer_dtypes`).
        with torch.autocast(x.device.type, enabled=False):
            grad_x = g.to(weight.dtype) @ weight if ctx.needs_input_grad[0] else None
            if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
                if plain_backward_active():  # an ordinary gradient (the KL term): no re-weighting, no statistics
                    gw, gb = ctx.context.plain_grads(x, g, ctx.mb, ctx.has_bias)
                else:
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
