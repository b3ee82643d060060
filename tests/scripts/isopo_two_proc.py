"""ISOPOTrainer under a 2-process gloo world (launched by tests/_launch.py). Writes one JSON per rank."""

import hashlib
import json
import os
import sys

import torch
from accelerate import PartialState

from trl_isopo import ISOPOConfig, ISOPOTrainer
from trl_isopo.tiny import load_tiny_tokenizer, make_tiny_model_dir, tiny_prompt_dataset, tiny_reward


def main(out: str):
    torch.set_num_threads(1)
    state = PartialState(cpu=True)  # without cpu=True a GPU-less "--multi_gpu" launch reports rank 0 everywhere
    model_dir = out + ".model"
    with state.main_process_first():
        make_tiny_model_dir(model_dir)
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
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    digest = hashlib.sha256()
    changed = False
    for n, p in trainer.model.named_parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
        changed |= not torch.equal(before[n], p)
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, seen)
    rank = state.process_index
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({
            "world_size": state.num_processes,
            "param_hash": digest.hexdigest(),
            "changed": changed,
            "ema": trainer.isopo_backward.ema.ema,
            "completions_differ_across_ranks": gathered[0] != gathered[1],
        }, f)


if __name__ == "__main__":
    main(sys.argv[1])
