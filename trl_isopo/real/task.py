"""The real-model task: Reasoning Gym `chain_sum`, the answer read as the completion's last number.

SmolLM2-135M-Instruct does not write `<answer>` tags, so the reward is the task's own `score_answer` on the last
number of the completion (`ReasoningGymLastNumberReward`). The held-out set is generated from another seed and any
question that also occurs in the training split is dropped, so evaluation prompts are never trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ArithmeticTask:
    """A Reasoning Gym task with its difficulty knobs and the seeds of its two splits."""

    name: str = "chain_sum"
    config: dict = field(default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2})
    # Short and task-specific; it also replaces SmolLM2's ~20-token default system message (shorter sequences).
    system_prompt: str | None = "Answer with the final number."
    train_seed: int = 1000
    eval_seed: int = 2000

    def describe(self) -> str:
        knobs = ", ".join(f"{k}={v}" for k, v in sorted(self.config.items()))
        return f"Reasoning Gym {self.name} ({knobs}); reward = task score of the completion's last number"


def make_splits(task: ArithmeticTask, n_train: int, n_eval: int):
    """(train `datasets.Dataset` with `prompt` / `entry` / `task` columns, held-out entries (list of dicts),
    the procedural training dataset for the reward). Held-out questions never occur in the training split."""
    from trl_isopo.gym import build_reasoning_gym_dataset, make_procedural_dataset

    train_proc = make_procedural_dataset(task.name, size=n_train, seed=task.train_seed, task_config=task.config)
    seen = {train_proc[i]["question"] for i in range(len(train_proc))}
    pool = make_procedural_dataset(task.name, size=4 * n_eval + 64, seed=task.eval_seed, task_config=task.config)
    held_out = []
    for i in range(len(pool)):
        entry = pool[i]
        if entry["question"] not in seen and all(entry["question"] != e["question"] for e in held_out):
            held_out.append(entry)
        if len(held_out) == n_eval:
            break
    if len(held_out) < n_eval:
        raise ValueError(f"could not draw {n_eval} held-out {task.name} questions disjoint from the training split")
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
