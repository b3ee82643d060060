"""vLLM colocate on the CPU, one job per process (vLLM spawns workers and keeps process-wide distributed state).

    python tests/scripts/vllm_colocate.py model OUT --tokenizer DIR       a 2-layer tied Llama (random) with DIR's tokenizer
    python tests/scripts/vllm_colocate.py train METHOD MODEL OUT [--lora] [--no-apply]
    python tests/scripts/vllm_colocate.py probe OUT MODEL [MODEL ...]     fresh vLLMs' log-probs of the probe text

`train` trains METHOD (a name from trl_isopo.methods, e.g. grpo, isopo, tpo, proma) for 2 optimizer steps with
`use_vllm=True, vllm_mode="colocate"`, and syncs once more after the last step. Right after each sync it records the
in-trainer vLLM's log-probs of the probe text and saves the trainer's weights at that moment (LoRA merged) to
OUT/sync-<k>; OUT/result.json lists them. `probe` loads each saved directory into a fresh vLLM (one after another in
one process) and writes their log-probs of the probe. The GRPO control installs the CPU sync with the public
`apply_cpu_weight_sync`; this package's trainers install it themselves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zlib

PROBE = "user : count a b c assistant : The answer is 42, and 17 + 25 = 42 as well."
STEPS = 2
LR = 3e-2  # large, so that one step moves the tiny model's log-probs far beyond vLLM's bf16 rounding


def _env() -> None:
    from trl_isopo.tiny import set_offline_env

    set_offline_env()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def make_model(out: str, tokenizer_dir: str) -> None:
    """A tied 2-layer Llama (head dim 64: vLLM's CPU attention has no kernel below 32) over a real chat tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)


def varied_reward(completions, **kwargs) -> list[float]:
    """A deterministic reward that differs between completions (so advantages, and the update, are non-zero)."""
    return [float(zlib.crc32(str(c).encode()) % 7) for c in completions]


def probe_logprobs(llm) -> list[float]:
    """Log-probs of each probe token after the first, from `llm` (a vllm.LLM)."""
    from vllm import SamplingParams

    out = llm.generate([PROBE], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0), use_tqdm=False)[0]
    ids = out.prompt_token_ids
    return [float(d[t].logprob) for t, d in zip(ids[1:], out.prompt_logprobs[1:])]


def train(method: str, model: str, out: str, lora: bool, apply: bool) -> None:
    from datasets import Dataset

    from trl_isopo.methods import METHODS
    from trl_isopo.tiny import tiny_training_args
    from trl_isopo.vllm_cpu import apply_cpu_weight_sync, cpu_sync_weights

    spec = METHODS[method]
    prompts = [[{"role": "user", "content": f"count {w} :"}] for w in ("a b", "c", "a d", "b b c")] * 2
    sizes = dict(per_device_train_batch_size=8, num_generations=4, gradient_accumulation_steps=1)
    if spec.fields.get("gradient_accumulation_steps"):
        sizes = dict(per_device_train_batch_size=2, num_generations=4, gradient_accumulation_steps=4)
    args = spec.config(**tiny_training_args(
        os.path.join(out, "run"), use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256,
        vllm_gpu_memory_utilization=0.1, max_completion_length=8, max_steps=STEPS, learning_rate=LR, seed=0,
        logging_steps=1, **sizes,
    ))
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = spec.trainer_cls(model=model, reward_funcs=varied_reward, args=args,
                               train_dataset=Dataset.from_list([{"prompt": p} for p in prompts]), peft_config=peft_config)
    generation = trainer.vllm_generation
    installed_by_trainer = getattr(generation.sync_weights, "__func__", None) is cpu_sync_weights
    if apply:
        apply_cpu_weight_sync(trainer)
    syncs = []
    sync = generation.sync_weights

    def recorded():
        sync()
        folder = os.path.join(out, f"sync-{len(syncs)}")
        save_weights(trainer, folder)
        syncs.append({"step": trainer.state.global_step, "vllm": probe_logprobs(generation.llm), "dir": folder})

    generation.sync_weights = recorded
    trainer.train()
    generation.sync_weights()  # the weights after the last step
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"method": method, "lora": lora, "steps": trainer.state.global_step, "syncs": syncs,
                   "installed_by_trainer": installed_by_trainer, "losses": losses}, f)


def save_weights(trainer, folder: str) -> None:
    """The trainer's current weights as a plain model directory (a LoRA adapter merged into a copy)."""
    import copy

    model = trainer.model
    if hasattr(model, "merge_and_unload"):
        model = copy.deepcopy(model).merge_and_unload()
    model.save_pretrained(folder)
    trainer.processing_class.save_pretrained(folder)


def probe(models: list[str], out: str) -> None:
    """Fresh vLLMs built as TRL builds its colocated one (same dtype, lengths, logprobs mode), one per directory."""
    import gc

    from vllm import LLM

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    fresh = []
    for model in models:
        llm = LLM(model=model, max_model_len=256, gpu_memory_utilization=0.1, seed=0, max_num_batched_tokens=4096,
                  distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs")
        fresh.append(probe_logprobs(llm))
        del llm
        gc.collect()
    with open(out, "w") as f:
        json.dump({"fresh": fresh}, f)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("out")
    m.add_argument("--tokenizer", required=True)
    t = sub.add_parser("train")
    t.add_argument("method")
    t.add_argument("model")
    t.add_argument("out")
    t.add_argument("--lora", action="store_true")
    t.add_argument("--no-apply", dest="apply", action="store_false")
    p = sub.add_parser("probe")
    p.add_argument("out")
    p.add_argument("models", nargs="+")
    a = parser.parse_args(argv)
    _env()
    if a.cmd == "model":
        make_model(a.out, a.tokenizer)
    elif a.cmd == "train":
        train(a.method, a.model, a.out, a.lora, a.apply)
    else:
        probe(a.models, a.out)


if __name__ == "__main__":
    main(sys.argv[1:])
