"""One TPOTrainer run on deterministic completions; importable (1 process) or launched under 2 gloo processes.

`python -m accelerate.commands.launch --multi_gpu --num_processes 2 ... tpo_two_proc.py MODEL_DIR OUT.pt PER_DEVICE GA
[NUM_ITERATIONS [EVAL_BATCH]]` writes (rank 0) the parameter update, the log history (with EVAL_BATCH, the
evaluation's metrics as its last entry) and per-rank group checks to OUT.pt. The completions depend only on (prompt,
index within the group over all processes), so any split of the same effective batch sees the same data.
"""

import os
import sys
import zlib

from trl_isopo.tiny import set_offline_env

set_offline_env()

import torch  # noqa: E402

K = 4
NUM_PROMPTS_PER_STEP = 2  # effective batch: 2 groups of K = 8 completions


def make_rollout(tokenizer, group_size=K):
    """A deterministic `rollout_func`: completion j of prompt p is a hash of (p, j); fake sampling log-probs."""
    eos = tokenizer.eos_token_id
    first_word = len(tokenizer) - 18  # the 18 ordinary words ("count", ":", "a".."p")

    def rollout(prompts, trainer):
        prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        completions = []
        offset = trainer.accelerator.process_index * len(prompts)  # a group may straddle processes
        for i, p in enumerate(prompts, start=offset):
            h = zlib.crc32(f"{p}|{i % group_size}".encode())
            n = 2 + h % 5
            toks = [first_word + 2 + (h >> (2 * t)) % 4 for t in range(n)]  # words a..d
            if h % 2:
                toks.append(eos)
            completions.append(toks)
        # Sampling log-probs are deliberately wrong: TPO must ignore them (p_old comes from the training model).
        logprobs = [[-1.0] * len(c) for c in completions]
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": logprobs}

    return rollout


def run(
    model_dir, out_dir, per_device, ga, num_iterations=2, max_steps=2, on_loss=None, reward=None, eval_batch=None,
    **overrides,
):
    """Train `max_steps` SGD steps; return (parameter deltas, log history, group checks, trainer).

    `on_loss(trainer, model, inputs, loss)` is called after every `_compute_loss` (for in-loop oracles). With
    `eval_batch`, the trainer evaluates once after training on 4 prompts with that per-device eval batch size.
    """
    from trl_isopo import TPOConfig, TPOTrainer
    from trl_isopo.tiny import load_tiny_tokenizer, tiny_prompt_dataset, tiny_reward, tiny_training_args

    tokenizer = load_tiny_tokenizer(model_dir)
    checks = []

    class CheckedTPOTrainer(TPOTrainer):
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)  # writes q into `inputs` when it builds it there
            ids = inputs["prompt_ids"]
            whole = ids.shape[0] % K == 0
            if whole:
                blocks = ids.view(-1, K, ids.shape[1])
                whole = bool((blocks == blocks[:, :1]).all())
            checks.append(
                {
                    "rank": self.accelerator.process_index,
                    "rows": ids.shape[0],
                    "whole_groups": whole,
                    "targets": inputs["tpo_targets"].clone(),
                }
            )
            if on_loss is not None:
                on_loss(self, model, inputs, loss)
            return loss

    kwargs = tiny_training_args(
        out_dir,
        max_completion_length=8,
        per_device_train_batch_size=per_device,
        gradient_accumulation_steps=ga,
        num_generations=K,
        num_iterations=num_iterations,
        max_steps=max_steps,
        logging_steps=1,
        optim="sgd",
        learning_rate=0.05,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        gradient_checkpointing=False,
        seed=0,
    )
    if eval_batch is not None:
        kwargs["per_device_eval_batch_size"] = eval_batch
    kwargs.update(overrides)
    args = TPOConfig(**kwargs)
    trainer = CheckedTPOTrainer(
        model_dir,
        reward or tiny_reward,
        args=args,
        train_dataset=tiny_prompt_dataset(8),
        eval_dataset=tiny_prompt_dataset(4) if eval_batch is not None else None,
        processing_class=tokenizer,
        rollout_func=make_rollout(tokenizer),
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    if eval_batch is not None:
        trainer.state.log_history.append(trainer.evaluate())
    deltas = {n: (p.detach() - before[n]) for n, p in trainer.model.named_parameters()}
    return deltas, trainer.state.log_history, checks, trainer


def main():
    model_dir, out_path, per_device, ga = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    num_iterations = int(sys.argv[5]) if len(sys.argv) > 5 else 2
    eval_batch = int(sys.argv[6]) if len(sys.argv) > 6 else None
    torch.set_num_threads(1)
    deltas, logs, checks, trainer = run(
        model_dir, os.path.dirname(out_path) + "/run", per_device, ga, num_iterations, eval_batch=eval_batch
    )
    from accelerate.utils import gather_object

    all_checks = gather_object([{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in c.items()} for c in checks])
    # parameters must be identical on both ranks after DDP
    flat = torch.cat([d.reshape(-1) for d in deltas.values()])
    gathered = trainer.accelerator.gather(flat[None])
    if trainer.accelerator.is_main_process:
        torch.save(
            {
                "deltas": deltas,
                "logs": logs,
                "checks": all_checks,
                "world_size": trainer.accelerator.num_processes,
                "rank_param_diff": (gathered[0] - gathered[1]).abs().max().item() if gathered.shape[0] > 1 else 0.0,
            },
            out_path,
        )


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
    from _launch import end_world

    end_world()
