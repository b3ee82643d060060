"""ISOPOTrainer (or GRPOTrainer) under DeepSpeed ZeRO-2 or plain DDP, 2 gloo ranks on CPU (tests/_launch.py).

    accelerate launch --multi_gpu --num_processes 2 ... tests/scripts/isopo_zero2.py <out> <zero2|ddp> \
        --model_dir DIR [--trainer isopo|grpo] [--seed N] [--beta X] [--steps N] [--optim sgd] [--lr 0.1]

ZeRO-2 is switched on by the trainer config (`deepspeed=<dict>`) with `use_cpu=False` (accelerate drops DeepSpeed
when `cpu=True`). Without a GPU, DeepSpeed (0.19) picks its CPU accelerator, whose communication backend is gloo
(ccl only with oneccl_bindings_for_pytorch installed).

accelerate 1.15 on a GPU-less machine: a non-cpu PartialState finds no backend and reports a world of 1 (rank 0 on
every process) although DeepSpeed has initialized a gloo world of 2; DeepSpeed then fails with "train_batch_size is
not equal to micro_batch_per_gpu * gradient_acc_step * world_size 16 != 8 * 2 * 2". Configuring the state first
with backend="gloo" (and DeepSpeed on) gives the real world; the trainer reuses it (`use_configured_state`).

Written: `<out>.rank<r>.json` (world size, distributed type, ZeRO stage, optimizer class, parameter hash, EMA state,
whether parameters moved, logged losses) and, on rank 0, `<out>.params.pt` ({"start", "end"}: parameters by name).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode", choices=("zero2", "ddp"))
    parser.add_argument("--model_dir", required=True)  # made once by the caller: ranks must not race to write it
    parser.add_argument("--trainer", choices=("isopo", "grpo"), default="isopo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--steps", type=int, default=3)
    # SGD: Adam's first steps turn rounding-level gradient differences (e.g. k_proj.bias, whose exact gradient is 0)
    # into lr-sized updates, which hides the fp32 agreement.
    parser.add_argument("--optim", default="sgd")
    parser.add_argument("--lr", type=float, default=0.1)
    a = parser.parse_args()
    torch.set_num_threads(1)

    from accelerate import PartialState

    from trl_isopo.tiny import load_tiny_tokenizer, tiny_prompt_dataset, tiny_reward

    if a.trainer == "isopo":
        from trl_isopo import ISOPOConfig as Config
        from trl_isopo import ISOPOTrainer as Trainer

        extra = dict(isopo_fisher_tokens=16, isopo_reg=1.0)  # c > 0: the EMA statistics must agree across ranks
    else:
        from trl import GRPOConfig as Config
        from trl import GRPOTrainer as Trainer

        extra = {}
    zero2 = a.mode == "zero2"
    if zero2:
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")  # see the module docstring
        del os.environ["ACCELERATE_USE_DEEPSPEED"]
        extra["deepspeed"] = {
            "zero_optimization": {"stage": 2},
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",  # DeepSpeed's own default is 1.0; "auto" takes max_grad_norm as DDP does
        }
        extra["accelerator_config"] = {"use_configured_state": True}
    args = Config(
        output_dir=a.out + ".run", report_to="none", use_cpu=not zero2, bf16=False, save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, per_device_train_batch_size=8, gradient_accumulation_steps=2,
        num_generations=4, max_completion_length=6, max_steps=a.steps, logging_steps=1, learning_rate=a.lr,
        optim=a.optim, seed=a.seed, beta=a.beta, **extra,
    )
    state = PartialState(cpu=not zero2)
    trainer = Trainer(a.model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(64),
                      processing_class=load_tiny_tokenizer(a.model_dir))
    start = {n: p.detach().cpu().float().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    end = {n: p.detach().cpu().float().clone() for n, p in trainer.model.named_parameters()}
    digest = hashlib.sha256()
    for p in end.values():
        digest.update(p.numpy().tobytes())
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
    result = {
        "world_size": state.num_processes,
        "torch_world_size": torch.distributed.get_world_size(),
        "backend": torch.distributed.get_backend(),
        "distributed_type": str(trainer.accelerator.distributed_type),
        "zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else 0,
        "optimizer": type(optimizer).__name__,
        "engine": type(trainer.model_wrapped).__name__,
        "param_hash": digest.hexdigest(),
        "changed": any(not torch.equal(start[n], end[n]) for n in end),
        "ema": trainer.isopo_backward.ema.ema if a.trainer == "isopo" else None,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }
    with open(f"{a.out}.rank{state.process_index}.json", "w") as f:
        json.dump(result, f)
    if state.is_main_process:
        torch.save({"start": start, "end": end}, f"{a.out}.params.pt")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
    from _launch import end_world

    end_world()
