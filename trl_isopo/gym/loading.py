"""Prompt datasets for the `trl-isopo isopo|tpo|grpo` commands, located the way TRL users name them.

`load_split(name, config, split)` accepts:
- a data file `.jsonl` / `.json` / `.parquet` / `.csv` (its rows are every split: a file has no train/test split),
- a `Dataset.save_to_disk` / `DatasetDict.save_to_disk` folder,
- any other local folder (data files, loaded by `datasets.load_dataset(folder)`) or a Hub dataset id.

`check_prompt_column` raises the error a user can act on when a dataset has no `prompt` column (GRPO-style trainers
read only `prompt`; every other column is passed to the reward functions under its own name).
"""

from __future__ import annotations

import os

DATA_FILE_BUILDERS = {"jsonl": "json", "json": "json", "parquet": "parquet", "csv": "csv"}


def is_data_file(path: str | None) -> bool:
    """True for an existing file whose extension names a `datasets` builder."""
    return bool(path) and os.path.isfile(path) and data_file_builder(path) is not None


def data_file_builder(path: str) -> str | None:
    return DATA_FILE_BUILDERS.get(os.path.splitext(path)[1].lower().lstrip("."))


def load_split(name: str, config: str | None = None, split: str = "train", streaming: bool = False):
    """One split of a dataset named by a data file, a `save_to_disk` folder, a local folder or a Hub id."""
    from datasets import DatasetDict, load_dataset, load_from_disk

    if os.path.isfile(name):
        builder = data_file_builder(name)
        if builder is None:
            raise ValueError(
                f"Unsupported data file {name!r}: use one of {sorted('.' + e for e in DATA_FILE_BUILDERS)}."
            )
        return load_dataset(builder, data_files=name, split="train", streaming=streaming)
    if os.path.isdir(name) and any(
        os.path.exists(os.path.join(name, marker)) for marker in ("dataset_dict.json", "state.json")
    ):
        loaded = load_from_disk(name)
        if isinstance(loaded, DatasetDict):
            if split not in loaded:
                raise ValueError(f"{name!r} has splits {sorted(loaded)}, not {split!r}: set --dataset_train_split / "
                                 "--dataset_test_split.")
            return loaded[split]
        return loaded
    return load_dataset(name, config, split=split, streaming=streaming)


def check_prompt_column(dataset, where: str) -> None:
    """A clear error when `dataset` lacks TRL's `prompt` column (checked before the model is loaded)."""
    columns = dataset.column_names
    if columns is not None and "prompt" not in columns:
        raise ValueError(
            f"{where} has no `prompt` column (columns: {columns}). GRPO, ISOPO and TPO read the prompt from a "
            "`prompt` column (text or a list of chat messages); rename the question column, e.g. "
            "`dataset.rename_column('question', 'prompt')`, or use --task for Reasoning Gym / GSM8K data."
        )
