"""ISOPOTrainer under a 2-process gloo world (launched by tests/_launch.py). Writes one JSON per rank."""

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ddp_support import tiny_world, train_fingerprint  # noqa: E402

from trl_isopo import ISOPOConfig, ISOPOTrainer  # noqa: E402
from trl_isopo.tiny import load_tiny_tokenizer, tiny_prompt_dataset, tiny_reward  # noqa: E402


def main(out: str):
    state, model_dir = tiny_world(out)
    args = ISOPOConfig(
        output_dir=out + ".run", report_to="none", use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=6, max_steps=3, logging_steps=1, learning_rate=1e-2, isopo_fisher_tokens=16, seed=0,
        isopo_reg=1.0,  # c > 0: the EMA statistics must agree across ranks
    )
    seen = []

    def reward(completions, **kw):
        seen.extend(completions)
        return tiny_reward(completions)

    trainer = ISOPOTrainer(model_dir, reward, args=args, train_dataset=tiny_prompt_dataset(64),
                           processing_class=load_tiny_tokenizer(model_dir))
    run = train_fingerprint(trainer)
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, seen)
    rank = state.process_index
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({
            "world_size": state.num_processes,
            **run,
            "ema": trainer.isopo_backward.ema.ema,
            "completions_differ_across_ranks": gathered[0] != gathered[1],
        }, f)


if __name__ == "__main__":
    main(sys.argv[1])
    from _launch import end_world

    end_world()
