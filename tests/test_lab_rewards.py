"""Reward functions of the lab: exact scores on hand-made completions."""

import pytest

from trl_isopo.lab.rewards import (
    bag_of_tokens_reward,
    exact_match_reward,
    get_reward,
    sequential_reward,
)

TARGET = "1 0 0 1"
CASES = [  # completion, bag, sequential, exact
    ("1 0 0 1", 1.0, 1.0, 1.0),
    ("1 0 1 1", 0.75, 0.5, 0.0),
    ("0 0 0 1", 0.75, 0.0, 0.0),
    ("0 1 1 0", 0.0, 0.0, 0.0),
    ("1 0 0", 0.75, 0.75, 0.0),  # a missing position is a mistake
    ("1 0 0 1 1", 1.0, 1.0, 0.0),  # an extra word breaks exact match only
    ("", 0.0, 0.0, 0.0),
]


@pytest.mark.parametrize("completion, bag, seq, exact", CASES)
def test_scores_hand_made(completion, bag, seq, exact):
    assert bag_of_tokens_reward([completion], target=[TARGET]) == [bag]
    assert sequential_reward([completion], target=[TARGET]) == [seq]
    assert exact_match_reward([completion], target=[TARGET]) == [exact]


def test_trl_signature_batches_and_ignores_extra_kwargs():
    comps = ["1 0", "0 1", "1 1"]
    targets = ["1 0", "1 0", "1 1"]
    kw = dict(prompts=["0 1"] * 3, completion_ids=[[5, 4]] * 3, trainer_state=None)
    assert exact_match_reward(comps, target=targets, **kw) == [1.0, 0.0, 1.0]
    assert bag_of_tokens_reward(comps, target=targets, **kw) == [1.0, 0.0, 1.0]
    assert sequential_reward(["1 1", "0 0"], target=["1 0", "1 0"], **kw) == [0.5, 0.0]


def test_conversational_completion():
    comp = [[{"role": "assistant", "content": "1 0 0 1"}]]
    assert exact_match_reward(comp, target=[TARGET]) == [1.0]


def test_get_reward():
    assert get_reward("terminal") is exact_match_reward
    assert get_reward("bag") is bag_of_tokens_reward
    assert get_reward("sequential") is sequential_reward
    with pytest.raises(ValueError, match="unknown reward"):
        get_reward("dense")
