"""ISOPO's own checkpoint state: the EMA statistics and the micro-step counter (the Fisher sample's seed), written
next to the optimizer's state so that a resumed run continues exactly (docs/isopo.md, "Checkpoints")."""

from __future__ import annotations

import json
import os

ISOPO_STATE_FILE = "isopo_state.json"


def save_isopo_state(output_dir: str, ema_state: dict, micro_step: int) -> None:
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, ISOPO_STATE_FILE), "w") as f:
        json.dump({"ema": ema_state, "micro_step": micro_step}, f)


def load_isopo_state(checkpoint: str) -> dict | None:
    """{"ema": ..., "micro_step": ...} of `checkpoint`, or None when it has no ISOPO state file."""
    path = os.path.join(checkpoint, ISOPO_STATE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
