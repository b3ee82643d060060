"""TPO groups and TRL's batching: batch-size checks, a whole-group shuffle, and a layout check.

TPO's loss is a softmax over each prompt's K completions. TRL lays groups out as K consecutive rows (RepeatSampler and
every generation backend), shards the generation batch across processes in contiguous blocks of
`per_device_train_batch_size * steps_per_generation` rows, and cuts micro-batches as contiguous blocks of
`per_device_train_batch_size` rows. With `per_device_train_batch_size % K == 0` and a shuffle that permutes whole
groups instead of rows, every micro-batch on every process holds whole groups. Otherwise groups are split, which TPO
supports only where it stays exact (see `group_batch_size_error`; docs/tpo.md, "How it plugs into GRPOTrainer").
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "splits_groups",
    "group_batch_size_error",
    "validate_group_batching",
    "shuffle_groups",
    "check_whole_groups",
    "gather_prompts",
]


def _divisors_at_least_2(n: int) -> list[int]:
    return [d for d in range(2, n + 1) if n % d == 0]


def splits_groups(batch_size: int, num_generations: int) -> bool:
    """Whether micro-batches of `batch_size` rows cut some group of `num_generations` consecutive rows."""
    return batch_size % num_generations != 0


def group_batch_size_error(
    batch_size: int,
    num_generations: int,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int | None = None,
) -> str | None:
    """The error for a `per_device_train_batch_size` that splits groups where TPO cannot use it, else None.

    Split groups work when every use of a generation batch lies inside one optimizer step
    (`gradient_accumulation_steps % steps_per_generation == 0`): each member's loss coefficient p_theta_i - q_i is
    then fixed before the step from the whole group (`tpo_row_coefficients`). With several optimizer steps per
    generation batch, TRL's cut would put one group's members into different optimizer steps, and a group's loss is a
    softmax over all of its members at one parameter value.
    """
    spg = steps_per_generation or gradient_accumulation_steps
    if not splits_groups(batch_size, num_generations) or gradient_accumulation_steps % spg == 0:
        return None
    multiples = ", ".join(str(num_generations * i) for i in range(1, 4))
    divisors = _divisors_at_least_2(batch_size)
    alt = f", or num_generations to one of {divisors}" if divisors else ""
    return (
        f"per_device_train_batch_size={batch_size} is not a multiple of num_generations={num_generations}, so "
        "micro-batches split groups. TPO's loss is a softmax over all members of a group at one parameter value, so "
        "split groups need every use of a generation batch inside one optimizer step (gradient_accumulation_steps a "
        f"multiple of steps_per_generation); got steps_per_generation={spg}, "
        f"gradient_accumulation_steps={gradient_accumulation_steps}. Set per_device_train_batch_size to a multiple "
        f"of {num_generations} ({multiples}, ...){alt}, or steps_per_generation to a divisor of "
        "gradient_accumulation_steps."
    )


def validate_group_batching(
    per_device_train_batch_size: int,
    num_generations: int,
    num_generations_eval: int | None = None,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int | None = None,
) -> None:
    """Raise `ValueError` for a group size TPO cannot use, or batching that splits groups where it cannot be exact.

    Evaluation batches may split groups freely: nothing moves the parameters between generation and the eval loss.
    """
    if num_generations < 2:
        raise ValueError(
            f"TPO needs num_generations >= 2 (the target is a softmax over a group of completions); got "
            f"{num_generations}."
        )
    msg = group_batch_size_error(
        per_device_train_batch_size, num_generations, gradient_accumulation_steps, steps_per_generation
    )
    if msg:
        raise ValueError(msg)
    # One completion per prompt is allowed for evaluation only: the group softmax of one member is 1, so q = p and
    # the eval loss is identically 0 (plus the KL term); rewards and the other metrics are still measured.
    if num_generations_eval is not None and num_generations_eval < 1:
        raise ValueError(f"TPO needs num_generations_eval >= 1 (or None); got {num_generations_eval}.")


def _num_rows(batch: dict[str, Any]) -> int:
    for v in batch.values():
        if isinstance(v, torch.Tensor) and v.ndim > 0:
            return v.shape[0]
        if isinstance(v, (list, tuple)):
            return len(v)
    raise ValueError("batch has no row-indexed entry")


def shuffle_groups(
    batch: dict[str, Any], group_size: int, generator: torch.Generator | None = None
) -> dict[str, Any]:
    """Permute whole blocks of `group_size` consecutive rows, in unison over every entry.

    Tensors with a first dimension and lists/tuples are permuted along it; None and 0-dim tensors (e.g.
    `num_items_in_batch`) are kept. Uses the global torch RNG unless `generator` is given (as TRL's row shuffle does).

    Args:
        batch: dict of `(N, ...)` tensors / length-N lists, N a multiple of `group_size`.
        group_size: K.

    Returns:
        a new dict with rows reordered as `[g_0 rows, g_1 rows, ...]` for a random permutation of the groups.
    """
    n = _num_rows(batch)
    if n % group_size != 0:
        raise ValueError(f"cannot shuffle whole groups: {n} rows is not a multiple of group_size={group_size}")
    blocks = torch.randperm(n // group_size, generator=generator)
    idx = (blocks[:, None] * group_size + torch.arange(group_size)[None, :]).reshape(-1)
    idx_list = idx.tolist()

    def take(v):
        if v is None:
            return None
        if isinstance(v, torch.Tensor):
            if v.ndim == 0:
                return v
            if v.shape[0] != n:
                raise ValueError(f"entry with {v.shape[0]} rows in a batch of {n} rows")
            return v[idx.to(v.device)]
        if isinstance(v, (list, tuple)):
            if len(v) != n:
                raise ValueError(f"entry with {len(v)} rows in a batch of {n} rows")
            return type(v)(v[i] for i in idx_list) if isinstance(v, tuple) else [v[i] for i in idx_list]
        return v

    return {k: take(v) for k, v in batch.items()}


def check_whole_groups(
    prompt_ids: torch.Tensor, prompt_mask: torch.Tensor | None, group_size: int, where: str = ""
) -> None:
    """Raise `RuntimeError` unless rows come in blocks of `group_size` that share one prompt.

    Args:
        prompt_ids: `(N, P)` (left-padded) prompt token ids.
        prompt_mask: optional `(N, P)` attention mask of the prompts.
        group_size: K.
    """
    n = prompt_ids.shape[0]
    suffix = f" ({where})" if where else ""
    if n % group_size != 0:
        raise RuntimeError(f"TPO: {n} rows are not whole groups of {group_size}{suffix}.")
    ids = prompt_ids.view(n // group_size, group_size, -1)
    same = (ids == ids[:, :1]).all()
    if prompt_mask is not None:
        pm = prompt_mask.view(n // group_size, group_size, -1)
        same = same & (pm == pm[:, :1]).all()
    if not bool(same):
        raise RuntimeError(
            "TPO: a block of num_generations consecutive rows holds different prompts, so a group was split"
            f"{suffix}. This should be impossible with per_device_*_batch_size % num_generations == 0; please report "
            "it with your batch-size settings."
        )


def gather_prompts(
    accelerator, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every process's left-padded `(N, P)` prompt ids and masks, in rank order, left-aligned to one width, with
    id 0 at padding (padding ids may differ between processes); for `check_whole_groups` when groups straddle
    processes. A collective: call it on every rank."""
    ids = accelerator.pad_across_processes(prompt_ids * prompt_mask, dim=1, pad_index=0, pad_first=True)
    mask = accelerator.pad_across_processes(prompt_mask, dim=1, pad_index=0, pad_first=True)
    return accelerator.gather(ids), accelerator.gather(mask)
