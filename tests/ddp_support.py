"""The rank side of the 2-process gloo tests (tests/_launch.py starts the processes): the world and its tiny model,
and a training run's parameter fingerprint that the test compares across ranks."""

import hashlib

import torch
from accelerate import PartialState

from trl_isopo.tiny import make_tiny_model_dir


def tiny_world(out: str) -> tuple[PartialState, str]:
    """This rank's state and the tiny model directory `out + ".model"` (written once, by the main process)."""
    torch.set_num_threads(1)
    state = PartialState(cpu=True)  # without cpu=True a GPU-less "--multi_gpu" launch reports rank 0 everywhere
    model_dir = out + ".model"
    with state.main_process_first():
        make_tiny_model_dir(model_dir)
    return state, model_dir


def train_fingerprint(trainer) -> dict:
    """Runs `trainer.train()`; returns the SHA-256 of the trained parameters and whether any of them changed."""
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    digest, changed = hashlib.sha256(), False
    for n, p in trainer.model.named_parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
        changed |= not torch.equal(before[n], p)
    return {"param_hash": digest.hexdigest(), "changed": changed}
