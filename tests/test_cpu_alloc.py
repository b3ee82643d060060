"""`trl_isopo.cpu_alloc`: with glibc told to keep freed memory, training steps reuse the pages of the previous steps
(no page faults once the heap has reached the step's peak); with glibc's stock settings every large temporary is a
fresh mmap faulted in page by page at every step. Run in subprocesses: mallopt changes the whole process."""

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc settings"
)

_PROBE = r"""
import json, resource, sys
import torch
from trl_isopo import cpu_alloc

applied = cpu_alloc.keep_freed_memory(only_cpu=False) if sys.argv[1] == "keep" else False
torch.manual_seed(0)
torch.set_num_threads(1)
V, H, B = 4096, 64, 4096  # logits and their gradient: 64 MiB each, above glibc's largest mmap threshold (32 MiB)
model = torch.nn.Sequential(torch.nn.Embedding(V, H), torch.nn.Linear(H, 256), torch.nn.GELU(), torch.nn.Linear(256, V))
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
faults, heap = [], []
for step in range(24):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ids = torch.randint(0, V, (B,))
    torch.nn.functional.cross_entropy(model(ids), ids).backward()
    opt.step()
    opt.zero_grad()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    heap.append(cpu_alloc.malloc_stats().heap)
released = cpu_alloc.release_free_memory()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
x = torch.empty(V * B).fill_(1.0)
after_trim = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"applied": applied, "faults": faults, "heap": heap, "released": released, "after_trim": after_trim}))
"""


def _probe(mode):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_keep_freed_memory_reuses_pages():
    """24 training steps of a model whose logits are 64 MiB: with the stock settings every step maps and faults in
    its large temporaries again; kept, the heap grows to the steps' peak and later steps reuse it. (glibc < 2.38
    cannot serve an aligned request from a free chunk of exactly its size, so the heap may take a few more steps to
    settle, at a few 64 MiB blocks more; hence the bounds on the last 12 steps rather than zero faults.)"""
    pages = 64 * 2**20 // 4096  # one 64 MiB tensor
    stock, keep = _probe("system"), _probe("keep")
    assert stock["applied"] is False and min(stock["faults"][2:]) > pages, stock
    assert keep["applied"] is True and keep["faults"][0] > pages, keep  # the heap grows to the step's peak
    assert sum(keep["faults"][-12:]) < 0.1 * sum(stock["faults"][-12:]), (keep, stock)
    assert keep["heap"][-1] - keep["heap"][-12] <= 2 * 64 * 2**20, keep
    # malloc_trim(0) hands the free heap back to the OS: a new 64 MiB tensor faults in again.
    assert keep["released"] and keep["after_trim"] > 0.9 * pages, keep


def test_keep_freed_memory_leaves_a_cuda_process_alone(monkeypatch):
    import torch

    from trl_isopo import cpu_alloc

    def no_mallopt():
        raise AssertionError("glibc was reached")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpu_alloc, "_glibc", no_mallopt)
    assert cpu_alloc.keep_freed_memory() is False
