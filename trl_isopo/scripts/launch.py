"""Self-launch through `accelerate launch`, as TRL's `trl grpo` does.

`trl-isopo isopo ... --num_processes 4 --accelerate_config zero2` re-runs itself as
`accelerate launch --config_file <zero2.yaml> --num_processes 4 -m trl_isopo.cli isopo ...`. The launch arguments
are what the training parser does not know (TRL's rule), checked against accelerate's own parser first so that a
misspelled training flag is reported as such rather than by accelerate. Without launch arguments the command runs
in the current process (one process; also what every launched worker does).

`--accelerate_config` takes a file or a name: `ddp` (alias of TRL's `multi_gpu`), `zero1`, `zero2`, `zero3`, `fsdp1`,
`fsdp2`, `single_gpu`, the configs shipped with TRL (identical to `recipes/accelerate/`). Those are GPU configs
(bf16 mixed precision). Without a config file, `--num_processes N > 1` starts N data-parallel processes; on a
machine without CUDA they are CPU processes (gloo) with `--mixed_precision no`, and the workers get `--use_cpu true`
unless `--use_cpu` is given.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

# Set in each launched worker: a worker never launches again.
LAUNCHED_ENV = "TRL_ISOPO_LAUNCHED"
CONFIG_ALIASES = {"ddp": "multi_gpu"}


def resolve_accelerate_config(value: str) -> str:
    """Path of an accelerate config given as a file or as a name of a config shipped with TRL."""
    if Path(value).is_file():
        return value
    name = CONFIG_ALIASES.get(value, value)
    candidate = resources.files("trl.accelerate_configs").joinpath(f"{name}.yaml")
    if not candidate.is_file():
        shipped = sorted(p.name[: -len(".yaml")] for p in resources.files("trl.accelerate_configs").iterdir()
                         if p.name.endswith(".yaml"))
        raise ValueError(
            f"--accelerate_config {value!r} is neither a file nor a shipped config: use a path or one of "
            f"{sorted(set(shipped) | set(CONFIG_ALIASES))}."
        )
    return str(candidate)


def _has(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def accelerate_launch_args(launch_args: list[str]) -> list[str]:
    """`accelerate launch` arguments for the user's launch arguments: `--accelerate_config X` becomes
    `--config_file <path>`; without a config file, `--num_processes N > 1` gets `--multi_gpu` (on CPU, accelerate
    otherwise starts one process) and quiet defaults (one machine, no dynamo, no mixed precision without CUDA)."""
    args = list(launch_args)
    if _has(args, "--accelerate_config"):
        value = _value(args, "--accelerate_config")
        if value is None:
            raise ValueError("--accelerate_config needs a value (a file or ddp/zero2/zero3/fsdp2).")
        i = next(i for i, a in enumerate(args) if a == "--accelerate_config" or a.startswith("--accelerate_config="))
        del args[i : i + (1 if "=" in args[i] else 2)]
        args = ["--config_file", resolve_accelerate_config(value), *args]
    if not _has(args, "--config_file"):
        import torch

        processes = int(_value(args, "--num_processes") or 1)
        distributed = ("--multi_gpu", "--use_deepspeed", "--use_fsdp", "--tpu", "--cpu")
        if processes > 1 and not any(_has(args, flag) for flag in distributed):
            args.append("--multi_gpu")
        defaults = {"--num_machines": "1", "--dynamo_backend": "no"}
        if not torch.cuda.is_available():
            defaults["--mixed_precision"] = "no"
        for flag, value in defaults.items():
            if not _has(args, flag):
                args += [flag, value]
    return args


def check_launch_args(launch_args: list[str], command: str) -> None:
    """Raise for arguments that neither the training parser nor `accelerate launch` accepts."""
    from accelerate.commands.launch import launch_command_parser

    _, unknown = launch_command_parser().parse_known_args([*accelerate_launch_args(launch_args), "script.py"])
    if unknown:
        raise ValueError(
            f"Unknown argument(s) for `trl-isopo {command}`: {unknown}. They are neither training arguments "
            f"(`trl-isopo {command} --help`) nor `accelerate launch` arguments."
        )


def launch(command: str, launch_args: list[str], training_args: list[str]) -> int:
    """Start `accelerate launch <launch args> -m trl_isopo.cli <command> <training args>`; returns its exit code."""
    if os.environ.get(LAUNCHED_ENV):
        raise ValueError(
            f"Launch arguments {launch_args} inside a launched worker: pass them to the first `trl-isopo {command}` "
            "only (or use `accelerate launch ... -m trl_isopo.cli` without them)."
        )
    from accelerate.commands.launch import launch_command, launch_command_parser

    import torch

    if not torch.cuda.is_available() and not _has(training_args, "--use_cpu"):
        # Without it, transformers on a machine with no GPU sets up each worker alone (world size 1).
        training_args = [*training_args, "--use_cpu", "true"]
    argv = [*accelerate_launch_args(launch_args), "-m", "trl_isopo.cli", command, *training_args]
    parsed = launch_command_parser().parse_args(argv)
    os.environ[LAUNCHED_ENV] = "1"
    try:
        launch_command(parsed)  # raises CalledProcessError / exits if a worker fails
    finally:
        os.environ.pop(LAUNCHED_ENV, None)
    return 0


# Set together by both of accelerate's launchers (its simple and its multi-process environment builders) and by
# nothing else: one of them alone may be a user's own export (e.g. ACCELERATE_MIXED_PRECISION from a shell profile).
_ACCELERATE_LAUNCH_MARKERS = (
    "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DYNAMO_MODE",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH",
)
# torchrun / torch.distributed.elastic set these in every worker.
_TORCHRUN_MARKERS = ("LOCAL_RANK", "RANK", "WORLD_SIZE")


def in_launched_worker(environ=None) -> bool:
    """True inside a process started by `accelerate launch` / torchrun (by this module or by hand)."""
    env = os.environ if environ is None else environ
    if env.get(LAUNCHED_ENV):
        return True
    return all(name in env for name in _ACCELERATE_LAUNCH_MARKERS) or all(name in env for name in _TORCHRUN_MARKERS)
