"""The real-model task: a Reasoning Gym task whose answer is a number, read as the completion's last number.

SmolLM2-135M-Instruct does not write `<answer>` tags, so the reward is the task's own `score_answer` on the last
number of the completion (`ReasoningGymLastNumberReward`). Any Reasoning Gym task qualifies whose every answer is one
number that the last-number reading scores 1 (`chain_sum`, the default, and e.g. `basic_arithmetic`, `gcd`, `lcm`,
`products`, `leg_counting`, `count_bits`); `make_splits` checks both splits and refuses any other. The held-out set
is generated from another seed and any question that also occurs in the training split is dropped, so evaluation
prompts are never trained on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

CHAIN_SUM_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d+)?|\.\d+)")


@dataclass(frozen=True)
class ArithmeticTask:
    """A numeric Reasoning Gym task with its difficulty knobs and the seeds of its two splits."""

    name: str = "chain_sum"
    config: dict = field(default_factory=lambda: dict(CHAIN_SUM_CONFIG))
    # Short and task-specific; it also replaces SmolLM2's ~20-token default system message (shorter sequences).
    system_prompt: str | None = "Answer with the final number."
    train_seed: int = 1000
    eval_seed: int = 2000

    def describe(self) -> str:
        knobs = ", ".join(f"{k}={v}" for k, v in sorted(self.config.items()))
        return f"Reasoning Gym {self.name} ({knobs}); reward = task score of the completion's last number"


def task_from_cli(name: str | None, config_json: str | None) -> ArithmeticTask:
    """The task of `--task NAME --task-config JSON`: without a config, chain_sum keeps this job's 2-term, 1-2 digit
    setting and any other task its Reasoning Gym defaults."""
    if config_json is None:
        config = dict(CHAIN_SUM_CONFIG) if name in (None, "chain_sum") else {}
    else:
        try:
            config = json.loads(config_json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--task-config is not JSON ({exc}): {config_json!r}") from None
        if not isinstance(config, dict):
            raise ValueError(f"--task-config must be a JSON object of the task's config fields, got {config_json!r}")
    return ArithmeticTask(name=name or "chain_sum", config=config)


def check_numeric(task: ArithmeticTask, procedural, entries) -> None:
    """A ValueError unless every entry's answer is one number that the last-number reward (the `procedural`
    dataset's own `score_answer`) scores 1."""
    from trl_isopo.gym import extract_last_number

    for entry in entries:
        answer = str(entry["answer"]).strip()
        number = extract_last_number(answer)
        if not _NUMBER.fullmatch(answer.replace(",", "")) or number is None or float(
            procedural.score_answer(number, entry)
        ) != 1.0:
            raise ValueError(
                f"Reasoning Gym task {task.name!r} is not numeric: its answer {answer[:60]!r} (to "
                f"{entry['question'][:60]!r}...) is not one number that the last-number reward scores 1, so this "
                "job cannot train or score it. Choose a task whose answer is a number (e.g. chain_sum, "
                "basic_arithmetic, gcd, lcm, products, leg_counting, count_bits)."
            )


def make_splits(task: ArithmeticTask, n_train: int, n_eval: int):
    """(train `datasets.Dataset` with `prompt` / `entry` / `task` columns, held-out entries (list of dicts),
    the procedural training dataset for the reward). Held-out questions never occur in the training split; both
    splits are checked to be numeric (`check_numeric`)."""
    from trl_isopo.gym import build_reasoning_gym_dataset, make_procedural_dataset

    train_proc = make_procedural_dataset(task.name, size=n_train, seed=task.train_seed, task_config=task.config)
    entries = [train_proc[i] for i in range(len(train_proc))]
    check_numeric(task, train_proc, entries)
    seen = {e["question"] for e in entries}
    draws = 4 * n_eval + 64
    pool = make_procedural_dataset(task.name, size=draws, seed=task.eval_seed, task_config=task.config)
    held_out, questions = [], set()
    for i in range(len(pool)):
        entry = pool[i]
        if entry["question"] not in seen and entry["question"] not in questions:
            held_out.append(entry)
            questions.add(entry["question"])
        if len(held_out) == n_eval:
            break
    if len(held_out) < n_eval:
        raise ValueError(
            f"cannot draw {n_eval} held-out {task.name} questions disjoint from the {n_train}-question training split: "
            f"{draws} draws gave {len(held_out)} new distinct questions (the task's question space with config "
            f"{task.config} is too small). Lower the held-out size, or widen the task's config (e.g. more digits or "
            "terms)."
        )
    check_numeric(task, pool, held_out)
    train = build_reasoning_gym_dataset(train_proc, system_prompt=task.system_prompt)
    return train, held_out, train_proc


def make_reward(train_proc):
    """TRL reward function: the task's score of the last number in each completion (0.0 when there is none)."""
    from trl_isopo.gym import ReasoningGymLastNumberReward

    return ReasoningGymLastNumberReward(train_proc, name="last_number")


def score_text(train_proc, text: str, entry: dict) -> float:
    from trl_isopo.gym import extract_last_number

    answer = extract_last_number(text)
    return 0.0 if answer is None else float(train_proc.score_answer(answer, entry))
