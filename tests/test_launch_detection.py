"""Worker detection of the self-launching CLI (`scripts/launch.py`): by accelerate's and torchrun's own markers, not by
one variable a user may export."""

import os
import subprocess
import sys

from trl_isopo.scripts import launch


def test_markers():
    assert not launch.in_launched_worker({})
    assert not launch.in_launched_worker({"ACCELERATE_MIXED_PRECISION": "bf16"})  # a user's own export
    assert not launch.in_launched_worker({"LOCAL_RANK": "0"})
    assert launch.in_launched_worker({launch.LAUNCHED_ENV: "1"})
    assert launch.in_launched_worker({"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2"})
    assert launch.in_launched_worker({k: "x" for k in launch._ACCELERATE_LAUNCH_MARKERS})


def test_a_real_accelerate_launch_is_detected(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text("from trl_isopo.scripts.launch import in_launched_worker\nprint('WORKER', in_launched_worker())\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCELERATE_") and k != launch.LAUNCHED_ENV}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu", "--mixed_precision", "no",
         "--dynamo_backend", "no", str(script)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert "WORKER True" in out.stdout, out.stdout + out.stderr
    plain = subprocess.run([sys.executable, str(script)], env={**env, "ACCELERATE_MIXED_PRECISION": "no"},
                           capture_output=True, text=True, timeout=300)
    assert "WORKER False" in plain.stdout, plain.stdout + plain.stderr
