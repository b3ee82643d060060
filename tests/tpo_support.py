"""Shared by the TPO trainer tests: a small `TPOConfig` and the 2-process run script (tests/scripts/tpo_two_proc.py)
loaded as a module, whose `run` trains on deterministic completions."""

import importlib.util
from pathlib import Path

from trl_isopo import TPOConfig
from trl_isopo.tiny import tiny_training_args

TWO_PROC_SCRIPT = Path(__file__).parent / "scripts" / "tpo_two_proc.py"
_spec = importlib.util.spec_from_file_location("tpo_two_proc", TWO_PROC_SCRIPT)
two_proc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(two_proc)


def base_args(tmp_path, **kw):
    args = tiny_training_args(
        tmp_path / "out",
        max_completion_length=6,
        per_device_train_batch_size=8,
        num_generations=4,
        gradient_accumulation_steps=1,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-2,
        gradient_checkpointing=False,
        seed=0,
    )
    args.update(kw)
    return TPOConfig(**args)
