"""Shared by the FSDP2 scripts (tests/scripts/isopo_fsdp2.py, proma_fsdp2.py): each step's batch, the
advantage-free surrogate loss of the per-layer backward on a tiny Qwen2, the sharding and the parameter comparison."""

from __future__ import annotations

import torch

STEPS, B, L, PROMPT = 3, 4, 10, 4  # B sequences per rank; 2B per step


def step_batch(step: int, tokenizer):
    """(ids (2B, L), mask (2B, L) bool, completion mask (2B, L) bool, advantages (2B,)) of one step."""
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(5, len(tokenizer), (2 * B, L), generator=g)
    mask = torch.ones(2 * B, L, dtype=torch.bool)
    for b in range(2 * B):  # left padding in prompts, right padding in completions, one empty completion
        mask[b, : b % 3] = False
        mask[b, L - (b % 4) :] = False
    mask[2 * B - 1, PROMPT:] = False
    completion = mask.clone()
    completion[:, :PROMPT] = False
    ids = ids.masked_fill(~mask, tokenizer.pad_token_id)
    advantages = torch.randn(2 * B, generator=g)
    return ids, mask, completion, advantages


def surrogate_loss(model, ids, mask, completion):
    """-sum_t log pi(y_t) over completion tokens / their count: the advantage-free seed of ISOPO's backward."""
    logits = model(input_ids=ids, attention_mask=mask.long()).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    m = completion[:, 1:]
    return -(logp * m).sum() / m.sum().clamp_min(1)


def shard(model) -> bool:
    """`fully_shard` every decoder layer, then the root; whether every parameter became a DTensor shard."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return all(type(p).__name__ == "DTensor" for p in model.parameters())


def max_rel_diff(got: dict, ref: dict) -> float:
    """Largest relative norm difference, over the parameters of `ref`, between two {name: tensor} dicts."""
    return max(float((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)) for n in ref)
