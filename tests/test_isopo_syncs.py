"""No device-host synchronization in ISOPO's per-micro-batch work (`MicroBatch`, the layer forward wrappers, every
ISOPO backward function).

On a GPU a host read of device data (`.item()`, `int()` / `bool()` / `float()` of a tensor, `nonzero`, boolean
indexing, `masked_select`, `unique`, a copy to the CPU) stalls the host until the device has caught up, once per
covered layer call here. On CPU these ops are no syncs, so the test counts them as a proxy: a TorchDispatchMode
records each such op (and every copy that changes device) together with the innermost frame of `trl_isopo` that
issued it, and the ops attributed to ISOPO's mechanism modules must be none. The trainer's once-per-step code
(`trainer.py`: metrics, logging) and TRL's / transformers' own code are not attributed to them.
"""

import os
import sys

import pytest
import torch
from isopo_oracle import make_batch, make_trainer
from torch.utils._python_dispatch import TorchDispatchMode

import trl_isopo
from trl_isopo.isopo import layer as isopo_layer
from trl_isopo.isopo.isopo_backward import ISOPOBackward, ISOPOSettings
from math_settings import isopo_settings
from trl_isopo.layerwise.micro_batch import MicroBatch
from trl_isopo.tiny import build_tiny_causal_lm

aten = torch.ops.aten
PACKAGE = os.path.dirname(trl_isopo.__file__)
MECHANISM = {os.path.join(PACKAGE, f) for f in
             ("layerwise/engine.py", "isopo/isopo_backward.py", "layerwise/micro_batch.py", "isopo/metrics.py",
              "isopo/layer.py", "layerwise/precision.py", "layerwise/costs.py", "layerwise/statistics.py",
              "layerwise/weight_grad.py", "layerwise/scratch.py", "isopo/reweight.py", "layerwise/other_params.py",
              "layerwise/head/kernel.py", "layerwise/head/rows.py", "isopo/head.py", "layerwise/head/interception.py",
              "isopo/ema.py")}
# Ops whose result size or value the host must read (nanmedian: its CUDA kernel reads the NaN count in some
# versions; repeat_interleave without output_size reads the repeats).
HOST_READS = {aten._local_scalar_dense, aten.nonzero, aten.nonzero_numpy, aten.masked_select, aten.is_nonzero,
              aten.equal, aten.allclose, aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive,
              aten.unique_dim_consecutive, aten.nanmedian, aten.bincount, aten.histc}


def _devices(args, kwargs) -> set:
    out = set()
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.add(a.device)
    return out


class HostSyncRecorder(TorchDispatchMode):
    """Records (op, file:function:line of the innermost trl_isopo frame) for sync-causing ops issued by MECHANISM."""

    def __init__(self):
        super().__init__()
        self.calls = []
        self.attributed = 0  # every op attributed to MECHANISM (a check that attribution works at all)

    def _origin(self):
        f = sys._getframe(2)
        while f is not None:
            path = f.f_code.co_filename
            if path.startswith(PACKAGE):
                return f"{os.path.basename(path)}:{f.f_code.co_name}:{f.f_lineno}" if path in MECHANISM else None
            f = f.f_back
        return None

    def _syncs(self, func, args, kwargs) -> bool:
        packet = func.overloadpacket
        if packet in HOST_READS:
            return True
        if packet in (aten.index, aten.index_put, aten.index_put_):  # boolean-mask indexing
            idx = args[1] if len(args) > 1 else ()
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (idx or ()))
        if packet is aten.repeat_interleave and isinstance(args[0], torch.Tensor) and args[0].dim() > 0 \
                and kwargs.get("output_size") is None and func is aten.repeat_interleave.Tensor:
            return True
        if packet is aten._to_copy and "device" in kwargs and kwargs["device"] is not None:
            return torch.device(kwargs["device"]) != args[0].device
        if packet is aten.copy_:
            return len(_devices(args, {})) > 1
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        origin = self._origin()
        if origin is not None:
            self.attributed += 1
            if self._syncs(func, args, kwargs):
                self.calls.append((str(func), origin))
        return func(*args, **kwargs)


def record_micro_batch(trainer, inputs) -> HostSyncRecorder:
    """One micro-batch's loss forward and ISOPO backward under the recorder."""
    trainer.model.zero_grad(set_to_none=True)
    rec = HostSyncRecorder()
    with rec:
        with trainer.isopo_active():
            trainer.compute_loss(trainer.model, inputs).backward()
    return rec


VARIANTS = {
    "p=-1 (default)": dict(p=-1.0, reg=1.0),
    "q=-1": dict(p=0.0, q=-1.0, reg=1.0),
    "interacting": dict(interacting=True),
    "p,q,r + batch median": dict(p=-1.0, q=-0.5, r=-0.5, reg=1.0, reg_reference="batch_median"),
    "ema median": dict(p=-1.0, reg=1.0, reg_reference="ema_median"),
}


@pytest.mark.parametrize("dtype", ["float32", "bf16 half operands"])
@pytest.mark.parametrize("route", ["gram", "mat"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_isopo_micro_batch_has_no_host_syncs(tiny_tokenizer, tmp_path, variant, route, dtype):
    """One micro-batch with padding and a Fisher sample (5 tokens) smaller than its 21 valid tokens, with and without
    an EMA history: MicroBatch construction, forward and backward issue no host read from ISOPO's modules."""
    half = dtype != "float32"
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.bfloat16 if half else torch.float32, seed=1)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path)
    ctx = trainer.isopo_backward
    ctx.settings = ISOPOSettings(**{**ctx.settings.__dict__, **VARIANTS[variant], "route": route, "fisher_tokens": 5,
                                    "force_half_operands": half})  # half: the GPU's half-operand path
    inputs = make_batch(tiny_tokenizer)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    assert 5 < int(mask.sum()) < mask.numel()
    for step in range(2):  # the first step has no EMA history; the second has one (floats)
        rec = record_micro_batch(trainer, inputs)
        assert rec.calls == [], rec.calls
        assert rec.attributed > 100  # the recorder does see ISOPO's ops
        assert all(p.grad is not None for n, p in trainer.model.named_parameters() if p.requires_grad)
        trainer._isopo_end_step()  # once per optimizer step, outside the layers: syncs allowed
        assert bool(ctx.ema.ema) == (VARIANTS[variant].get("reg_reference") != "batch_median")  # a history next


@pytest.mark.parametrize("route", ["gram", "mat"])
@pytest.mark.parametrize("variant", ["p=-1 (default)", "q=-1", "interacting"])
def test_isopo_lm_head_has_no_host_syncs(tiny_tokenizer, tmp_path, variant, route):
    """The ISOPO-transformed LM head (`isopo_lm_head=True`: statistics over the fused kernel's vocabulary tiles, then
    the row-scaled kernel) issues no host read either, with a Fisher sample of 5 of its scored positions."""
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float32, seed=1)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, isopo_lm_head=True)
    ctx = trainer.isopo_backward
    ctx.settings = ISOPOSettings(**{**ctx.settings.__dict__, **VARIANTS[variant], "route": route, "fisher_tokens": 5})
    inputs = make_batch(tiny_tokenizer)
    for step in range(2):
        rec = record_micro_batch(trainer, inputs)
        assert rec.calls == [], rec.calls
        assert ctx.calls == {} and len(ctx.records) == len(trainer.isopo_coverage["covered"]) + 1
        trainer._isopo_end_step()
        assert any(k.startswith("lm_head/") for k in ctx.ema.ema)


def test_recorder_sees_a_planted_host_read(tiny_tokenizer, tmp_path, monkeypatch):
    """Negative control: a `.item()` inside the layer backward's call tree is reported, attributed to layer.py.
    (Against the former code the test above fails: `MicroBatch.__post_init__` called `nonzero` on the mask.)"""
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float32, seed=1)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path)
    real = isopo_layer.fisher_norm
    monkeypatch.setattr(isopo_layer, "fisher_norm", lambda num, den: (den.item(), real(num, den))[1])
    rec = HostSyncRecorder()
    with rec:
        with trainer.isopo_active():
            trainer.compute_loss(trainer.model, make_batch(tiny_tokenizer)).backward()
    assert rec.calls and all(op.startswith("aten._local_scalar_dense") and origin.startswith("layer.py:isopo_coefficients")
                             for op, origin in rec.calls)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_layer_grads_on_cuda_do_not_synchronize(variant, dtype):
    """On a GPU: torch's sync debug mode raises on any synchronizing call of one layer backward (after a warm-up
    call: the first one probes the half GEMM kernel and creates the generator)."""
    B, L, d_in, d_out = 4, 64, 96, 160
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(B, L, generator=g) > 0.2
    x, gr = torch.randn(B, L, d_in, generator=g), torch.randn(B, L, d_out, generator=g)
    dev = torch.device("cuda")
    x, gr, mask = x.to(dev, dtype), gr.to(dev, dtype), mask.to(dev)
    A = torch.randn(B, generator=g).to(dev)
    ctx = ISOPOBackward(isopo_settings(**VARIANTS[variant], fisher_tokens=50))
    mb = MicroBatch(mask=mask, advantages=A, stat_scale=torch.full((B,), 7.0, device=dev))
    ctx.layer_grads("layer", x, gr, mb, True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rec = HostSyncRecorder()
        with rec:
            gw, gb = ctx.layer_grads("layer", x, gr, mb, True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rec.calls == [], rec.calls
    assert torch.isfinite(gw).all() and gw.dtype == torch.float32
