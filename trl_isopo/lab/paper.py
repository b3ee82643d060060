"""Published numbers of the TPO paper (arXiv 2604.06159 §3.6, Table 3) that the lab can be compared with.

Keys are names of `trl_isopo.methods`: the paper's GRPO has a KL term (`grpo-kl`), its "GRPO (no KL)" is `grpo`.
Values are fractions (0.069 = 6.9%); None = the paper's "-" (above 95%).
"""

from __future__ import annotations

# Table 3: terminal exact-match reward, reverse_copy, V=2, K=8, B=100, 2000 episodes, 20 seeds, 4 epochs.
# Final exact-match training error at the last episode. "prompt" / "interaction" matching.
TABLE3 = {
    "prompt": {
        "tpo": {7: 0.069, 8: 0.086, 9: 0.061, 10: 0.074},
        "grpo-kl": {7: 0.145, 8: 0.276, 9: 0.300, 10: 0.504},
        "grpo": {7: 0.666, 8: 0.925, 9: None, 10: None},
    },
    "interaction": {
        "tpo": {7: 0.018, 8: 0.028, 9: 0.053, 10: 0.190},
        "grpo-kl": {7: 0.096, 8: 0.232, 9: 0.362, 10: 0.487},
        "grpo": {7: 0.781, 8: 0.838, 9: None, 10: None},
    },
}

# Reference JAX code on CPU, terminal reverse_copy, H=4, V=2, B=100, K=8, 2 seeds: seed-mean error at episodes.
H4_REFERENCE = {
    "tpo": {1: 0.931, 25: 0.606, 50: 0.172, 100: 0.039, 200: 0.046},
    "grpo-kl": {1: 0.931, 25: 0.770, 50: 0.608, 100: 0.566, 200: 0.356},
}

# Reference curves (npz shipped with the reference code), prompt-matched H=10, 20 seeds: seed-mean error at episodes.
H10_REFERENCE = {
    "tpo": {200: 0.948, 400: 0.677, 600: 0.432, 800: 0.353, 1000: 0.229, 1500: 0.110, 2000: 0.074},
    "grpo-kl": {200: 0.946, 400: 0.952, 600: 0.836, 800: 0.750, 1000: 0.629, 1500: 0.587, 2000: 0.504},
}


def paper_final(method: str, setting: dict, matching: str = "prompt"):
    """Table 3's final error for this (method, setting) if the setting is a Table 3 cell, else `KeyError`."""
    s = setting
    if not (s["task"] == "reverse_copy" and s["reward"] == "terminal" and s["vocab_size"] == 2
            and s["group_size"] == 8 and s["episodes"] == 2000):
        raise KeyError("not a Table 3 cell")
    return TABLE3[matching][method][s["horizon"]]
