"""PROMA's per-layer backward under FSDP2 (`torch.distributed.fsdp.fully_shard`), 2 gloo ranks on CPU.

Every rank trains a tiny Qwen2 whose decoder layers and root are fully sharded (DTensor parameter shards); PROMA's
layer step runs inside FSDP2's forward/backward on the all-gathered weight and returns its increment, which FSDP2
reduce-scatters (the mean over ranks). Each rank takes one half of every step's batch, in `micro` micro-batches of
its own chain. Rank 0 also computes, without any process group, the same update from the same halves: the mean of
the two ranks' chains, each run in order in one process, with the same sketch keys. Modes (argv[2]): `intra` (one
micro-batch per rank: intra on each micro-batch needs no earlier one) and `accumulation` (2 micro-batches per rank:
the second projects the first's running gradient). Written to `<out>.rank<r>.json`.

    accelerate launch --multi_gpu --num_processes 2 ... tests/scripts/proma_fsdp2.py <out> <mode>
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from trl_isopo.proma.backward import PROMABackward, PROMAMicroBatch
from trl_isopo.tiny import build_tiny_causal_lm, build_word_tokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the math settings
from math_settings import proma_settings  # noqa: E402
from fsdp2_support import B, STEPS, max_rel_diff, shard, step_batch, surrogate_loss  # noqa: E402  (same folder)

MODES = {"intra": (proma_settings(mode="intra", intra_dim=3), 1),
         "accumulation": (proma_settings(mode="accumulation"), 2)}


def build(tokenizer, settings):
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, intermediate_size=64, seed=3)
    context = PROMABackward(settings)
    names = context.install(model)
    return model, context, names


def rank_chain(model, context, step, rank, micro, tokenizer, key_shift=0):
    """This rank's half of the step as `micro` micro-batches of one PROMA chain (S reset first)."""
    ids, mask, completion, advantages = step_batch(step, tokenizer)
    context.start_step()
    size = B // micro
    for j in range(micro):
        rows = slice(rank * B + j * size, rank * B + (j + 1) * size)
        mb = PROMAMicroBatch(mask=mask[rows], advantages=advantages[rows], index=j, active=True,
                             sketch_key=(step, rank + key_shift, j))
        with context.micro_batch(mb):
            surrogate_loss(model, ids[rows], mask[rows], completion[rows]).backward()


def reference_run(tokenizer, settings, micro, key_shift=0):
    """One process: per step, rank 0's chain then rank 1's chain, gradients averaged (what FSDP2's reduce-scatter
    gives). `key_shift` (a negative control) gives each chain the other rank's sketch keys."""
    model, context, _ = build(tokenizer, settings)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for r in range(2):
            rank_chain(model, context, step, r, micro, tokenizer, key_shift=(1 - 2 * r) * key_shift)
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= 2
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def main(out: str, mode: str) -> None:
    settings, micro = MODES[mode]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, world
    torch.manual_seed(0)
    tokenizer = build_word_tokenizer()
    model, context, names = build(tokenizer, settings)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    sharded = shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    projected = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        rank_chain(model, context, step, rank, micro, tokenizer)
        sums = context.pop_metrics()
        projected.append(float(sums[0, 0]))  # layer calls that projected ("active")
        opt.step()
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    result = {"rank": rank, "world_size": world, "sharded": sharded, "covered": names, "projected_calls": projected,
              "changed": any(not torch.equal(full[n], start[n]) for n in full)}
    if rank == 0:
        result["max_rel_diff"] = max_rel_diff(full, reference_run(tokenizer, settings, micro))
        if mode == "intra":
            result["control_rel_diff"] = max_rel_diff(full, reference_run(tokenizer, settings, micro, key_shift=1))
        else:  # each half as 4 micro-batches of one sequence: another chain, another update
            result["control_rel_diff"] = max_rel_diff(full, reference_run(tokenizer, settings, 2 * micro))
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
