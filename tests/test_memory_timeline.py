"""`benchmarks/memory_timeline.py`: resident memory and the live heap attributed to the innermost phase of the
training loop, and the wrappers reaching TRL's and the job's methods on the real model."""

from __future__ import annotations

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

def _load(name: str):
    """benchmarks/<name>.py as a module (the folder on sys.path, as when it runs as a script)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_phase_memory_attributes_a_rise_to_the_innermost_phase():
    """A 256 MiB buffer touched inside a nested phase shows as that phase's rise and live heap, not its outer phase's;
    a nested call of the same phase is one entry; the phases' seconds add up to the wall time."""
    import time

    import torch

    tl = _load("memory_timeline")
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


def test_memory_benchmark_report_ratios_and_slope():
    """Ratios to GRPO at the same micro-batch and weights, and GiB per row as the slope between the smallest and the
    largest micro-batch, from hand-made peaks."""
    mb = _load("memory_benchmark")
    gib = 2**30

    def r(rss, heap):
        return {"peak_rss": rss * gib, "peak_heap": heap * gib, "cuda_peak": None, "row_tokens": 62}

    results = {"lora|grpo|4": r(2.0, 1.0), "lora|grpo|8": r(3.0, 1.5), "lora|isopo|4": r(2.2, 1.0),
               "lora|isopo|8": r(3.3, 1.6)}
    text = mb.report(results, ["grpo", "isopo"], ["lora"], [4, 8])
    lines = text.splitlines()
    rss = next(line for line in lines if line.startswith("isopo") and "1.10x" in line)
    assert rss.split()[-1] == "0.275"  # (3.3 - 2.2) / 4 rows
    assert "(1.10x)" in rss and "3.30" in rss
    heap = [line for line in lines if line.startswith("isopo")][1]
    assert "(1.07x)" in heap and heap.split()[-1] == "0.150"
    grpo = next(line for line in lines if line.startswith("grpo"))
    assert grpo.count("(1.00x)") == 2 and grpo.split()[-1] == "0.250"
    assert "rows of 62 tokens" in text


def test_memory_benchmark_keeps_accumulation_proma_split():
    """Accumulation PROMA is measured on its own split (4 micro-batches a step: fewer prompts for fewer rows), the
    others through --micro-batch."""
    import argparse

    mb = _load("memory_benchmark")
    args = argparse.Namespace(steps=2, eval_size=16, malloc="cached", threads=2, checkpointing=True)
    proma = mb.job_args("proma", False, 4, args)
    assert proma[proma.index("--prompts") + 1] == "2" and "--micro-batch" not in proma
    assert mb.job_args("proma", True, 8, args)[-2:] == ["--prompts", "4"] and "--full" in mb.job_args("proma", True, 8, args)
    assert mb.job_args("proma", False, 3, args) is None  # 12 rows: not whole prompts of 8 completions
    isopo = mb.job_args("isopo", False, 4, args)
    assert isopo[isopo.index("--micro-batch") + 1] == "4" and "--prompts" not in isopo
    assert "--no-activation-checkpointing" not in isopo
    args.checkpointing = False
    assert "--no-activation-checkpointing" in mb.job_args("isopo", False, 4, args)
