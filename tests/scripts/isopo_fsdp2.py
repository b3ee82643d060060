"""ISOPO's per-layer backward under FSDP2 (`torch.distributed.fsdp.fully_shard`), 2 gloo ranks on CPU.

Every rank trains a tiny Qwen2 whose decoder layers and root are fully sharded (DTensor parameter shards); the ISOPO
Function runs inside FSDP2's forward/backward, where the module holds the all-gathered weight. Each rank takes one
half of every step's batch as its micro-batch (its own Fisher-sample seed). Rank 0 also trains, without any process
group, the same model on the same two halves as two micro-batches of one step, gradients averaged (FSDP2 averages
over ranks), the EMA folded over both. Written to `<out>.rank<r>.json`: the largest relative parameter difference
to that reference (rank 0), the EMA state, the covered-layer records per micro-batch, and whether parameters moved.

    accelerate launch --multi_gpu --num_processes 2 ... tests/scripts/isopo_fsdp2.py <out>
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from trl_isopo.isopo.isopo_backward import ISOPOBackward, ISOPOSettings
from trl_isopo.layerwise.micro_batch import MicroBatch
from trl_isopo.tiny import build_tiny_causal_lm, build_word_tokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the math settings
from math_settings import isopo_settings  # noqa: E402
from fsdp2_support import B, STEPS, max_rel_diff, shard, step_batch, surrogate_loss  # noqa: E402  (same folder)


def settings() -> ISOPOSettings:
    # c = 1 so that the EMA (synchronized across ranks) changes the coefficients; a Fisher sample smaller than the
    # valid tokens so that the sample seeds matter.
    return isopo_settings(p=-1.0, reg=1.0, fisher_tokens=6)


def micro_step(model, context, ids, mask, completion, advantages, seed):
    with context.micro_batch(MicroBatch(mask=mask, advantages=advantages, seed=seed)):
        surrogate_loss(model, ids, mask, completion).backward()


def build(tokenizer):
    model = build_tiny_causal_lm(tokenizer, hidden_size=32, intermediate_size=64, seed=3)
    context = ISOPOBackward(settings())
    names = context.install(model)
    return model, context, names


def reference_run(tokenizer, swap_seeds: bool = False):
    """One process: each step's two halves as two micro-batches, gradients averaged, EMA over both. `swap_seeds`
    (a negative control) gives each half the other half's Fisher-sample seed."""
    model, context, _ = build(tokenizer)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        ids, mask, completion, advantages = step_batch(step, tokenizer)
        opt.zero_grad(set_to_none=True)
        for r in range(2):
            rows = slice(r * B, (r + 1) * B)
            seed = 10 * step + (1 - r if swap_seeds else r)
            micro_step(model, context, ids[rows], mask[rows], completion[rows], advantages[rows], seed=seed)
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= 2
        context.ema.end_step()
        context.records.clear()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, dict(context.ema.ema)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 2, world
    torch.manual_seed(0)
    tokenizer = build_word_tokenizer()
    model, context, names = build(tokenizer)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    sharded = shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    records_per_micro_batch = []
    for step in range(STEPS):
        ids, mask, completion, advantages = step_batch(step, tokenizer)
        rows = slice(rank * B, (rank + 1) * B)
        opt.zero_grad(set_to_none=True)
        micro_step(model, context, ids[rows], mask[rows], completion[rows], advantages[rows], seed=10 * step + rank)
        records_per_micro_batch.append(len(context.records))

        def all_reduce(t):
            dist.all_reduce(t)
            return t

        context.ema.end_step(all_reduce, world)
        context.records.clear()
        opt.step()
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    result = {
        "rank": rank,
        "world_size": world,
        "sharded": sharded,
        "covered": names,
        "records_per_micro_batch": records_per_micro_batch,
        "ema": context.ema.ema,
        "changed": any(not torch.equal(full[n], start[n]) for n in full),
    }
    if rank == 0:
        want, want_ema = reference_run(tokenizer)
        result["max_rel_diff"] = max_rel_diff(full, want)
        result["control_rel_diff"] = max_rel_diff(full, reference_run(tokenizer, swap_seeds=True)[0])
        result["ema_matches_reference"] = set(want_ema) == set(context.ema.ema) and all(
            abs(want_ema[k] - context.ema.ema[k]) <= 1e-6 * abs(want_ema[k]) for k in want_ema
        )
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
