"""The main job's memory settings: its micro-batch (rows per forward/backward, the knob that sets the peak), the
settings the docs state, and the keys of the results already recorded (a new default must not rename them)."""

from __future__ import annotations

import itertools
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from trl_isopo.compat import CHECKPOINTING_FIELD
from trl_isopo.methods import get_method
from trl_isopo.real.run import RealRun, _config
from trl_isopo.real import schedule
from trl_isopo.real.schedule import JOB_ACTIVATION_CHECKPOINTING, JOB_MICRO_BATCH, job_micro_batch
from trl_isopo.scripts.real import build_parser, make_run
from trl_isopo.tiny import set_offline_env

set_offline_env()
ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "real-model"
DOC = ROOT / "docs/real-model.md"


# ------------------------------------------------------------------------------------------------ the micro-batch
@pytest.fixture
def budget8(monkeypatch):
    """The hand-computed cases below are for a budget of 8 rows, whatever the job's default."""
    monkeypatch.setattr(schedule, "JOB_MICRO_BATCH", 8)


def test_job_micro_batch_default_is_the_largest_divisor_within_the_budget(budget8):
    isopo = get_method("isopo")
    assert job_micro_batch(isopo, 32, 8) == 8  # the main job: 4 micro-batches of 8 rows
    assert job_micro_batch(isopo, 32, 8, 4) == 8  # M = 4: one micro-batch per step
    assert job_micro_batch(isopo, 8, 4) == 8  # --quick: 2 prompts x 4 completions
    assert job_micro_batch(isopo, 20, 5) == 5  # 4 prompts x 5 completions: 8, 7 and 6 do not divide
    assert job_micro_batch(isopo, 28, 7) == 7
    assert job_micro_batch(isopo, 6, 6) == 6  # a step smaller than the budget: one micro-batch
    assert job_micro_batch(isopo, 26, 13) == 2  # 13 x 2: the largest divisor at most 8 is 2


@pytest.mark.parametrize("budget", [1, 4, 8, 16])
def test_job_micro_batch_brute_force(monkeypatch, budget):
    """Over step sizes: a divisor of the step, within the budget, and no larger divisor within it; TPO at M > 1:
    whole groups."""
    monkeypatch.setattr(schedule, "JOB_MICRO_BATCH", budget)
    for rows in range(1, 70):
        mb = job_micro_batch(get_method("grpo"), rows, 1)
        assert rows % mb == 0 and mb <= budget
        assert not any(rows % d == 0 for d in range(mb + 1, budget + 1))
    tpo = get_method("tpo")
    for k, prompts, m in itertools.product((2, 4, 8), (1, 2, 4, 8), (2, 4)):
        rows = k * prompts
        if rows % m:
            continue
        mb = job_micro_batch(tpo, rows, k, m)
        mini = rows // m
        assert mini % mb == 0 and (mb % k == 0 or mb == mini)
        groups = [d for d in range(k, mini + 1, k) if mini % d == 0]
        assert mb == (max([d for d in groups if d <= budget], default=min(groups, default=mini)))


def test_job_micro_batch_explicit_sizes():
    grpo = get_method("grpo")
    assert job_micro_batch(grpo, 32, 8, wanted=16) == 16
    assert job_micro_batch(grpo, 32, 8, wanted=0) == 0  # the whole step at once (the job's earlier default)
    with pytest.raises(ValueError, match="--micro-batch 12 does not divide the 32 rows"):
        job_micro_batch(grpo, 32, 8, wanted=12)
    with pytest.raises(ValueError, match="does not divide the 16 rows"):
        job_micro_batch(grpo, 32, 8, 2, wanted=32)
    with pytest.raises(ValueError, match="do not divide its 32 rows"):
        job_micro_batch(grpo, 32, 8, 3)
    tpo = get_method("tpo")
    assert job_micro_batch(tpo, 32, 8, wanted=4) == 4  # M = 1: TPO splits groups exactly
    with pytest.raises(ValueError, match="must be a multiple of --generations 8"):
        job_micro_batch(tpo, 32, 8, 2, wanted=4)


def test_accumulation_proma_keeps_its_own_split(budget8):
    """Accumulation PROMA's update depends on the split (it projects across the micro-batches of a step): the job keeps
    the method's gradient_accumulation_steps whatever the budget, and refuses another explicit size."""
    proma = get_method("proma")
    assert proma.fields["gradient_accumulation_steps"] == 4
    assert job_micro_batch(proma, 32, 8) == 8
    assert job_micro_batch(proma, 32, 8, 4) == 2  # M = 4: 8 rows a step, still 4 micro-batches
    assert job_micro_batch(proma, 64, 8) == 16  # above the budget: the method's split wins
    assert job_micro_batch(proma, 32, 8, wanted=8) == 8
    with pytest.raises(ValueError, match="--micro-batch must be 8 or left out"):
        job_micro_batch(proma, 32, 8, wanted=4)
    with pytest.raises(ValueError, match="4 micro-batches per optimizer step do not divide the step's 30 rows"):
        job_micro_batch(proma, 30, 6)
    assert job_micro_batch(get_method("proma-intra"), 32, 8) == 8  # intra: per micro-batch, no accumulation


# ------------------------------------------------------------------------------------------------ the job's defaults
@pytest.mark.parametrize("method", ["grpo", "isopo", "tpo", "proma"])
def test_main_job_defaults_are_the_documented_memory_settings(method, tmp_path):
    """`trl-isopo real` with its defaults: 4 micro-batches of 8 rows per optimizer step (the same update as one of 32),
    activation checkpointing on, as docs/real-model.md states."""
    run = make_run(build_parser().parse_args(["--method", method]))
    assert run.micro_batch == JOB_MICRO_BATCH == 8 and run.activation_checkpointing is JOB_ACTIVATION_CHECKPOINTING
    config = _config(run, str(tmp_path), progress=False)
    assert config.per_device_train_batch_size == 8
    assert config.gradient_accumulation_steps == 4
    assert config.steps_per_generation == 4  # one rollout feeds one optimizer step
    assert getattr(config, CHECKPOINTING_FIELD) is True
    doc = DOC.read_text()
    assert f"micro-batches of at most {JOB_MICRO_BATCH} rows with activation checkpointing" in doc
    assert not make_run(build_parser().parse_args(["--no-activation-checkpointing"])).activation_checkpointing


def test_micro_batch_flag_and_its_errors(capsys):
    parser = build_parser()
    assert make_run(parser.parse_args(["--micro-batch", "0"])).micro_batch == 0
    assert make_run(parser.parse_args(["--micro-batch", "16"])).micro_batch == 16
    assert make_run(parser.parse_args(["--quick"])).micro_batch == 8
    assert make_run(parser.parse_args(["--generations", "5"])).micro_batch == 5
    with pytest.raises(ValueError, match="does not divide"):
        make_run(parser.parse_args(["--micro-batch", "12"]))
    with pytest.raises(ValueError, match="must be 8 or left out"):
        make_run(parser.parse_args(["--method", "proma", "--micro-batch", "32"]))


# ------------------------------------------------------------------------------------------------ recorded keys
def _records():
    for path in sorted(RESULTS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                yield path.name, json.loads(line)


def test_recorded_results_keep_their_keys():
    """Every recorded real-model result's key is rebuilt from its settings: the job's micro-batch default (8 rows)
    does not rename runs recorded with one micro-batch per step (`micro_batch` 0, the key's base)."""
    seen = 0
    for name, record in _records():
        settings = dict(record["settings"])
        if "prompts_per_step" in settings:  # the first runs' name of prompts_per_rollout
            settings["prompts_per_rollout"] = settings.pop("prompts_per_step")
        assert RealRun(**settings).key() == record["key"], (name, record["key"])
        seen += 1
    assert seen >= 90
    first = dict(eval_sampled=True, kl_prompts=8)  # the learning benchmark's first runs: the key's base
    assert RealRun(**first, micro_batch=0).key() == "isopo|lora|lr=0.0003|seed=0|steps=16"
    assert RealRun(**first, micro_batch=JOB_MICRO_BATCH).key() == f"isopo|lora|lr=0.0003|seed=0|steps=16|mb={JOB_MICRO_BATCH}"



# ------------------------------------------------------------------------------------------------ the guard
def documented_budget_gib() -> float:
    """The main job's memory budget as docs/real-model.md states it ("memory budget: N GiB")."""
    match = re.search(r"memory budget: ([\d.]+) GiB", DOC.read_text())
    assert match, "docs/real-model.md states no memory budget"
    return float(match.group(1))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["isopo", "tpo"])
def test_main_job_peak_stays_within_the_documented_budget(tmp_path, method):
    """`trl-isopo real` with its defaults, 2 of its optimizer steps (the same micro-batches, rollout shape and
    allocator as the whole job; peaks of the 16-step job are in docs/real-model-results.md): its peak resident memory
    (`ru_maxrss` of the process, from `wait4`) stays within 1.2x the documented budget."""
    pytest.importorskip("gguf")
    cmd = [sys.executable, "-m", "trl_isopo.cli", "real", "--method", method, "--steps", "2", "--eval-size", "16",
           "--no-progress", "--output-dir", str(tmp_path / "real")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=tmp_path)
    output = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, output[-3000:]
    peak_gib = usage.ru_maxrss / 2**20  # KiB on Linux
    budget = documented_budget_gib()
    assert peak_gib <= 1.2 * budget, f"peak {peak_gib:.2f} GiB against a documented budget of {budget} GiB"
