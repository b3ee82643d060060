"""Task generators of the lab (arXiv 2604.06159 §3): targets, text form, datasets."""

import numpy as np
import pytest

from trl_isopo.lab import tasks


@pytest.mark.parametrize(
    "task, vocab, prompt, expected",
    [
        ("copy", 2, [1, 0, 0, 1, 1], [1, 0, 0, 1, 1]),
        ("flip", 2, [1, 0, 0, 1, 1], [0, 1, 1, 0, 0]),
        ("reverse_copy", 2, [1, 0, 0, 1, 1], [1, 1, 0, 0, 1]),
        ("reverse_flip", 2, [1, 0, 0, 1, 1], [0, 0, 1, 1, 0]),
        ("copy", 5, [4, 0, 2], [4, 0, 2]),
        ("flip", 5, [4, 0, 2], [0, 4, 2]),
        ("reverse_copy", 5, [4, 0, 2], [2, 0, 4]),
        ("reverse_flip", 5, [4, 0, 2], [2, 4, 0]),
    ],
)
def test_targets_hand_made(task, vocab, prompt, expected):
    assert tasks.target_sequence(prompt, task, vocab) == expected


def test_target_rejects_bad_input():
    with pytest.raises(ValueError, match="unknown task"):
        tasks.target_sequence([0, 1], "sort", 2)
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        tasks.target_sequence([0, 2], "copy", 2)


def test_text_round_trip():
    assert tasks.symbols_to_text([1, 0, 12]) == "1 0 12"
    assert tasks.text_to_symbols("1 0 12") == ["1", "0", "12"]


def test_random_prompts_reproducible_and_in_range():
    a = tasks.random_prompts(500, 7, 3, seed=4)
    b = tasks.random_prompts(500, 7, 3, seed=4)
    c = tasks.random_prompts(500, 7, 3, seed=5)
    assert a.shape == (500, 7) and np.array_equal(a, b) and not np.array_equal(a, c)
    assert set(np.unique(a)) == {0, 1, 2}


def test_build_dataset_columns_match_targets():
    ds = tasks.build_dataset("reverse_flip", horizon=4, vocab_size=3, num_prompts=20, seed=0)
    assert ds.column_names == ["prompt", "target"] and len(ds) == 20
    prompts = tasks.random_prompts(20, 4, 3, seed=0)
    for row, p in zip(ds, prompts):
        assert row["prompt"] == " ".join(map(str, p))
        assert row["target"] == " ".join(str(2 - x) for x in p[::-1])
