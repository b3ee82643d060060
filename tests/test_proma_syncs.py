"""No device-host synchronization in `proma_layer_step` (every mode, target and solver).

On a GPU a host read of device data (`.item()`, `bool()` of a tensor, `nonzero`, boolean indexing, a copy to the
CPU) stalls the host once per covered layer and micro-batch. On CPU these ops are no syncs, so the test records
them as a proxy with a TorchDispatchMode, for the whole call (PROMA's own code and the ISOPO routes it calls).
"""

import os
import sys

import pytest
import torch
from proma_oracle import micro_batch
from torch.utils._python_dispatch import TorchDispatchMode

import trl_isopo
from trl_isopo.proma import proma_layer_step
from math_settings import proma_settings

aten = torch.ops.aten
PACKAGE = os.path.dirname(trl_isopo.__file__)
HOST_READS = {aten._local_scalar_dense, aten.nonzero, aten.nonzero_numpy, aten.masked_select, aten.is_nonzero,
              aten.equal, aten.allclose, aten._unique, aten._unique2, aten.unique_dim, aten.unique_consecutive,
              aten.nanmedian, aten.bincount, aten.histc}


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def _origin(self):
        f = sys._getframe(2)
        while f is not None:
            if f.f_code.co_filename.startswith(PACKAGE):
                return f"{os.path.relpath(f.f_code.co_filename, PACKAGE)}:{f.f_code.co_name}:{f.f_lineno}"
            f = f.f_back
        return "?"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        sync = packet in HOST_READS
        if packet in (aten.index, aten.index_put, aten.index_put_):
            idx = args[1] if len(args) > 1 else ()
            sync = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (idx or ()))
        if packet is aten._to_copy and kwargs.get("device") is not None:
            sync = torch.device(kwargs["device"]) != args[0].device
        if sync:
            self.calls.append((str(func), self._origin()))
        return func(*args, **kwargs)


@pytest.mark.parametrize("mode,target", [("accumulation", "microbatch"), ("intra", "microbatch"),
                                         ("both", "accumulated"), ("both", "accumulated_after")])
@pytest.mark.parametrize("solver", ["solve", "gram_schmidt"])
def test_no_host_reads(mode, target, solver):
    X, G, mask, A, V = micro_batch(empty_row=True)
    S = torch.randn(V.shape[1:], dtype=V.dtype)
    settings = proma_settings(mode=mode, intra_target=target, solver=solver, intra_dim=3,
                             relative_bound=0.5 if mode != "intra" else None)
    gen = torch.Generator().manual_seed(0)
    with HostReads() as rec:
        proma_layer_step(X, G, mask, A, settings, running=S, running_bias=S[:, 0].clone(), generator=gen,
                         has_bias=True)
    assert rec.calls == []


def test_the_recorder_sees_a_planted_read():
    with HostReads() as rec:
        t = torch.ones(3)
        float(t.sum())
        t[t > 0] = 2.0
    assert len(rec.calls) == 2
