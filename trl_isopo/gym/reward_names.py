"""Reward functions by name, as `--reward_funcs` gives them to `trl-isopo train|grpo|isopo|tpo`.

A name is one of TRL's built-in rewards (`accuracy_reward`, `reasoning_accuracy_reward`, `think_format_reward`,
`get_soft_overlong_punishment`, as `trl grpo` registers them), one of this package's (`answer`, `last_number`,
`format`), or a dotted import path (`my_module.my_reward`, imported from the working directory). With a task
(`--task`), `answer` and `last_number` use the task's own scorer; with other data they compare the completion's number
with an `answer` column (a number, as in GSM8K).
"""

from __future__ import annotations

import os
import sys
from importlib import import_module

from .gsm8k import gsm8k_answer_reward, gsm8k_last_number_reward
from .rewards import format_reward

TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment")
ANSWER_COLUMN_REWARDS = ("answer", "last_number")  # the names that read an `answer` column without a task


def answer_column_rewards() -> dict:
    """This package's rewards for prompt datasets with an `answer` column (a number, as in GSM8K)."""
    return {"answer": gsm8k_answer_reward, "last_number": gsm8k_last_number_reward, "format": format_reward}


def trl_reward(name: str, max_completion_length: int):
    """A TRL built-in reward by name. `get_soft_overlong_punishment` uses the run's `max_completion_length` and a
    soft zone of its last 20 % (TRL's script hard-codes 1280 / 256, which punishes nothing for short runs)."""
    from trl import rewards

    if name == "get_soft_overlong_punishment":
        limit = max_completion_length
        return rewards.get_soft_overlong_punishment(max_completion_len=limit, soft_punish_cache=max(1, limit // 5))
    if name in ("accuracy_reward", "reasoning_accuracy_reward"):
        from trl.import_utils import is_math_verify_available

        if not is_math_verify_available():
            raise ImportError(f"{name} needs math-verify: `pip install 'math-verify>=0.5.2'`.")
    return getattr(rewards, name)


def import_reward(path: str):
    """The function at a dotted import path, looked up from the working directory first."""
    module_path, name = path.rsplit(".", 1)
    sys.path.insert(0, os.getcwd())
    try:
        return getattr(import_module(module_path), name)
    finally:
        sys.path.pop(0)


def resolve_reward_funcs(script_args, training_args, task_rewards: dict | None) -> list:
    """Reward functions/models from `script_args.reward_model_name_or_path` and `script_args.reward_funcs` (names,
    task reward names, dotted paths). `task_rewards`: the task's `answer` / `last_number` / `format`, or None for data
    without a task (then `answer` is the default only with a task)."""
    funcs: list = []
    if script_args.reward_model_name_or_path:
        funcs.append(script_args.reward_model_name_or_path)
    ours = task_rewards if task_rewards is not None else answer_column_rewards()
    for name in script_args.reward_funcs or (["answer"] if task_rewards else []):
        if name in TRL_REWARDS:
            funcs.append(trl_reward(name, training_args.max_completion_length))
        elif name in ours:
            funcs.append(ours[name])
        elif "." in name:
            funcs.append(import_reward(name))
        else:
            known = sorted(TRL_REWARDS) + sorted(ours)
            raise ValueError(f"Unknown reward function {name!r}: use one of {known} or a dotted import path.")
    return funcs
