"""Step time on the real model with Hugging Face generation vs a colocated vLLM on the CPU, same batch.

For each method (default: grpo and isopo) and each generator (`hf`: transformers' `generate`, TRL's default; `vllm`:
`use_vllm=True, vllm_mode="colocate"`), a fresh process builds the trainer of `trl-isopo real`'s settings
(SmolLM2-135M-Instruct with a LoRA adapter, 4 prompts x 8 completions of at most 24 tokens, micro-batches of 8 rows
with activation checkpointing, lr 3e-4, seed 0) and trains `--steps` optimizer steps. Recorded per step: wall time
(between `on_step_begin` and `on_step_end`), its generation phase (`_generate_and_score_completions`, which includes
the weight sync before vLLM generates), and the mean completion length; also the trainer's construction time (vLLM
starts there). The first step is a warm-up and is not counted. Printed: per method, the median step and generation
time of each generator and the ratios vLLM / HF. The processes run one after another, the generators alternating, so
a drift of a shared machine hits both.

vLLM runs as a user gets it (its CPU default: the model compiled with inductor at start; bfloat16 weights while the
trainer runs float32, so completion lengths may differ slightly: compare the lengths printed). Run it in the vLLM
environment (docs/vllm.md):

    python benchmarks/vllm_generation.py --steps 4 --json benchmarks/results/vllm-generation.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

GENERATORS = ("hf", "vllm")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="grpo,isopo", help="comma list of names from trl_isopo.methods.METHODS")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per process (the first is not counted)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the trainer")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per process")
    p.add_argument("--json", default=None, help="write the raw per-step record here")
    p.add_argument("--child", nargs=3, metavar=("METHOD", "GENERATOR", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def child(method_name: str, generator: str, out: str, steps: int, threads: int) -> None:
    """Train `steps` steps of the real job's settings with `generator`; write the record to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from trl_isopo.methods import get_method
    from trl_isopo.models import resolve_model_name_or_path
    from trl_isopo.real.run import _config, lora_config
    from trl_isopo.real.task import make_reward, make_splits
    from trl_isopo.scripts.real import build_parser, make_run
    from trl_isopo.tiny import set_offline_env
    from trl_isopo.vllm_cpu import apply_cpu_weight_sync

    set_offline_env()
    torch.set_num_threads(threads)
    run = make_run(build_parser().parse_args(["--method", method_name, "--steps", str(steps)]))
    method = get_method(method_name)
    train, _, train_proc = make_splits(run.task, n_train=steps * run.prompts_per_rollout, n_eval=8)
    path = resolve_model_name_or_path(run.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    vllm = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=512, vllm_gpu_memory_utilization=0.1)
    config = _config(run, os.path.join(os.path.dirname(out), "run"), False, **(vllm if generator == "vllm" else {}))
    t0 = time.perf_counter()
    trainer = method.trainer_cls(model=model, reward_funcs=make_reward(train_proc), args=config, train_dataset=train,
                                 processing_class=tokenizer, peft_config=lora_config(run))
    apply_cpu_weight_sync(trainer)  # GRPOTrainer needs it on the CPU; this package's trainers have it already
    construct = time.perf_counter() - t0
    steps_log, generation = [], []
    original = trainer._generate_and_score_completions

    def timed(inputs):
        start = time.perf_counter()
        result = original(inputs)
        lengths = result["completion_mask"].sum(dim=1).float()
        generation.append({"seconds": time.perf_counter() - start, "mean_length": float(lengths.mean())})
        return result

    trainer._generate_and_score_completions = timed

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            steps_log.append(time.perf_counter() - self.start)

    trainer.add_callback(Clock())
    trainer.train()
    with open(out, "w") as f:
        json.dump({"method": method_name, "generator": generator, "construct_seconds": construct,
                   "step_seconds": steps_log, "generation": generation}, f)


def summarize(records: list[dict]) -> str:
    lines = ["method  generator  start s  step s (median)  generation s (median)  mean completion length",
             "------  ---------  -------  ---------------  ---------------------  ----------------------"]
    medians = {}
    for r in records:
        step = statistics.median(r["step_seconds"][1:])
        gen = statistics.median(g["seconds"] for g in r["generation"][1:])
        length = statistics.mean(g["mean_length"] for g in r["generation"][1:])
        medians[r["method"], r["generator"]] = (step, gen)
        lines.append(f"{r['method']:<6}  {r['generator']:<9}  {r['construct_seconds']:7.1f}  {step:15.1f}  {gen:21.1f}  "
                     f"{length:22.1f}")
    lines.append("")
    for method in dict.fromkeys(r["method"] for r in records):
        if (method, "hf") in medians and (method, "vllm") in medians:
            (s_hf, g_hf), (s_v, g_v) = medians[method, "hf"], medians[method, "vllm"]
            lines.append(f"{method}: vLLM / HF step time {s_v / s_hf:.2f}x, generation {g_v / g_hf:.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        child(*args.child, steps=args.steps, threads=args.threads)
        return 0
    if args.steps < 2:
        raise SystemExit("--steps must be at least 2 (the first step is not counted)")
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for method in args.methods.split(","):
            for generator in GENERATORS:
                out = os.path.join(tmp, f"{method}-{generator}", "record.json")
                os.makedirs(os.path.dirname(out))
                cmd = [sys.executable, os.path.abspath(__file__), "--steps", str(args.steps), "--threads",
                       str(args.threads), "--child", method, generator, out]
                print(f"{method} / {generator} ...", flush=True)
                subprocess.run(cmd, check=True, timeout=args.timeout, stdout=subprocess.DEVNULL)
                with open(out) as f:
                    records.append(json.load(f))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python", "benchmarks/vllm_generation.py", *(argv or sys.argv[1:])]),
                       "records": records}, f, indent=1)
    print(summarize(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
