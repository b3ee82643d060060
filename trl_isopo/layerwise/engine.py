"""The per-layer backward as an explicit object: `LayerBackward`, which a trainer installs on a model and removes.

Every covered `nn.Linear` (trainable, not the LM head) runs through `CoveredLinearFunction`, an `autograd.Function`
around `F.linear` whose backward returns the ordinary input gradient and the method's weight (and bias) gradient
directly (paper arXiv 2512.23353, §2, applied layer-wise in the backward pass; docs/isopo.md, "What is covered").
Nothing edits `.grad` after the fact: gradient accumulation, DDP's bucketed all-reduce, checkpoint recompute and
the optimizer see the new gradient as they would an ordinary one.

Data path, without module-level state:

- `install(model, ...)` replaces the covered modules' instance `forward` (and, for `other_params="advantage_weighted"`,
  the other trainable leaf modules'; see `other_params.py`), and intercepts TRL's fused LM-head kernel when the head
  is weighted (`head/interception.py`); `remove()` undoes all of it.
- `with backward.micro_batch(mb): ...` is the window of one micro-batch: its forward, any checkpoint recompute and its
  backward. A covered forward inside it binds this object and `mb` into its Function call; outside it (or without
  gradients) the layer is a plain `F.linear`. On exit the object checks that every covered layer had its backward
  (a weight used outside its module's forward would silently get an ordinary gradient) and drops the micro-batch's
  input cache, call counts and scratch buffers.
- `with backward.plain(): ...` makes the Functions created by this object return ordinary gradients (no statistics,
  no records): the KL-to-reference term's separate `torch.autograd.grad` pass. A depth counter on the object, read in
  the backward functions through the object bound at forward time; not thread-local, as autograd runs backward
  functions on its own device threads on accelerators.

Extension point (every method reuses the Function, window, plain mode, input masking, call tracking and
other-parameter handling): subclass `LayerBackward`, name the method (`MethodName`) and implement the rule

    grads(call: LayerCall) -> LayerGrads(weight (d_out, d_in), bias (d_out,) | None)

(`rule.py`: the call carries the layer's masked input and output gradient per token, the micro-batch's mask and
advantages). The Function counts the call (`calls`) and handles plain mode; the rule only computes. ISOPO
(`trl_isopo/isopo/isopo_backward.py`) and PROMA (`trl_isopo/proma/backward.py`) are rules; tests/test_isopo_backward.py
runs a minimal third one. Optionally override `head_provider(name, mb)` to transform the LM head inside TRL's fused
kernel (ISOPO's: `trl_isopo/isopo/head.py`).

ISOPOTrainer opens the window in `_compute_loss` (where the micro-batch's advantages and masks are known) on an
`ExitStack` that `isopo_active()` closes after the backward.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from .head.interception import FusedHeadInterception
from .inputs import InputCache
from .micro_batch import MicroBatch
from .other_params import advantage_weighted_forward, check_leaf_module
from .precision import HALF_DTYPES, matmul_f32, stat_dtype
from .rule import LayerCall, LayerGrads, MethodName
from .scratch import Scratch

logger = logging.getLogger(__name__)


def layer_dtypes(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(statistics dtype, operand dtype) of one layer call: float64 / float64 for float64 inputs; bf16 / fp16 inputs
    (x and g alike) stay half (the statistics upcast them where the device has no float32-output half GEMM, and the
    final GEMM is a half one: `precision.py`, `weight_grad.py`); everything else is computed in float32."""
    dt = stat_dtype(x.dtype)
    return dt, (x.dtype if x.dtype in HALF_DTYPES and g.dtype == x.dtype else dt)


def coverable_linears(model: nn.Module, exclude: frozenset[int] = frozenset()) -> list[tuple[str, nn.Linear]]:
    """The (name, module) pairs `LayerBackward.install` covers: trainable plain `nn.Linear`s not in `exclude` (ids)."""
    return [(n, m) for n, m in model.named_modules()
            if type(m) is nn.Linear and m.weight.requires_grad and id(m) not in exclude]


def hub_kernels_off(model: nn.Module) -> list[str]:
    """Turn off transformers' Hub kernels (`use_kernels`, on by default since transformers 5.25 when the `kernels`
    package is installed) on every `PreTrainedModel` inside `model`; returns their class names.

    Kernelization swaps decorated layers' forwards (RMSNorm, activations) for kernels or resets them to the class's
    own, and it runs again at every `train()` / `eval()` switch, which GRPOTrainer makes each step: it would drop the
    advantage-weighted forwards installed on those modules. With it off, the layers run transformers' torch code.
    """
    turned_off = []
    for module in model.modules():
        if getattr(module, "use_kernels", False) is True and callable(getattr(module, "set_use_kernels", None)):
            module.set_use_kernels(False)
            turned_off.append(type(module).__name__)
    if turned_off:
        logger.info("Turned off transformers' Hub kernels on %s: the per-layer backward hooks the torch forwards.",
                    ", ".join(turned_off))
    return turned_off


class LayerBackward:
    """Base of a per-layer backward (see the module docstring); subclasses implement `grads`. `method`: the
    method's name in errors (`MethodName`)."""

    def __init__(self, method: MethodName):
        self.method = method
        self.layer_index: dict[str, int] = {}  # covered layer name -> index (stable: seeds, EMA keys)
        self.calls: dict[str, int] = {}  # backward calls per module in the open window (a dict update, no tensor op)
        self.inputs = InputCache()
        self.scratch = Scratch()
        self._window: MicroBatch | None = None
        self._plain_depth = 0
        self._patched: list[tuple[nn.Module, object]] = []  # (module, its own instance forward or None)
        self._installed: list[tuple[nn.Module, object]] = []  # (module, the forward installed on it)
        self._head: FusedHeadInterception | None = None

    # ----------------------------------------------------------------------------------------- extension point
    def grads(self, call: LayerCall) -> LayerGrads:
        """The method's rule: the weight (and bias) gradient of one covered layer in one micro-batch (`rule.py`)."""
        raise NotImplementedError(f"{type(self).__name__} implements no grads(call)")

    def layer_grads(self, name: str, x: torch.Tensor, g: torch.Tensor, mb: MicroBatch, has_bias: bool) -> LayerGrads:
        """The Function's entry: covered layer `name`'s input x (B, L, d_in) and output gradient g (B, L, d_out) as a
        `LayerCall` (operands cast, one side's padding rows zeroed: `masked_operands`), handed to `grads`."""
        X, G, dt, shared = self.masked_operands(name, x, g, mb)
        index = self.layer_index.get(name, len(self.layer_index))  # a layer called outside `install`: the next index
        return self.grads(LayerCall(name=name, index=index, X=X, G=G, dtype=dt, mb=mb, has_bias=has_bias,
                                    shared_input=shared))

    def start_step(self) -> None:
        """Before the first micro-batch of each optimizer step (`LayerwiseTrainer`): state kept across the
        micro-batches of a step starts here (PROMA's running gradients)."""

    def end_step(self, reduce) -> dict[str, float]:
        """After the optimizer step's last backward: fold state kept across steps; returns metrics to log.
        `reduce(t)`: t summed over the processes, on the host (every process calls it alike)."""
        return {}

    def log_metrics(self, reduce) -> dict[str, float]:
        """At each log: metrics gathered since the last one (`reduce` as in `end_step`)."""
        return {}

    def head_provider(self, name: str, mb: MicroBatch):
        """Row-scale provider for the LM head inside TRL's fused kernel (`head/kernel.py`), when installed with
        `head_mode="method"`."""
        raise NotImplementedError(f"{type(self).__name__} has no LM-head transform")

    # ------------------------------------------------------------------------------------------ install / remove
    def install(
        self,
        model: nn.Module,
        *,
        exclude: frozenset[int] = frozenset(),
        weighted: list[tuple[str, nn.Module]] = (),
        head_mode: str | None = None,
        head_name: str = "lm_head",
    ) -> list[str]:
        """Route every trainable `nn.Linear` of `model` (not in `exclude`, by id) through `CoveredLinearFunction`;
        scale the weight gradients of the leaf modules `weighted` by the advantages (`other_params.py`); with
        `head_mode` "advantage_weighted" or "method" (`head_provider`), intercept TRL's fused LM-head kernel.

        Only instance `forward`s are replaced, so DDP / FSDP2 wrappers that hold the same module objects keep
        working. Returns the covered module names.
        """
        hub_kernels_off(model)
        names = []
        for name, module in coverable_linears(model, exclude):
            if "forward" in module.__dict__:
                raise ValueError(
                    f"{name} already has an instance-level forward (e.g. accelerate's device_map offload hooks), "
                    f"which {self.method.title} would replace. Load the model without offloading (no "
                    f"device_map='auto' with CPU/disk offload) for {self.method.title} training."
                )
            self._patch(module, functools.partial(_covered_forward, self, module, name))
            self.layer_index[name] = len(names)
            names.append(name)
        for name, module in weighted:
            check_leaf_module(name, module, self.method)
            self._patch(module, advantage_weighted_forward(module.forward, name, self))
        if head_mode is not None:
            self._head = FusedHeadInterception(self, head_mode, head_name)
            self._head.install()
        return names

    def remove(self) -> None:
        """Restore every replaced forward and TRL's kernel."""
        for module, own in reversed(self._patched):
            if own is None:
                del module.forward
            else:
                module.forward = own
        self._patched.clear()
        self._installed.clear()
        if self._head is not None:
            self._head.remove()
            self._head = None
        self.layer_index.clear()

    def _patch(self, module: nn.Module, forward) -> None:
        self._patched.append((module, module.__dict__.get("forward")))
        module.forward = forward
        self._installed.append((module, forward))

    def check_installed(self) -> None:
        """Raise if a replaced forward is no longer in place (something re-set the module's forward after `install`,
        e.g. a kernel library swapping layer implementations): that module's gradient would silently be ordinary."""
        lost = [type(m).__name__ for m, fwd in self._installed if m.__dict__.get("forward") is not fwd]
        if lost:
            raise RuntimeError(
                f"{type(self).__name__}: the forward of {len(lost)} module(s) ({', '.join(sorted(set(lost)))}) was "
                "replaced after the trainer installed its per-layer backward, so their gradients would not be "
                "transformed. Something re-kernelized or re-wrapped the model after the trainer was built (e.g. "
                "`model.set_use_kernels(True)`, `kernels.kernelize`, Liger's patching): build the trainer on the "
                "model as it will be trained."
            )

    # ------------------------------------------------------------------------------------- window / plain mode
    @property
    def current(self) -> MicroBatch | None:
        """The micro-batch of the open window (None outside)."""
        return self._window

    @contextlib.contextmanager
    def micro_batch(self, mb: MicroBatch):
        """The window of micro-batch `mb`: its forward, recompute and backward (see the module docstring)."""
        if self._window is None:
            self.check_installed()
        previous, self._window = self._window, mb
        try:
            yield mb
            if previous is None:
                self.check_calls()
        finally:
            self._window = previous
            if previous is None:
                self.clear()

    @property
    def plain_active(self) -> bool:
        """Whether this object's backward functions must produce the ordinary (un-reweighted) gradient."""
        return self._plain_depth > 0

    @contextlib.contextmanager
    def plain(self):
        """Within this block, the backward functions bound to this object compute ordinary gradients."""
        self._plain_depth += 1
        try:
            yield
        finally:
            self._plain_depth -= 1

    def clear(self, keep_scratch: bool = False) -> None:
        """End of a micro-batch's backward: drop its state (and the scratch storage, unless `keep_scratch`)."""
        self.inputs.clear()
        self.calls = {}
        if not keep_scratch:
            self.scratch.clear()

    # ------------------------------------------------------------------------------------------- call tracking
    def record_call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def uncovered_layers(self) -> list[str]:
        """Covered layers without a backward in this micro-batch although others had one (none: [])."""
        if not self.calls:
            return []
        return [name for name in self.layer_index if name not in self.calls]

    def check_calls(self) -> None:
        """Raise if the transformed LM head or a covered layer had no backward while others had theirs."""
        head = self._head
        if head is not None and head.mode == "method" and self.calls and head.name not in self.calls:
            flag = self.method.field("lm_head")
            raise RuntimeError(
                f"{self.method.title}: {flag}=True, but the LM head's gradient did not pass through TRL's fused "
                "log-prob kernel in this micro-batch (the logits were computed another way), so it would not be "
                f"re-weighted. Set {flag}=False."
            )
        missing = self.uncovered_layers()
        if missing:
            # Their weights got an ordinary, reward-free gradient from some other use (e.g. `F.linear(x,
            # layer.weight)` in a custom forward): silently wrong, so stop.
            raise RuntimeError(
                f"{self.method.title}: the covered layer(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} had "
                f"no {self.method.title} backward in this micro-batch while other covered layers did: their weight "
                "is used outside the module's own forward (a custom forward calling F.linear on it, a tied weight, "
                "FSDP1 flat parameters), so its gradient would not be re-weighted. Freeze these layers, exclude "
                "them from the LoRA target_modules, or call the module itself."
            )

    # ------------------------------------------------------------------------------------------ input masking
    def masked_input(self, x: torch.Tensor, mb: MicroBatch, dt: torch.dtype) -> torch.Tensor:
        """x (B, L, d) as `dt` with padding rows zeroed, shared by the layers reading the same input."""
        return self.inputs.masked(x, mb, dt)

    def masked_operands(self, name: str, x: torch.Tensor, g: torch.Tensor, mb: MicroBatch):
        """(X, G, statistics dtype, x's `inputs.SharedInput`): the layer's operands in the operand dtype
        (`layer_dtypes`) with the padding rows of one of them zeroed: the narrower one, X on a tie (its masked copy is
        shared by the layers reading the same input). Autograd's G^T X needs the other finite at padding too."""
        if x.shape[:2] != mb.mask.shape:
            raise RuntimeError(
                f"{self.method.title} layer {name} saw inputs of shape {tuple(x.shape)} but the micro-batch mask is "
                f"{tuple(mb.mask.shape)}: {self.method.title} needs inputs laid out as (batch, sequence) rows of the "
                "text tokens. "
                "Packed / padding-free inputs, vision towers and MoE experts (which see flattened tokens) are not "
                "supported: freeze those modules or exclude them from the LoRA target_modules."
            )
        dt, odt = layer_dtypes(x, g)
        shared = self.inputs.entry(x, mb)
        if x.shape[-1] <= g.shape[-1]:
            return shared.masked_as(odt), g.to(odt), dt, shared
        return x.to(odt), mb.zero_padding(g, odt), dt, shared

    def plain_grads(self, x: torch.Tensor, g: torch.Tensor, mb: MicroBatch, has_bias: bool):
        """Ordinary weight (and bias) gradient G^T X of one layer, padding rows of both operands dropped (they may
        hold NaN). x: (B, L, d_in), g: (B, L, d_out). Used inside `plain()` (no statistics).
        Returns (d_out, d_in) and (d_out,) or None, in float64 for float64 x, else float32."""
        dt, odt = layer_dtypes(x, g)
        X, G = self.masked_input(x, mb, odt), mb.zero_padding(g, odt)
        d_in, d_out = X.shape[-1], G.shape[-1]
        gw = matmul_f32(G.reshape(-1, d_out).T, X.reshape(-1, d_in))
        if not has_bias:
            return gw, None
        return gw, (G.sum((0, 1)) if G.dtype == dt else G.sum((0, 1), dtype=dt))


def _covered_forward(owner: LayerBackward, module: nn.Linear, name: str, x: torch.Tensor) -> torch.Tensor:
    """A covered module's forward: through `CoveredLinearFunction` inside `owner`'s window, with gradients on.

    Installed as a `functools.partial` (not a closure), so that a deep copy of the model rebinds it to the copied
    module, as a bound method would be."""
    mb = owner.current
    if mb is not None and torch.is_grad_enabled() and module.weight.requires_grad:
        return CoveredLinearFunction.apply(x, module.weight, module.bias, owner, name, mb)
    return F.linear(x, module.weight, module.bias)


class CoveredLinearFunction(torch.autograd.Function):
    """y = x W^T + b; backward: grad_x = g W (unchanged), (grad_W, grad_b) from the `LayerBackward` bound at forward
    time (`layer_grads`, or `plain_grads` inside its `plain()` mode)."""

    @staticmethod
    def forward(ctx, x, weight, bias, owner: LayerBackward, name: str, mb: MicroBatch):
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
        ctx.owner, ctx.name, ctx.mb = owner, name, mb
        ctx.has_bias = bias is not None
        ctx.param_dtypes = (weight.dtype, bias.dtype if bias is not None else None)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        owner = ctx.owner
        grad_w = grad_b = None
        # A backward run inside an autocast region would otherwise turn the statistics' float32 products into
        # bf16 / fp16 ones; dtypes are chosen explicitly here (`layer_dtypes`).
        with torch.autocast(x.device.type, enabled=False):
            grad_x = g.to(weight.dtype) @ weight if ctx.needs_input_grad[0] else None
            if ctx.needs_input_grad[1] or (ctx.has_bias and ctx.needs_input_grad[2]):
                if owner.plain_active:  # an ordinary gradient (the KL term): no re-weighting, no statistics
                    gw, gb = owner.plain_grads(x, g, ctx.mb, ctx.has_bias)
                else:
                    owner.record_call(ctx.name)
                    gw, gb = owner.layer_grads(ctx.name, x, g, ctx.mb, ctx.has_bias)
                grad_w = gw.to(ctx.param_dtypes[0]) if ctx.needs_input_grad[1] else None
                if ctx.has_bias and ctx.needs_input_grad[2]:
                    grad_b = gb.to(ctx.param_dtypes[1])
        return grad_x, grad_w, grad_b, None, None, None
