"""Sequence tasks of the TPO paper (arXiv 2604.06159 §3.4-3.6): a random prompt of H symbols over {0..V-1} and a
deterministic target.

Symbols are written as the words "0", "1", ..., "V-1" separated by single spaces, so the word-level tokenizer of
`trl_isopo.lab.model` maps each symbol to one token. The paper feeds the prompt with no BOS or separator token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

TARGETS = ("copy", "flip", "reverse_copy", "reverse_flip")


def target_sequence(prompt: Sequence[int], task: str, vocab_size: int) -> list[int]:
    """Target of `task`: copy = p, flip = (V-1) - p, reverse_copy = p[::-1], reverse_flip = (V-1) - p[::-1]."""
    p = [int(x) for x in prompt]
    if any(not 0 <= x < vocab_size for x in p):
        raise ValueError(f"prompt symbols must lie in [0, {vocab_size}), got {p}")
    if task == "copy":
        return p
    if task == "flip":
        return [vocab_size - 1 - x for x in p]
    if task == "reverse_copy":
        return p[::-1]
    if task == "reverse_flip":
        return [vocab_size - 1 - x for x in p[::-1]]
    raise ValueError(f"unknown task {task!r}; choose from {TARGETS}")


def symbols_to_text(symbols: Sequence[int]) -> str:
    """[1, 0, 1] -> "1 0 1" (the text form the tokenizer and reward functions use)."""
    return " ".join(str(int(s)) for s in symbols)


def text_to_symbols(text: str) -> list[str]:
    """Split a decoded completion into symbol words ("1 0 1" -> ["1", "0", "1"]); no validation, words stay strings."""
    return text.split()


def random_prompts(num_prompts: int, horizon: int, vocab_size: int, seed: int) -> np.ndarray:
    """(num_prompts, horizon) int array of i.i.d. uniform symbols, reproducible from `seed`."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(num_prompts, horizon))


def build_dataset(task: str, horizon: int, vocab_size: int, num_prompts: int, seed: int):
    """A `datasets.Dataset` with columns `prompt` (text, H symbols) and `target` (text, H symbols) for TRL.

    TRL forwards every non-prompt column to the reward functions, so `target` reaches them as a keyword argument.
    """
    from datasets import Dataset

    prompts = random_prompts(num_prompts, horizon, vocab_size, seed)
    return Dataset.from_dict(
        {
            "prompt": [symbols_to_text(p) for p in prompts],
            "target": [symbols_to_text(target_sequence(p, task, vocab_size)) for p in prompts],
        }
    )
