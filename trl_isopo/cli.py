"""`trl-isopo` console script (no command prints this help).

`isopo`, `tpo`, `proma`, `grpo`: TRL's `trl grpo` arguments for each method (`trl_isopo.scripts.train`, method fixed);
`train`: a YAML recipe naming its method; `real`, `demo`, `compare`: this package's experiments. Each command lives
in a module exposing `main(argv)`. Also runnable as `python -m trl_isopo.cli ...` and
`accelerate launch -m trl_isopo.cli <command> ...`.
"""

from __future__ import annotations

import sys
from importlib import import_module

COMMANDS = {
    "isopo": ("trl_isopo.scripts.train", "train with ISOPO; the arguments of TRL's `trl grpo` plus ISOPO's knobs"),
    "tpo": ("trl_isopo.scripts.train", "train with TPO; the arguments of TRL's `trl grpo` plus TPO's knobs"),
    "proma": ("trl_isopo.scripts.train", "train with PROMA; the arguments of TRL's `trl grpo` plus PROMA's knobs"),
    "grpo": ("trl_isopo.scripts.train", "train with TRL's GRPO (baseline), same arguments and data options"),
    "real": ("trl_isopo.scripts.real", "RL fine-tuning of SmolLM2-135M-Instruct on a Reasoning Gym arithmetic task"),
    "demo": ("trl_isopo.scripts.demo", "GRPO vs REINFORCE vs ISOPO vs TPO on a tiny offline toy task (random-init model)"),
    "compare": ("trl_isopo.scripts.compare", "resumable sweeps over tasks / methods / seeds (paper reproduction)"),
    "train": ("trl_isopo.scripts.train", "train from a YAML recipe (GRPO, ISOPO or TPO), accelerate-launchable"),
}

METHOD_COMMANDS = ("isopo", "tpo", "proma", "grpo")


def _usage() -> str:
    lines = [f"usage: trl-isopo [{'|'.join(COMMANDS)}] [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`trl-isopo <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0].startswith("-"):
        print(f"trl-isopo: a command comes first\n\n{_usage()}", file=sys.stderr)
        return 2
    command = argv.pop(0)
    if command not in COMMANDS:
        print(f"unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = import_module(COMMANDS[command][0])
    if command in METHOD_COMMANDS:
        return int(module.main(argv, method=command) or 0)
    return int(module.main(argv) or 0)


if __name__ == "__main__":
    sys.exit(main())
