"""Full training-step time of GRPO vs ISOPO vs TPO on a real LM (Q4_1-quantized SmolLM2-135M-Instruct, dequantized).

One step is what `Trainer.train()` does between `on_step_begin` and `on_step_end` with one optimizer step per
generation batch: generation (transformers `generate`), reward scoring, the method's extra work (TPO's target q,
ISOPO's statistics), the loss forward and backward, gradient clipping, the optimizer step and `zero_grad`. Logging
after the step is not timed.

Every method gets its own real trainer (`trl.GRPOTrainer`, `trl_isopo.ISOPOTrainer`, `trl_isopo.TPOTrainer`) on its
own copy of the same weights, the same prompts (same `seed`/`data_seed`, Reasoning Gym `chain_sum` with 2 terms of
1-2 digits) and, in each round, the same RNG seed at the start of the step. Each trainer runs `train()` in its own
thread, and a baton lets exactly one thread run at a time: round r runs step r of every method in turn (round-robin,
the order rotated by one each round), so slow drifts of a shared machine hit every method alike. Round 0 is a warm-up
and is not counted. The default learning rate is tiny (1e-6) so that the weights, and hence the sampled completions
(lengths), stay nearly the same across methods within a round; the mean completion length of every timed step is
recorded to check that.

Printed per mode (LoRA r=16 on all linear layers of the blocks, and full weights): the median step time of every
method, its ratio to GRPO's median, the median of the per-round ratios (method step / GRPO step of the same round) and
the ratio of the fastest steps (on a shared machine contention only ever slows a step down, so minima are steadier),
and the same for the process CPU time of the step (the other trainer threads are blocked meanwhile), which other jobs
on the machine disturb far less than wall time.
`--out` writes everything (settings, every step time, lengths) as JSON.

    python benchmarks/real_model_steps.py --repeats 3 --threads 1 --out steps.json
    python benchmarks/real_model_steps.py --methods grpo,isopo,isopo-q,isopo-interacting,tpo --modes lora
    python benchmarks/real_model_steps.py --methods grpo,isopo,isopo-head --modes full   # isopo_lm_head=True
    python benchmarks/real_model_steps.py --quick            # 1 of the 30 layers, 1 round, 4 tokens (smoke test)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time

METHODS = {
    # name: (module, trainer class, config class, config fields)
    "grpo": ("trl", "GRPOTrainer", "GRPOConfig", {}),
    "isopo": ("trl_isopo", "ISOPOTrainer", "ISOPOConfig", {}),  # ISOPOConfig defaults (p=-1, c=0)
    "isopo-q": ("trl_isopo", "ISOPOTrainer", "ISOPOConfig", {"isopo_p": 0.0, "isopo_q": -1.0}),
    "isopo-interacting": ("trl_isopo", "ISOPOTrainer", "ISOPOConfig", {"isopo_p": 0.0, "isopo_interacting": True}),
    "isopo-head": ("trl_isopo", "ISOPOTrainer", "ISOPOConfig", {"isopo_lm_head": True}),  # full weights only
    "tpo": ("trl_isopo", "TPOTrainer", "TPOConfig", {}),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
TARGETS = {"isopo": 1.10, "tpo": 1.05}  # the targets for the step ratio to GRPO


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="grpo,isopo,tpo", help=f"comma list from {list(METHODS)}; grpo is added")
    p.add_argument("--modes", default="lora,full", help="comma list from lora, full")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds after one warm-up round (3; --quick: 1)")
    p.add_argument("--threads", type=int, default=1, choices=[1, 2], help="torch intra-op threads")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt")
    p.add_argument("--max-completion-length", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=1e-6)
    p.add_argument("--optim", default="adamw_torch")
    p.add_argument("--layers", type=int, default=0, help="keep only the first N decoder layers (0: all)")
    p.add_argument("--system-prompt", default=None, help="Reasoning Gym system prompt (default: the model's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="smollm2", help="model alias, Hub id or local path")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 1 layer, 1 timed round, 2 prompts x 2 completions of at most 4 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.prompts, args.generations = args.layers or 1, 2, 2
        args.repeats = args.repeats or 1
        args.max_completion_length = min(args.max_completion_length, 4)
    args.repeats = 3 if args.repeats is None else args.repeats
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    args.methods = ["grpo"] + [m for m in methods if m != "grpo"]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in ("lora", "full") for m in args.modes):
        p.error("--modes takes lora and/or full")
    if "isopo-head" in args.methods and "lora" in args.modes:
        p.error("isopo-head transforms the LM head, which LoRA freezes: use --modes full")
    if args.repeats < 1 or args.prompts < 1 or args.generations < 2:
        p.error("need --repeats >= 1, --prompts >= 1 and --generations >= 2")
    return args


# ---------------------------------------------------------------------------------------------------- setup
def load_model(path, layers):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if layers:
        if layers > model.config.num_hidden_layers:
            raise ValueError(f"--layers {layers} > the model's {model.config.num_hidden_layers} layers")
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = layers
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:layers]
    return model


def build_data(args):
    from trl_isopo.gym import ReasoningGymLastNumberReward, build_reasoning_gym_dataset, make_procedural_dataset

    procedural = make_procedural_dataset(
        "chain_sum", size=args.prompts * (args.repeats + 2), seed=args.seed, task_config=TASK_CONFIG
    )
    dataset = build_reasoning_gym_dataset(procedural, system_prompt=args.system_prompt)
    return dataset, ReasoningGymLastNumberReward(procedural)


def build_trainer(method, mode, args, path, tokenizer, dataset, reward, clock, output_dir):
    import importlib

    from transformers.trainer_callback import PrinterCallback

    module, trainer_name, config_name, fields = METHODS[method]
    mod = importlib.import_module(module)
    trainer_cls, config_cls = getattr(mod, trainer_name), getattr(mod, config_name)
    from trl_isopo.real.run import rollout_config

    config = rollout_config(
        config_cls, output_dir, prompts=args.prompts, generations=args.generations,
        max_completion_length=args.max_completion_length, temperature=args.temperature,
        learning_rate=args.learning_rate, max_steps=args.repeats + 1, seed=args.seed, optim=args.optim, **fields,
    )
    peft_config = None
    if mode == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules=LORA_TARGETS,
            task_type="CAUSAL_LM",
        )
    trainer = trainer_cls(
        load_model(path, args.layers),
        reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[clock],
    )
    trainer.remove_callback(PrinterCallback)  # the step logs are kept by the clock, not printed
    return trainer


# ---------------------------------------------------------------------------------------------------- timing
def _libc():
    import ctypes
    import ctypes.util

    if platform.system() != "Linux":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def single_malloc_arena():
    """glibc gives every thread its own malloc arena and keeps each one's peak: with one trainer per thread, the CPU
    memory would be the sum of every method's step peak. One shared arena keeps it at one step's peak."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(-8, 1)  # M_ARENA_MAX = 1, before any trainer thread starts


def release_free_memory():
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _sync():
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_clock(seed, threads):
    """A TrainerCallback that times each step and lets its trainer's thread run only while it holds the baton."""
    import torch
    from transformers import TrainerCallback, set_seed

    class StepClock(TrainerCallback):
        def __init__(self):
            self.ready = threading.Event()  # the thread reached its first step
            self.turn = threading.Semaphore(0)  # main -> thread: run one step
            self.done = threading.Semaphore(0)  # thread -> main: the step and its logging are over
            self.times, self.cpu_times, self.lengths, self.losses = [], [], [], []
            self.round = 0
            self.error = None

        def on_step_begin(self, args, state, control, **kwargs):
            if self.round:
                self.done.release()  # the previous step and everything after it (logging) are over
            self.ready.set()
            self.turn.acquire()
            torch.set_num_threads(threads)
            set_seed(seed + 1000 * self.round)  # the same RNG stream for every method in a round
            self.round += 1
            _sync()
            self._cpu0 = time.process_time()
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            _sync()
            self.times.append(time.perf_counter() - self._t0)
            # CPU seconds of the whole process (every other thread is blocked): much less sensitive than wall time to
            # other jobs on a shared machine
            self.cpu_times.append(time.process_time() - self._cpu0)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(float(logs["completions/mean_length"]))
                self.losses.append(float(logs.get("loss", float("nan"))))

    return StepClock()


def run_mode(mode, args, path, tokenizer, dataset, reward, tmp):
    """Interleaved steps of every method in `mode`; returns {method: {"times": [...], "lengths": [...]}}."""
    import torch

    clocks, threads = {}, {}
    for method in args.methods:
        clock = make_clock(args.seed, args.threads)
        trainer = build_trainer(method, mode, args, path, tokenizer, dataset, reward, clock, f"{tmp}/{mode}-{method}")

        def work(trainer=trainer, clock=clock):
            torch.set_num_threads(args.threads)
            try:
                trainer.train()
            except BaseException as err:  # reported by the main thread
                clock.error = err
            finally:
                clock.ready.set()
                clock.done.release()

        thread = threading.Thread(target=work, name=f"{mode}-{method}", daemon=True)
        thread.start()
        clock.ready.wait()  # its setup is over before the next trainer is built (nothing else runs while timing)
        if clock.error:
            raise RuntimeError(f"{method} ({mode}) failed before its first step") from clock.error
        clocks[method], threads[method] = clock, thread

    for r in range(args.repeats + 1):
        k = r % len(args.methods)  # rotate the order each round, so that no method always runs right after another
        for method in args.methods[k:] + args.methods[:k]:
            clock = clocks[method]
            clock.turn.release()
            clock.done.acquire()
            if clock.error:
                raise RuntimeError(f"{method} ({mode}) failed in round {r}") from clock.error
            release_free_memory()  # between steps, outside every timed window
            label = "warm-up" if r == 0 else f"round {r}/{args.repeats}"
            print(f"  [{mode}] {label:>10} {method:<18} {clock.times[-1]:8.2f} s", flush=True)
    for method, thread in threads.items():
        thread.join(timeout=600)
        if clocks[method].error:
            raise RuntimeError(f"{method} ({mode}) failed at the end of training") from clocks[method].error
    return {m: {"times": c.times, "cpu_times": c.cpu_times, "lengths": c.lengths, "losses": c.losses}
            for m, c in clocks.items()}


def summarize(raw, methods):
    """Medians (warm-up excluded), ratios to GRPO's median and the median of the per-round ratios."""
    grpo, grpo_cpu = raw["grpo"]["times"][1:], raw["grpo"]["cpu_times"][1:]
    out = {}
    for method in methods:
        times, cpu = raw[method]["times"][1:], raw[method]["cpu_times"][1:]
        med = statistics.median(times)
        out[method] = {
            "median_cpu_s": statistics.median(cpu),
            "cpu_ratio_of_medians": statistics.median(cpu) / statistics.median(grpo_cpu),
            "cpu_times_s": cpu,
            "median_s": med,
            "min_s": min(times),
            "ratio_of_medians": med / statistics.median(grpo),
            "ratio_of_minima": min(times) / min(grpo),
            "median_round_ratio": statistics.median(t / g for t, g in zip(times, grpo)),
            "round_ratios": [t / g for t, g in zip(times, grpo)],
            "times_s": times,
            "warmup_s": raw[method]["times"][0],
            "mean_completion_lengths": raw[method]["lengths"][1:],
        }
    return out


def print_table(mode, summary):
    print(f"\n{mode}: median full-step time over the timed rounds (warm-up excluded)")
    print("| method | median s | ratio to GRPO median | median per-round ratio | ratio of minima | median CPU s "
          "| CPU ratio | target | mean completion length |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method, s in summary.items():
        target = TARGETS.get(method)
        lengths = s["mean_completion_lengths"]
        length = f"{statistics.mean(lengths):.1f}" if lengths else "-"
        print(f"| {method} | {s['median_s']:.2f} | {s['ratio_of_medians']:.3f} | {s['median_round_ratio']:.3f} | "
              f"{s['ratio_of_minima']:.3f} | {s['median_cpu_s']:.2f} | {s['cpu_ratio_of_medians']:.3f} | "
              f"{'<= %.2f' % target if target else '-'} | {length} |")


def main(argv=None):
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)

    from trl_isopo.tiny import set_offline_env

    set_offline_env()
    import tempfile

    import torch
    import trl
    from transformers import AutoTokenizer

    from trl_isopo.models import resolve_model_name_or_path

    torch.set_num_threads(args.threads)
    single_malloc_arena()
    path = resolve_model_name_or_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    dataset, reward = build_data(args)
    print(f"model {path} ({'first %d layers' % args.layers if args.layers else 'all layers'}), torch threads "
          f"{args.threads}, {args.prompts} prompts x {args.generations} completions, max {args.max_completion_length} "
          f"tokens, T={args.temperature}, {args.repeats} timed rounds + 1 warm-up, methods {args.methods}", flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"task_config": TASK_CONFIG},
        "model_path": path,
        "weights": "Q4_1-quantized SmolLM2-135M-Instruct, dequantized" if "SmolLM2" in path else path,
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "python": platform.python_version()},
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "modes": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            raw = run_mode(mode, args, path, tokenizer, dataset, reward, tmp)
            summary = summarize(raw, args.methods)
            result["modes"][mode] = summary
            print_table(mode, summary)
            if args.out:  # after every mode, so a later failure keeps what was measured
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=2)
                print(f"\nwrote {args.out}", flush=True)
            gc.collect()
            release_free_memory()
    return result


if __name__ == "__main__":
    main()
