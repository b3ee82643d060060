"""2 gloo processes x GA=1 (rank r trains on micro-batch X_r) for tests/test_isopo_batch_semantics.py: every
setting's gradients of `isopo_steps.STEPS` optimizer steps, saved by rank 0 (rank 1 saves its own to compare)."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ddp_support import tiny_world  # noqa: E402
from isopo_steps import SETTINGS, make_trainer, micro_batch, run_steps, with_reference  # noqa: E402

from trl_isopo.tiny import load_tiny_tokenizer  # noqa: E402


def main(out: str, data_seeds: str):
    state, model_dir = tiny_world(out)
    tokenizer = load_tiny_tokenizer(model_dir)
    seed = [int(s) for s in data_seeds.split(",")][state.process_index]
    results = {}
    for setting in SETTINGS:
        trainer = make_trainer(tokenizer, f"{out}.{setting}", setting, ga=1, batch_size=4)
        mb = micro_batch(tokenizer, seed)
        if trainer.beta:
            mb = with_reference(trainer, mb, seed)
        model = trainer.accelerator.prepare_model(trainer.model)
        results[setting] = run_steps(trainer, [mb], model=model)
    torch.save({"world_size": state.num_processes, "grads": results}, f"{out}.rank{state.process_index}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    from _launch import end_world

    end_world()
