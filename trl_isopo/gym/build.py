"""The training (and evaluation) data and the reward functions of one `trl-isopo train|grpo|isopo|tpo` run.

Three sources, chosen by the parsed script arguments (`trl_isopo.scripts.train_args.TrainScriptArguments`, plus the
training config and TRL's `DatasetMixtureConfig`):
- `--task gsm8k`: GSM8K from `dataset_name` (Hub id, file or folder), exact numeric-match rewards;
- `--task <Reasoning Gym task>` (or `composite`): procedural and offline, scored by the task's own `score_answer`;
- no task: `dataset_name` or a `datasets:` mixture with a `prompt` column, rewards from `reward_funcs`.

Each builder returns `(train, eval or None, hub dataset name or None, model-card description)`, a task's builder also
its own rewards (`answer`, `last_number`, `format`); `build_data_and_rewards` resolves `reward_funcs` against them
(`trl_isopo.gym.reward_names`).
"""

from __future__ import annotations

import json
import os

from .gsm8k import gsm8k_answer_reward, gsm8k_last_number_reward, load_gsm8k
from .loading import check_prompt_column, is_data_file, load_split
from .reasoning_gym_data import build_reasoning_gym_dataset, make_procedural_dataset
from .reward_names import ANSWER_COLUMN_REWARDS, resolve_reward_funcs
from .rewards import ReasoningGymAnswerReward, ReasoningGymLastNumberReward, format_reward


def _no_test_split(name: str) -> ValueError:
    return ValueError(
        f"dataset_name={name!r} is a single file, so it has no separate test split: pass the evaluation data with "
        "--eval_dataset_name (or --eval_strategy no)."
    )


def build_generic_data(script_args, training_args, dataset_args):
    """Prompt data from `dataset_name` or a `datasets:` mixture (TRL's `get_dataset`)."""
    from trl import get_dataset

    want_eval = training_args.eval_strategy != "no"
    if dataset_args is not None and dataset_args.datasets:
        if script_args.dataset_name:
            raise ValueError("Both `datasets:` and --dataset_name are set: keep one (TRL would ignore dataset_name).")
        loaded = get_dataset(dataset_args)
        train = loaded[script_args.dataset_train_split]
        eval_dataset = None
        if want_eval:
            if script_args.dataset_test_split not in loaded:
                raise ValueError(
                    f"eval_strategy={training_args.eval_strategy!r} needs an evaluation split but the mixture has "
                    f"{sorted(loaded)}: set `test_split_size` in the YAML or --eval_strategy no."
                )
            eval_dataset = loaded[script_args.dataset_test_split]
        sources = ", ".join(f"`{d.path}`" for d in dataset_args.datasets)
        description, hub = f"Data: mixture of {sources}.", None
    else:
        name = script_args.dataset_name
        common = dict(config=script_args.dataset_config, streaming=script_args.dataset_streaming)
        train = load_split(name, split=script_args.dataset_train_split, **common)
        eval_dataset = None
        if want_eval:
            eval_name = script_args.eval_dataset_name or name
            if is_data_file(eval_name) and eval_name == name:
                raise _no_test_split(name)
            eval_dataset = load_split(eval_name, split=script_args.dataset_test_split, **common)
        hub = None if os.path.exists(name) else name
        description = f"Data: `{name}` (split `{script_args.dataset_train_split}`)."
    check_prompt_column(train, "The training data")
    if eval_dataset is not None:
        check_prompt_column(eval_dataset, "The evaluation data")
    needs_answer = sorted(set(script_args.reward_funcs or []) & set(ANSWER_COLUMN_REWARDS))
    if needs_answer and train.column_names is not None and "answer" not in train.column_names:
        raise ValueError(
            f"reward(s) {needs_answer} compare the completion's number with an `answer` column, which the training "
            f"data lacks (columns: {train.column_names}). Add it, or use TRL's accuracy_reward (`solution` column)."
        )
    return train, eval_dataset, hub, description


def build_gsm8k_data(script_args, training_args, prompt_kwargs: dict):
    """GSM8K from `dataset_name` (default `openai/gsm8k`, config `main`), eval from `eval_dataset_name`; exact
    numeric-match rewards."""
    name = script_args.dataset_name or "openai/gsm8k"
    config = script_args.dataset_config or ("main" if name == "openai/gsm8k" else None)
    train = load_gsm8k(name, split=script_args.dataset_train_split, size=script_args.dataset_size, config=config,
                       **prompt_kwargs)
    eval_dataset = None
    if training_args.eval_strategy != "no":  # IntervalStrategy is a str enum
        eval_name = script_args.eval_dataset_name or name
        if os.path.isfile(eval_name) and eval_name == name:
            raise _no_test_split(name)
        eval_config = script_args.dataset_config or ("main" if eval_name == "openai/gsm8k" else None)
        eval_dataset = load_gsm8k(eval_name, split=script_args.dataset_test_split,
                                  size=script_args.eval_dataset_size, config=eval_config, **prompt_kwargs)
    hub = None if os.path.exists(name) else name
    description = (
        f"Data: GSM8K from `{name}` (split `{script_args.dataset_train_split}`, {len(train)} rows); "
        "reward: exact numeric match."
    )
    rewards = {"answer": gsm8k_answer_reward, "last_number": gsm8k_last_number_reward, "format": format_reward}
    return train, eval_dataset, hub, description, rewards


def build_reasoning_gym_data(script_args, training_args, prompt_kwargs: dict):
    """A Reasoning Gym task (or composite): `dataset_size` items from `dataset_seed`, scored by the task's own
    `score_answer`. The default eval seed `dataset_seed + dataset_size` keeps the eval items disjoint."""
    if script_args.dataset_size is None:
        raise ValueError(
            "Reasoning Gym tasks need `dataset_size` (number of procedural items), e.g. --dataset_size 10000."
        )
    procedural = make_procedural_dataset(
        script_args.task, size=script_args.dataset_size, seed=script_args.dataset_seed,
        task_config=script_args.task_config,
    )
    train = build_reasoning_gym_dataset(procedural, **prompt_kwargs)
    eval_dataset = None
    if training_args.eval_strategy != "no":
        eval_seed = script_args.eval_dataset_seed
        if eval_seed is None:
            eval_seed = script_args.dataset_seed + script_args.dataset_size
        eval_size = script_args.eval_dataset_size or 100
        if abs(eval_seed - script_args.dataset_seed) < max(script_args.dataset_size, eval_size):
            raise ValueError(
                f"eval_dataset_seed={eval_seed} overlaps the training items (Reasoning Gym item i uses seed + i "
                f"and dataset_seed={script_args.dataset_seed}, dataset_size={script_args.dataset_size}). Leave it "
                "unset or move it at least max(dataset_size, eval_dataset_size) away."
            )
        eval_procedural = make_procedural_dataset(
            script_args.task, size=eval_size, seed=eval_seed, task_config=script_args.task_config
        )
        eval_dataset = build_reasoning_gym_dataset(eval_procedural, **prompt_kwargs)
    description = (
        f"Data: Reasoning Gym `{script_args.task}` (size {script_args.dataset_size}, seed {script_args.dataset_seed}, "
        f"config `{json.dumps(script_args.task_config or {})}`); reward: the task's own `score_answer`."
    )
    rewards = {"answer": ReasoningGymAnswerReward(procedural), "last_number": ReasoningGymLastNumberReward(procedural),
               "format": format_reward}
    return train, eval_dataset, None, description, rewards


def build_data_and_rewards(script_args, training_args, tokenizer, dataset_args=None):
    """(train_dataset, eval_dataset or None, reward_funcs, hub dataset name or None, card description)."""
    if script_args.task is None:
        train, eval_dataset, hub, description = build_generic_data(script_args, training_args, dataset_args)
        return train, eval_dataset, resolve_reward_funcs(script_args, training_args, None), hub, description
    # `text`: prompts rendered with the tokenizer's chat template now; `conversational`: TRL renders them.
    render_with = tokenizer if script_args.prompt_format == "text" else None
    prompt_kwargs = dict(
        tokenizer=render_with,
        system_prompt=script_args.system_prompt,
        chat_template_kwargs=training_args.chat_template_kwargs if render_with is not None else None,
    )
    build = build_gsm8k_data if script_args.task == "gsm8k" else build_reasoning_gym_data
    train, eval_dataset, hub, description, task_rewards = build(script_args, training_args, prompt_kwargs)
    reward_funcs = resolve_reward_funcs(script_args, training_args, task_rewards)
    return train, eval_dataset, reward_funcs, hub, description
