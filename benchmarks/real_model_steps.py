"""Full training-step time of GRPO vs ISOPO vs TPO on a real LM (Q4_1-quantized SmolLM2-135M-Instruct, dequantized).

One step is what `Trainer.train()` does between `on_step_begin` and `on_step_end` with one optimizer step per
generation batch: generation (transformers `generate`), reward scoring, the method's extra work (TPO's target q,
ISOPO's statistics), the loss forward and backward, gradient clipping, the optimizer step and `zero_grad`. Logging
after the step is not timed.

Every method is a name of `trl_isopo.methods.METHODS` (its trainer class and config fields) and gets its own real
trainer on its own copy of the same weights, one optimizer step per rollout whatever its protocol's, the same prompts
(same `seed`/`data_seed`, Reasoning Gym `chain_sum` with 2 terms of 1-2 digits) and, in each round, the same RNG seed
at the start of the step. Each trainer runs `train()` in its own thread, and a baton lets exactly one thread run at a
time: round r runs step r of every method in turn (round-robin, the order rotated by one each round), so slow drifts of
a shared machine hit every method alike. Round 0 is a warm-up and is not counted. The default learning rate is tiny
(1e-6) so that the weights, and hence the sampled completions (lengths), stay nearly the same across methods within a
round; the mean completion length of every step is recorded.

Every step records the counters of `benchmarks/step_counters.py` (wall time, CPU time split into user and system, page
faults, context switches, gc time, the threads' run-queue wait; the other trainer threads are blocked meanwhile), the
same for its generation phase (`_generate_and_score_completions`), and the process's peak RSS. Printed per mode: every
round's wall time, then per method min / median / max wall time, max/min, the ratio of medians to GRPO's, the median of
the per-round ratios, and the medians of the counters. On CPU, glibc malloc keeps freed memory for reuse
(`trl_isopo.cpu_alloc.keep_freed_memory`, `--malloc cached`, the default): with glibc's stock settings
(`--malloc system`) every large temporary is mmapped and faulted in again at every step, which put a quarter to a third
of a full-weight step's CPU time in the kernel on a 2-core VM; `--trim` also hands all free memory back to the OS after every step (the previous
version of this script did). The raw JSON (settings, every step's counters) is rewritten after every round to `--out`
(default `benchmarks/results/real_model_steps.json`); `--resume` keeps the modes an earlier run with the same settings
finished and runs the rest.

    python benchmarks/real_model_steps.py --threads 2                 # 5 timed rounds, LoRA and full
    python benchmarks/real_model_steps.py --modes full --malloc system --trim --out /tmp/steps_stock.json
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

from step_counters import COUNTERS, Meter  # benchmarks/step_counters.py (the script's folder is on sys.path)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TASK_CONFIG = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
TARGETS = {"isopo": 1.10, "tpo": 1.05}  # targets for the ratio of median step times to GRPO's
SPREAD_TARGET = 1.3  # target for max / min step time of every method
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "real_model_steps.json")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="grpo,isopo,tpo",
                   help="comma list of names from trl_isopo.methods.METHODS; grpo (the baseline) is added")
    p.add_argument("--modes", default="lora,full", help="comma list from lora, full")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds after one warm-up round (5; --quick: 1)")
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
    p.add_argument("--malloc", default="cached", choices=["cached", "system"],
                   help="CPU: cached (default) keeps freed memory for reuse; system: glibc's stock settings")
    p.add_argument("--trim", action="store_true", help="hand free memory back to the OS after every step")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"JSON results, rewritten after every round ({DEFAULT_OUT})")
    p.add_argument("--resume", action="store_true", help="keep the modes --out already holds for the same settings")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: 1 layer, 1 timed round, 2 prompts x 2 completions of at most 4 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.prompts, args.generations = args.layers or 1, 2, 2
        args.repeats = args.repeats or 1
        args.max_completion_length = min(args.max_completion_length, 4)
    args.repeats = 5 if args.repeats is None else args.repeats
    # before torch is first imported (by the method table), so that OpenMP and MKL start with these thread counts
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    from trl_isopo.methods import METHODS

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {list(METHODS)}")
    args.methods = ["grpo"] + [m for m in methods if m != "grpo"]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in ("lora", "full") for m in args.modes):
        p.error("--modes takes lora and/or full")
    head = [m for m in args.methods if METHODS[m].fields.get("isopo_lm_head")]
    if head and "lora" in args.modes:
        p.error(f"{head} transform the LM head, which LoRA freezes: use --modes full")
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
    from transformers.trainer_callback import PrinterCallback

    from trl_isopo.methods import get_method
    from trl_isopo.real.schedule import rollout_config

    spec = get_method(method)  # one optimizer step per rollout for every method, whatever its protocol's `epochs`
    config = rollout_config(
        spec.config_cls, output_dir, prompts=args.prompts, generations=args.generations,
        max_completion_length=args.max_completion_length, temperature=args.temperature,
        learning_rate=args.learning_rate, max_steps=args.repeats + 1, seed=args.seed, optim=args.optim,
        **spec.fields,
    )
    peft_config = None
    if mode == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0, target_modules=LORA_TARGETS,
            task_type="CAUSAL_LM",
        )
    trainer = spec.trainer_cls(load_model(path, args.layers), reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config, callbacks=[clock])
    trainer.remove_callback(PrinterCallback)  # the step logs are kept by the clock, not printed
    generate = trainer._generate_and_score_completions

    def timed_generate(inputs):  # the generation phase of the step (sampling, rewards, the method's own extras)
        begin = clock.meter.read()
        try:
            return generate(inputs)
        finally:
            clock.generation.append(clock.meter.since(begin))

    trainer._generate_and_score_completions = timed_generate
    return trainer


# ---------------------------------------------------------------------------------------------------- counters
def malloc_setup(args, arena):
    """Apply --malloc (CPU only); returns its description for the JSON."""
    from trl_isopo import cpu_alloc

    cached = args.malloc == "cached" and cpu_alloc.keep_freed_memory()
    return {"malloc": "cached" if cached else "system", "arena_max": 1 if arena else None, "trim_after_step": args.trim}


def make_clock(seed, threads, meter):
    """A TrainerCallback that counts each step and lets its trainer's thread run only while it holds the baton."""
    import torch
    from transformers import TrainerCallback, set_seed

    class StepClock(TrainerCallback):
        def __init__(self):
            self.meter = meter
            self.ready = threading.Event()  # the thread reached its first step
            self.turn = threading.Semaphore(0)  # main -> thread: run one step
            self.done = threading.Semaphore(0)  # thread -> main: the step and its logging are over
            self.steps, self.generation, self.lengths, self.losses = [], [], [], []
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
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self._begin = meter.read()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.steps.append(meter.since(self._begin))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(float(logs["completions/mean_length"]))
                self.losses.append(float(logs.get("loss", float("nan"))))

        def records(self):
            """One dict per step: the step's counters, its generation phase's (`gen_*`), length and loss."""
            rows = []
            for i, step in enumerate(self.steps):
                row = dict(step)
                if i < len(self.generation):
                    row.update({f"gen_{k}": v for k, v in self.generation[i].items()})
                row["mean_completion_length"] = self.lengths[i] if i < len(self.lengths) else None
                row["loss"] = self.losses[i] if i < len(self.losses) else None
                rows.append(row)
            return rows

    return StepClock()


def run_mode(mode, args, path, tokenizer, dataset, reward, tmp, meter, on_round):
    """Interleaved steps of every method in `mode`; returns {method: [one record per step, warm-up first]}."""
    import torch

    from trl_isopo.cpu_alloc import release_free_memory

    clocks, threads = {}, {}
    for method in args.methods:
        clock = make_clock(args.seed, args.threads, meter)
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
            if args.trim:
                release_free_memory()  # between steps, outside every timed window
            s, gen = clock.steps[-1], clock.generation[-1]
            label = "warm-up" if r == 0 else f"round {r}/{args.repeats}"
            print(f"  [{mode}] {label:>11} {method:<18} {s['wall_s']:7.2f} s wall {s['cpu_s']:7.2f} s CPU "
                  f"({s['sys_s']:5.2f} sys) {s['minflt'] / 1e3:8.0f}k faults, gen {gen['wall_s']:6.2f} s, "
                  f"run-queue wait {s['runq_wait_s']:6.2f} s", flush=True)
        on_round({m: c.records() for m, c in clocks.items()}, complete=False)
    for method, thread in threads.items():
        thread.join(timeout=600)
        if clocks[method].error:
            raise RuntimeError(f"{method} ({mode}) failed at the end of training") from clocks[method].error
    return {m: c.records() for m, c in clocks.items()}


# ---------------------------------------------------------------------------------------------------- summary
def summarize(steps, methods):
    """Per method over the timed rounds (warm-up excluded): min / median / max of wall time, max/min, ratios to GRPO
    (of medians, of minima, median of the per-round ratios) and the medians of the other counters."""
    grpo = [s["wall_s"] for s in steps["grpo"][1:]]
    grpo_cpu = [s["cpu_s"] for s in steps["grpo"][1:]]
    out = {}
    for method in methods:
        timed = steps[method][1:]
        wall = [s["wall_s"] for s in timed]
        med = {k: statistics.median(s[k] for s in timed) for k in COUNTERS + ("gen_wall_s", "gen_cpu_s")}
        lengths = [s["mean_completion_length"] for s in timed if s["mean_completion_length"] is not None]
        out[method] = {
            "rounds": len(timed),
            "min_s": min(wall),
            "median_s": med["wall_s"],
            "max_s": max(wall),
            "max_over_min": max(wall) / min(wall),
            "ratio_of_medians": med["wall_s"] / statistics.median(grpo),
            "ratio_of_minima": min(wall) / min(grpo),
            "median_round_ratio": statistics.median(t / g for t, g in zip(wall, grpo)),
            "cpu_ratio_of_medians": med["cpu_s"] / statistics.median(grpo_cpu),
            "medians": med,
            "times_s": wall,
            "warmup_s": steps[method][0]["wall_s"],
            "mean_completion_length": statistics.mean(lengths) if lengths else None,
            "peak_rss_mib": max(s["maxrss_mib"] for s in steps[method]),  # the process's, so far
        }
    return out


def print_table(mode, steps, summary):
    methods = list(summary)
    print(f"\n{mode}: wall seconds of every timed round (warm-up excluded)")
    print("| round | " + " | ".join(methods) + " |")
    print("|---|" + "---|" * len(methods))
    for r in range(1, len(steps["grpo"])):
        print(f"| {r} | " + " | ".join(f"{steps[m][r]['wall_s']:.2f}" for m in methods) + " |")
    peak = max(s["peak_rss_mib"] for s in summary.values())
    targets = ", ".join(f"{m} <= {t}" for m, t in TARGETS.items())
    print(f"\n{mode}: per method over the timed rounds (targets: max/min <= {SPREAD_TARGET}, ratio of medians "
          f"{targets}); peak RSS of the process {peak / 1024:.1f} GiB")
    print("| method | min s | median s | max s | max/min | ratio to GRPO median | median per-round ratio "
          "| median CPU s | median sys s | median minor faults | median run-queue wait s | median gen s | median gc s "
          "| mean completion length |")
    print("|---|" + "---|" * 13)
    for method, s in summary.items():
        med, length = s["medians"], s["mean_completion_length"]
        print(f"| {method} | {s['min_s']:.2f} | {s['median_s']:.2f} | {s['max_s']:.2f} | {s['max_over_min']:.2f} "
              f"| {s['ratio_of_medians']:.3f} | {s['median_round_ratio']:.3f} | {med['cpu_s']:.2f} "
              f"| {med['sys_s']:.2f} | {med['minflt'] / 1e3:.0f}k | {med['runq_wait_s']:.2f} | {med['gen_wall_s']:.2f} "
              f"| {med['gc_s']:.2f} | {'-' if length is None else f'{length:.1f}'} |")


def main(argv=None):
    from trl_isopo.cpu_alloc import limit_arenas

    # One malloc arena for every thread, set before any thread exists (importing torch and its first parallel ops start
    # some, and each takes an arena of its own): the trainer threads run in turn, so one heap holds one step's peak,
    # not the sum of them. A thread on a second arena also gets every request above 64 MiB mmapped (an arena's heap
    # is at most 64 MiB), so it would fault its large temporaries in again at every step whatever --malloc says.
    arena = limit_arenas(1)
    args = parse_args(argv)

    from trl_isopo.tiny import set_offline_env

    set_offline_env()
    import tempfile

    import torch
    import trl
    from transformers import AutoTokenizer

    from trl_isopo.cpu_alloc import release_free_memory
    from trl_isopo.models import resolve_model_name_or_path

    torch.set_num_threads(args.threads)
    allocator = malloc_setup(args, arena)
    path = resolve_model_name_or_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    dataset, reward = build_data(args)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "resume")} | {"task_config": TASK_CONFIG}
    result = {"settings": settings, "modes": {}}
    if args.resume and os.path.exists(args.out):
        with open(args.out) as f:
            old = json.load(f)
        if old.get("settings") == json.loads(json.dumps(settings)):
            result["modes"] = {m: v for m, v in old.get("modes", {}).items() if v.get("complete")}
        else:
            print(f"--resume: {args.out} holds other settings; starting over", flush=True)
    print(f"model {path} ({'first %d layers' % args.layers if args.layers else 'all layers'}), torch threads "
          f"{args.threads}, {args.prompts} prompts x {args.generations} completions, max {args.max_completion_length} "
          f"tokens, T={args.temperature}, {args.repeats} timed rounds + 1 warm-up, methods {args.methods}, "
          f"allocator {allocator}", flush=True)
    result |= {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join([os.path.basename(sys.executable), *(sys.argv if argv is None else ["<main>", *argv])]),
        "model_path": path,
        "weights": "Q4_1-quantized SmolLM2-135M-Instruct, dequantized" if "SmolLM2" in path else path,
        "versions": {"torch": torch.__version__, "trl": trl.__version__, "python": platform.python_version()},
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "cpus": os.cpu_count(),
        "allocator": allocator,
    }

    def write():
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(args.out + ".tmp", args.out)  # a run killed mid-write keeps the previous file

    meter = Meter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for mode in args.modes:
                if mode in result["modes"]:
                    print(f"[{mode}] kept from {args.out}", flush=True)
                    continue

                def on_round(steps, complete, mode=mode):
                    result["modes"][mode] = {"complete": complete, "steps": steps}
                    write()

                steps = run_mode(mode, args, path, tokenizer, dataset, reward, tmp, meter, on_round)
                result["modes"][mode] = {"complete": True, "steps": steps, "summary": summarize(steps, args.methods)}
                write()
                gc.collect()
                release_free_memory()  # the next mode's trainers start from an empty heap
        for mode, data in result["modes"].items():
            print_table(mode, data["steps"], data["summary"])
        print(f"\nwrote {args.out}", flush=True)
    finally:
        meter.close()
    return result


if __name__ == "__main__":
    main()
