"""Reasoning Gym datasets for TRL: any registered task or a composite of several, offline and procedural.

Reasoning Gym 0.1.25 facts this module relies on (checked against that release; tests/test_gym.py guards them):

- `reasoning_gym.create_dataset(name, size=, seed=, **config)` builds the task's config dataclass, validates it and
  returns a `ProceduralDataset`; item `i` is regenerated deterministically from `(seed, i)`.
- Entries are `{"question", "answer", "metadata"}`; `metadata["source_dataset"]` names the task (also inside a
  composite). Entries are **not Arrow-safe** (graph_color has int dict keys, knights_knaves ragged lists), so the
  entry is stored as a JSON string in the `entry` column; every `score_answer` we ship tests for still works on the
  decoded entry.
- `create_dataset("composite", datasets=[DatasetSpec(name, weight, config)], size=, seed=)` samples a task per index;
  its `score_answer` dispatches on `metadata["source_dataset"]`.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_SYSTEM_PROMPT = "default"


def _require_reasoning_gym():
    try:
        import reasoning_gym
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "Reasoning Gym tasks need the `reasoning-gym` package: `pip install 'trl-isopo[gym]'`."
        ) from exc
    return reasoning_gym


def resolve_system_prompt(system_prompt: str | None) -> str | None:
    """`None`/`""`/`"none"` -> no system message; a key of `reasoning_gym.utils.SYSTEM_PROMPTS` (`default`,
    `DeepSeekZero`, `simple`, `direct`, `chain_of_draft`) -> that prompt; anything else is used verbatim."""
    if system_prompt is None or system_prompt.strip() == "" or system_prompt.strip().lower() == "none":
        return None
    try:
        from reasoning_gym.utils import SYSTEM_PROMPTS
    except ImportError:
        SYSTEM_PROMPTS = {}
        if system_prompt in ("default", "DeepSeekZero", "simple", "direct", "chain_of_draft"):
            _require_reasoning_gym()
    return SYSTEM_PROMPTS.get(system_prompt, system_prompt)


def make_prompt_messages(question: str, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> list[dict[str, str]]:
    """TRL conversational prompt: an optional system message, then the question as the user message."""
    system = resolve_system_prompt(system_prompt)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    return messages


def render_prompt(messages, tokenizer=None, chat_template_kwargs: Mapping[str, Any] | None = None):
    """Return `messages` unchanged (TRL applies the model's chat template at generation time), or, with a tokenizer,
    the text of the chat template with the generation prompt appended."""
    if tokenizer is None:
        return messages
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "The tokenizer has no chat template; pass `tokenizer=None` to keep conversational prompts or set "
            "`tokenizer.chat_template`."
        )
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **dict(chat_template_kwargs or {})
    )


def _json_default(obj):
    """Make numpy scalars, sets and other stragglers JSON-safe (tuples and str subclasses need nothing)."""
    item = getattr(obj, "item", None)
    if callable(item):  # numpy / torch scalars
        return item()
    tolist = getattr(obj, "tolist", None)
    if callable(tolist):  # numpy arrays
        return tolist()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    return str(obj)


def entry_to_json(entry: Mapping[str, Any]) -> str:
    """`json.dumps` of a Reasoning Gym entry (int dict keys become strings, tuples lists)."""
    return json.dumps(entry, default=_json_default)


def _composite_specs(task_config: Mapping[str, Any]):
    from reasoning_gym.composite import DatasetSpec

    raw = task_config.get("datasets")
    if not raw:
        raise ValueError(
            "task='composite' needs task_config={'datasets': [{'name': 'graph_color', 'weight': 1.0, "
            "'config': {...}}, "
            "...]} (or a mapping name -> {'weight': w, 'config': {...}})."
        )
    if isinstance(raw, Mapping):
        raw = [{"name": name, **(spec or {})} for name, spec in raw.items()]
    specs = []
    for spec in raw:
        if isinstance(spec, str):
            spec = {"name": spec}
        unknown = set(spec) - {"name", "weight", "config"}
        if unknown:
            raise ValueError(
                f"Composite dataset spec {spec} has unknown keys {sorted(unknown)}; use name/weight/config."
            )
        _check_task_name(spec["name"], allow_composite=False)
        specs.append(
            DatasetSpec(
                name=spec["name"], weight=float(spec.get("weight", 1.0)), config=dict(spec.get("config") or {})
            )
        )
    return specs


def _check_task_name(name: str, allow_composite: bool = True) -> None:
    from reasoning_gym.factory import DATASETS

    if name in DATASETS and (allow_composite or name != "composite"):
        return
    close = difflib.get_close_matches(name, list(DATASETS), n=3)
    hint = f" Did you mean {close}?" if close else ""
    raise ValueError(
        f"Unknown Reasoning Gym task {name!r}.{hint} `reasoning_gym.factory.DATASETS` lists the {len(DATASETS)} names."
    )


def make_procedural_dataset(task: str, size: int, seed: int, task_config: Mapping[str, Any] | None = None):
    """`reasoning_gym.create_dataset` with clear errors.

    `task_config` holds the task's config fields (difficulty knobs such as `num_colors`, `min_num_vertices`,
    `n_people`, `depth_constraint`); for `task="composite"` it is `{"datasets": [{"name", "weight", "config"}, ...]}`
    plus optional composite fields. Sub-datasets without an explicit `seed` get `seed + i + 1` (Reasoning Gym's rule).
    """
    reasoning_gym = _require_reasoning_gym()
    _check_task_name(task)
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"dataset size must be a positive integer, got {size!r}.")
    config = dict(task_config or {})
    for reserved in ("size", "seed"):
        if reserved in config:
            raise ValueError(f"Set `{reserved}` with the dataset_{reserved} argument, not inside task_config.")
    if task == "composite":
        config["datasets"] = _composite_specs(config)
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **config)
    except TypeError as exc:
        from dataclasses import fields

        from reasoning_gym.factory import DATASETS

        valid = [f.name for f in fields(DATASETS[task][1]) if f.name not in ("size", "seed")]
        raise ValueError(f"Bad task_config for {task!r}: {exc}. Valid config fields: {valid}.") from exc


def build_reasoning_gym_dataset(
    task,
    size: int | None = None,
    seed: int = 0,
    task_config: Mapping[str, Any] | None = None,
    tokenizer=None,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    chat_template_kwargs: Mapping[str, Any] | None = None,
):
    """A `datasets.Dataset` with columns `prompt`, `entry` (JSON string of the Reasoning Gym entry) and `task`.

    `task` is a task name (`"graph_color"`, `"knights_knaves"`, `"composite"`, ...) or an already built
    `ProceduralDataset` (then `size`, `seed`, `task_config` are ignored). `prompt` is TRL's conversational format
    (system prompt + question; TRL renders it with the model's chat template), or, when `tokenizer` is given, the
    rendered chat-template text with the generation prompt. Pair it with `ReasoningGymAnswerReward(procedural)`.
    """
    from datasets import Dataset

    if isinstance(task, str):
        if size is None:
            raise ValueError("build_reasoning_gym_dataset needs `size` when `task` is a name.")
        procedural = make_procedural_dataset(task, size=size, seed=seed, task_config=task_config)
    else:
        procedural = task
    rows = {"prompt": [], "entry": [], "task": []}
    for i in range(len(procedural)):
        entry = procedural[i]
        rows["prompt"].append(
            render_prompt(make_prompt_messages(entry["question"], system_prompt), tokenizer, chat_template_kwargs)
        )
        rows["entry"].append(entry_to_json(entry))
        rows["task"].append(str(entry["metadata"]["source_dataset"]))
    return Dataset.from_dict(rows)


def task_names(procedural) -> Sequence[str]:
    """Registered names a built dataset answers for (a composite: its sub-tasks)."""
    from reasoning_gym.composite import CompositeDataset
    from reasoning_gym.factory import DATASETS

    if isinstance(procedural, CompositeDataset):
        return list(procedural.datasets)
    return [name for name, (cls, _) in DATASETS.items() if type(procedural) is cls]
