"""Reward functions for Reasoning Gym tasks (TRL signature: `f(completions, **columns) -> list[float]`).

- `ReasoningGymAnswerReward(procedural)`: for each completion, `reasoning_gym.utils.extract_answer` (the *last*
  `<answer>...</answer>` block, stripped; `None` when there is none) and then the task's own
  `score_answer(answer, entry)` on the entry decoded from the `entry` column. A composite (or any mix of tasks) is
  scored by the sub-task named in `entry["metadata"]["source_dataset"]`. So the reward *is* Reasoning Gym's score:
  graph_color 1.0 / 0.01 (parses as JSON, wrong) / 0.0; knights_knaves 1.0 / 0.3 + 0.7*fraction / 0.0.
- `format_reward`: 1.0 when the completion contains exactly one non-empty `<answer>...</answer>` block and nothing but
  whitespace after it, else 0.0 (free reasoning text, with or without `<think>` tags, may precede it).
- `ReasoningGymLastNumberReward(procedural)`: the same scores, but the answer is the *last number* in the completion
  (`extract_last_number`), for small models that do not use `<answer>` tags (`gsm8k.gsm8k_last_number_reward` does
  the same for GSM8K).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any


def completion_text(completion) -> str:
    """The text of a TRL completion: a string (standard format) or a list of messages (conversational format;
    the assistant messages' contents are concatenated)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        completion = [completion]
    parts = []
    for message in completion:
        if message.get("role", "assistant") != "assistant":
            continue
        content = message.get("content") or ""
        if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}]
            content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
        parts.append(content)
    return "".join(parts)


_ANSWER_OPEN = re.compile(r"<answer>")
_FORMAT = re.compile(r"<answer>(?P<body>.*?)</answer>\s*\Z", flags=re.DOTALL)


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 iff exactly one `<answer>` block, non-empty, ending the completion (trailing whitespace allowed)."""
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        match = _FORMAT.search(text)
        ok = match is not None and len(_ANSWER_OPEN.findall(text)) == 1 and match.group("body").strip() != ""
        rewards.append(1.0 if ok else 0.0)
    return rewards


def _decode_entry(entry) -> dict[str, Any]:
    if isinstance(entry, str):
        return json.loads(entry)
    if isinstance(entry, Mapping):
        return dict(entry)
    raise TypeError(f"Reasoning Gym entry must be a JSON string or a dict, got {type(entry).__name__}.")


class ReasoningGymAnswerReward:
    """Reward = the task's own `score_answer` on the extracted `<answer>` block (see module doc).

    `datasets` is the `ProceduralDataset` the training data was built from (single task or composite), a mapping
    name -> dataset, or `None`. Tasks not found there are scored by a default-config instance of the task
    (`reasoning_gym.get_score_answer_fn`), which is exact for every task whose `score_answer` reads only the entry.
    """

    def __init__(self, datasets=None, name: str = "reasoning_gym_answer"):
        from .reasoning_gym_data import _require_reasoning_gym, task_names

        _require_reasoning_gym()
        self.__name__ = name
        self._scorers: dict[str, Any] = {}
        if datasets is None:
            return
        if isinstance(datasets, Mapping):
            for task, ds in datasets.items():
                self._scorers[task] = ds.score_answer
            return
        from reasoning_gym.composite import CompositeDataset

        if isinstance(datasets, CompositeDataset):
            for task, ds in datasets.datasets.items():
                self._scorers[task] = ds.score_answer
        else:
            for task in task_names(datasets):
                self._scorers[task] = datasets.score_answer

    def _scorer(self, task: str):
        if task not in self._scorers:
            from reasoning_gym import get_score_answer_fn

            self._scorers[task] = get_score_answer_fn(task)
        return self._scorers[task]

    def score(self, text: str, entry) -> float:
        from reasoning_gym.utils import extract_answer

        entry = _decode_entry(entry)
        answer = extract_answer(text)
        return float(self._scorer(entry["metadata"]["source_dataset"])(answer, entry))

    def __call__(self, completions, entry=None, **kwargs) -> list[float]:
        if entry is None:
            raise ValueError(
                "ReasoningGymAnswerReward needs the dataset's `entry` column (JSON strings from "
                "build_reasoning_gym_dataset); keep `remove_unused_columns=False` (GRPOConfig's default)."
            )
        return [self.score(completion_text(c), e) for c, e in zip(completions, entry, strict=True)]


# A number as written in prose: optional sign (not when glued to a preceding word/number, so "15-43" ends in "43"),
# digits with optional thousands commas, optional decimals; or a bare ".5".
_LAST_NUMBER = re.compile(r"(?:(?<![\w)])[-+])?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)")


def extract_last_number(text: str) -> str | None:
    """The last integer/decimal in `text` (`"23 + 45 = 68."` -> `"68"`, `"is -1,200.5"` -> `"-1200.5"`), commas
    removed; `None` when the text has no number."""
    matches = _LAST_NUMBER.findall(text)
    return matches[-1].replace(",", "") if matches else None


class ReasoningGymLastNumberReward(ReasoningGymAnswerReward):
    """Reward = the task's own `score_answer` on the *last number* of the completion (0.0 when there is none).

    For numeric tasks (`chain_sum`, `basic_arithmetic`, ...) and small models that answer in free text instead of
    `<answer>` tags. Same constructor and call signature as `ReasoningGymAnswerReward`."""

    def __init__(self, datasets=None, name: str = "reasoning_gym_last_number"):
        super().__init__(datasets, name=name)

    def score(self, text: str, entry) -> float:
        answer = extract_last_number(text)
        if answer is None:
            return 0.0
        entry = _decode_entry(entry)
        return float(self._scorer(entry["metadata"]["source_dataset"])(answer, entry))

