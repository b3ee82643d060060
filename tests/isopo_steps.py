"""Optimizer steps of ISOPOTrainer on prepared micro-batches (no generation), for the batch-semantics tests.

`run_steps` drives `ISOPOTrainer.training_step` exactly as TRL's training loop does for one optimizer step (the
gradient-sync flag set on the last micro-batch only, DDP-wrapped model under several processes), then applies a
plain SGD step (Adam's first step is nearly sign(g) and would hide a scale error). Used in one process by
tests/test_isopo_batch_semantics.py and in two gloo processes by tests/scripts/isopo_batch_split.py.
"""

from __future__ import annotations

import torch
from peft import LoraConfig

from trl_isopo import ISOPOConfig, ISOPOTrainer
from trl_isopo.tiny import build_tiny_causal_lm, tiny_prompt_dataset, tiny_reward, tiny_training_args

# Each setting: ISOPO knobs and options of the batch-semantics test. Every token in the Fisher estimate.
SETTINGS = {
    "p=-1,c=0": dict(isopo_p=-1.0, isopo_reg=0.0),
    "p=-1,c=1": dict(isopo_p=-1.0, isopo_reg=1.0),
    "q=-1,c=0": dict(isopo_p=0.0, isopo_q=-1.0, isopo_reg=0.0),
    "fig6": dict(isopo_p=0.0, isopo_q=-1.0, isopo_r=-2.0, isopo_reg=0.0),
    "p=-1,c=0,beta": dict(isopo_p=-1.0, isopo_reg=0.0, beta=0.2),
    "p=-1,c=0,lora": dict(isopo_p=-1.0, isopo_reg=0.0, lora=True),
    "fig6,beta,lora": dict(isopo_p=0.0, isopo_q=-1.0, isopo_r=-2.0, isopo_reg=0.0, beta=0.2, lora=True),
}
STEPS = 2  # the second step reads the EMA history written by the first (c > 0)
LR = 0.05


def micro_batch(tokenizer, seed: int, B: int = 4, P: int = 5, C: int = 5) -> dict:
    """B sequences with left-padded prompts, right-padded completions (one empty) and advantages with a zero."""
    g = torch.Generator().manual_seed(seed)
    words = [tokenizer.convert_tokens_to_ids(w) for w in "abcdefgh"]
    pad = tokenizer.pad_token_id
    prompt_ids, completion_ids = torch.full((B, P), pad), torch.full((B, C), pad)
    prompt_mask, completion_mask = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, C, dtype=torch.long)
    for b in range(B):
        lp = int(torch.randint(1, P + 1, (1,), generator=g))
        lc = 0 if b == 1 else int(torch.randint(1, C + 1, (1,), generator=g))
        prompt_ids[b, P - lp :] = torch.tensor(words)[torch.randint(len(words), (lp,), generator=g)]
        prompt_mask[b, P - lp :] = 1
        completion_ids[b, :lc] = torch.tensor(words)[torch.randint(len(words), (lc,), generator=g)]
        completion_mask[b, :lc] = 1
    advantages = torch.randn(B, generator=g, dtype=torch.float32)
    advantages[2] = 0.0
    return {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
            "completion_mask": completion_mask, "advantages": advantages}


def concat(*batches: dict) -> dict:
    """One micro-batch holding the rows of all `batches` (equal shapes)."""
    return {k: torch.cat([b[k] for b in batches]) for k in batches[0]}


def prepared_trainer(trainer_cls, config_cls, tokenizer, out_dir, ga: int, batch_size: int, lora: bool = False,
                     lora_targets=("q_proj", "v_proj", "up_proj"), beta: float = 0.0, **fields):
    """A float64 tiny-model `trainer_cls` fed prepared micro-batches (no generation, no clipping); `fields`: config
    fields. Shared by the ISOPO and PROMA step tests."""
    model = build_tiny_causal_lm(tokenizer, dtype=torch.float64, seed=1)
    peft_config = None
    if lora:  # random B too, so that every LoRA factor has a gradient on the first step
        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=list(lora_targets), init_lora_weights=False)
    args = config_cls(**tiny_training_args(
        out_dir, per_device_train_batch_size=batch_size, num_generations=4, gradient_accumulation_steps=ga,
        max_completion_length=5, gradient_checkpointing=False, max_grad_norm=0.0, use_cpu=True, **fields,
    ))  # fmt: skip
    trainer = trainer_cls(model, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(8),
                          processing_class=tokenizer, peft_config=peft_config)  # fmt: skip
    torch.manual_seed(7)
    with torch.no_grad():  # a trained-looking LoRA B: lora_A's gradient is not zero
        for n, p in trainer.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05)
    trainer._prepare_inputs = lambda inputs: inputs  # the micro-batches are given: no generation
    trainer.current_gradient_accumulation_steps = ga  # set by TRL's training loop
    trainer.beta = beta  # set after construction: the reference log-probs come with the micro-batches
    return trainer


def make_trainer(tokenizer, out_dir, setting: str, ga: int, batch_size: int) -> ISOPOTrainer:
    knobs = dict(SETTINGS[setting])
    return prepared_trainer(ISOPOTrainer, ISOPOConfig, tokenizer, out_dir, ga, batch_size,
                            lora=knobs.pop("lora", False), beta=knobs.pop("beta", 0.0), isopo_fisher_tokens=0, **knobs)


def with_reference(trainer, mb: dict, seed: int) -> dict:
    """mb plus fixed reference log-probs (the model's own, perturbed; independent of how batches are split)."""
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], 1)
    attention = torch.cat([mb["prompt_mask"], mb["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, ids.shape[1] - mb["prompt_ids"].shape[1])
    g = torch.Generator().manual_seed(seed)
    return {**mb, "ref_per_token_logps": logps + 0.3 * torch.randn(logps.shape, generator=g, dtype=logps.dtype)}


def run_steps(trainer: ISOPOTrainer, micro_batches: list[dict], model=None) -> list[dict[str, torch.Tensor]]:
    """STEPS optimizer steps over `micro_batches` (one accumulation window each); returns each step's gradients
    (name -> float64 tensor) and leaves the SGD-updated parameters in the model."""
    model = trainer.model if model is None else model
    window = micro_batches
    global_items = sum(int(mb["completion_mask"].sum()) for mb in window) * trainer.accelerator.num_processes
    out = []
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        for k, mb in enumerate(window):
            trainer.accelerator.gradient_state._set_sync_gradients(k == len(window) - 1)
            inputs = {**mb, "num_items_in_batch": torch.tensor(global_items)}
            trainer.training_step(model, inputs, inputs["num_items_in_batch"])
        params = {n.removeprefix("module."): p for n, p in model.named_parameters() if p.requires_grad}
        grads = {n: p.grad.detach().double().clone() for n, p in params.items() if p.grad is not None}
        with torch.no_grad():
            for n, p in params.items():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-LR)
        out.append(grads)
    return out


def rel_diff(a: dict, b: dict) -> float:
    """Largest relative difference over the parameters of two gradient dicts (same keys required)."""
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))[:5]
    return max(((a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-300)).item() for n in a)
