"""`benchmarks/memory_timeline.py`: resident memory and the live heap attributed to the innermost phase of the
training loop, and the wrappers reaching TRL's and the job's methods on the real model."""

from __future__ import annotations

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

def _timeline_module():
    import importlib.util
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("memory_timeline", ROOT / "benchmarks" / "memory_timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_phase_memory_attributes_a_rise_to_the_innermost_phase():
    """A 256 MiB buffer touched inside a nested phase shows as that phase's rise and live heap, not its outer phase's;
    a nested call of the same phase is one entry; the phases' seconds add up to the wall time."""
    import time

    import torch

    tl = _timeline_module()
    memory = tl.PhaseMemory()
    mib = 2**20

    def inner():
        x = torch.ones(256 * mib // 4)  # touched: resident
        memory.sample()
        return float(x[-1])

    backward = memory.wrap(memory.wrap(inner, "backward"), "backward")  # the same phase twice: one entry
    step = memory.wrap(lambda: time.sleep(0.05) or backward(), "loss forward")
    t0 = time.perf_counter()
    assert step() == 1.0
    memory.finish()
    wall = time.perf_counter() - t0
    stats = memory.stats
    assert stats["backward"]["entries"] == 1 and stats["loss forward"]["entries"] == 1
    assert stats["backward"]["max_rise"] > 200 * mib
    assert stats["loss forward"]["max_rise"] < 100 * mib  # the buffer was freed before the outer phase resumed
    if tl.malloc_stats() is not None:
        assert stats["backward"]["peak_heap"] > 200 * mib
    assert stats["loss forward"]["seconds"] >= 0.05
    total = sum(s["seconds"] for s in stats.values())  # every second since the tracker was made, counted once
    assert wall <= total <= time.perf_counter() - memory.t0
    assert [name for name, _, _ in memory.stack] == ["load / setup"]


@pytest.mark.slow
def test_memory_timeline_tags_every_phase_of_the_quick_job(tmp_path):
    """`benchmarks/memory_timeline.py -- --quick` on the real model: the training loop's phases are all entered (the
    wrappers reach TRL's and the job's methods), the process peak is the largest phase peak, and the JSON is written."""
    import subprocess
    import sys

    pytest.importorskip("gguf")
    out = tmp_path / "t.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory_timeline.py"), "--json", str(out), "--",
           "--quick", "--method", "tpo", "--output-dir", str(tmp_path / "real")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    phases = result["phases"]
    for name in ("generation", "loss forward", "backward", "optimizer", "evaluation", "step (rest)"):
        assert phases[name]["entries"] >= 2, name  # 2 optimizer steps, 2 evaluations
    assert phases["backward"]["entries"] == phases["loss forward"]["entries"] == 2  # --quick: 8 rows, one micro-batch
    assert max(s["peak_rss"] for s in phases.values()) <= result["peak_rss"] * 1.01
    assert "memory by phase" in proc.stdout
