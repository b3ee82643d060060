"""Run a script under a 2-process gloo world on CPU (docs/maintainers.md, "Tests")."""

import os
import subprocess
import sys


def launch_two_processes(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """`accelerate launch --multi_gpu --num_processes 2` gives a real world of 2 on CPU (`--cpu` starts one)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no",
        "--main_process_port", str(29500 + os.getpid() % 1000),
        script, *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"2-process run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def end_world() -> None:
    """The last call of a launched script: without it gloo's worker threads can abort the interpreter's exit
    (SIGABRT, "terminate called without an active exception") after a successful run."""
    from accelerate import PartialState

    PartialState().destroy_process_group()
