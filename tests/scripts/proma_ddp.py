"""PROMATrainer under a 2-process gloo world (launched by tests/test_proma_ddp.py): one optimizer step per setting of
`proma_steps.DDP_KNOBS` on rank r's micro-batches `DDP_SEEDS[setting][r]` with a DDP-wrapped model; each rank saves the
reduced gradients."""

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
from ddp_support import tiny_world  # noqa: E402
from proma_steps import DDP_KNOBS, DDP_SEEDS, make_trainer, micro_batches, run_step, sketches_by_content  # noqa: E402

from trl_isopo.tiny import load_tiny_tokenizer  # noqa: E402


def main(out: str):
    state, model_dir = tiny_world(out)
    tokenizer = load_tiny_tokenizer(model_dir)
    results = {}
    for setting, knobs in DDP_KNOBS.items():
        seeds = DDP_SEEDS[setting][state.process_index]
        trainer = make_trainer(tokenizer, f"{out}.{setting}", ga=len(seeds), **knobs)
        sketches_by_content(trainer)
        model = trainer.accelerator.prepare_model(trainer.model)
        results[setting] = run_step(trainer, micro_batches(tokenizer, seeds), model=model)
    torch.save({"world_size": state.num_processes, "grads": results}, f"{out}.rank{state.process_index}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
    from _launch import end_world

    end_world()
