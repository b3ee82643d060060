"""Reward functions of the TPO paper's sequence tasks as TRL reward functions `f(completions, target, **kw) -> list`.

Scores are per completion, in [0, 1], and compare words position by position with the target:
- bag-of-tokens: fraction of the H positions whose symbol is correct (the sequence-level sum of the paper's
  per-token rewards 1{y_t = target_t}, divided by H);
- sequential: fraction of positions before the first mistake (per-token credit alive_t * 1{y_t = target_t});
- terminal (exact match): 1 if the completion equals the target exactly, else 0 (the paper's all-correct flag).
A missing position counts as a mistake; extra words beyond H make exact match fail and are otherwise ignored.
"""

from __future__ import annotations

from collections.abc import Sequence


def _words(text) -> list[str]:
    """Completion text (or a chat-style list of messages) -> list of words."""
    if isinstance(text, list):  # conversational completions: [{"role": "assistant", "content": ...}]
        text = " ".join(m["content"] for m in text)
    return str(text).split()


def bag_of_tokens_score(completion: Sequence[str], target: Sequence[str]) -> float:
    """Fraction of target positions matched: sum_t 1{y_t = target_t} / H."""
    hits = sum(1 for y, t in zip(completion, target) if y == t)
    return hits / len(target)


def sequential_score(completion: Sequence[str], target: Sequence[str]) -> float:
    """Fraction of target positions correct before the first mistake (credit stops at the first error)."""
    n = 0
    for y, t in zip(completion, target):
        if y != t:
            break
        n += 1
    return n / len(target)


def exact_match_score(completion: Sequence[str], target: Sequence[str]) -> float:
    """1.0 iff the completion equals the target word for word (same length), else 0.0."""
    return float(list(completion) == list(target))


def bag_of_tokens_reward(completions, target, **kwargs) -> list[float]:
    """TRL reward: bag-of-tokens score of each completion against its row's `target`."""
    return [bag_of_tokens_score(_words(c), _words(t)) for c, t in zip(completions, target)]


def sequential_reward(completions, target, **kwargs) -> list[float]:
    """TRL reward: sequential (up to the first mistake) score of each completion."""
    return [sequential_score(_words(c), _words(t)) for c, t in zip(completions, target)]


def exact_match_reward(completions, target, **kwargs) -> list[float]:
    """TRL reward: terminal exact-match score (0 or 1) of each completion."""
    return [exact_match_score(_words(c), _words(t)) for c, t in zip(completions, target)]


REWARDS = {
    "bag": bag_of_tokens_reward,
    "sequential": sequential_reward,
    "terminal": exact_match_reward,
}


def get_reward(name: str):
    """Reward function by name: "bag", "sequential" or "terminal"."""
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; choose from {sorted(REWARDS)}") from None
