"""Real-model learning benchmark: GRPO, REINFORCE, ISOPO and TPO on SmolLM2-135M-Instruct (Q4_1, dequantized).

Every run trains one method with one seed and learning rate on the Reasoning Gym arithmetic task of
`trl_isopo.real` (same prompts per step, completions per prompt, steps, seed -> same number of generated samples),
and records held-out accuracy (greedy and sampled) and KL(pi || pi_0) on probe prompts before, along the way and
after, the training reward per step and the seconds per step. Results are appended to a JSON-lines file, one run per
line, so an interrupted sweep resumes where it stopped (a run already in the file is skipped), and several processes can
share one list (each run is claimed by one process).

    # learning-rate sweep: seed 0, 8-step runs (the training split has steps x prompts items and the held-out set
    # excludes them, so runs of different lengths differ in data order and held-out questions: the sweep compares
    # 8-step runs only), then the comparison at the picked rates
    python benchmarks/real_model_learning.py run --methods grpo-kl,reinforce,isopo,tpo --lrs 1e-4,3e-4,1e-3 --seeds 0 --steps 8
    python benchmarks/real_model_learning.py sweep            # per method: final scores of the 8-step runs by lr, the pick
    python benchmarks/real_model_learning.py run --methods grpo-kl=3e-4,reinforce=3e-4,isopo=3e-4,tpo=3e-4 --seeds 0-2
    python benchmarks/real_model_learning.py report

`run` also takes M optimizer steps per rollout (`--steps-per-rollout`, `--rollouts`, `--num-iterations`,
`--micro-batch`) and any numeric Reasoning Gym task (`--task`, `--task-config`); the M-steps protocol with its sweep,
paired analysis and verdicts is `benchmarks/real_model_protocol.py`.

Methods are names in `trl_isopo.methods`. Runs stored under a name whose setting has changed since
(`trl_isopo.methods.RENAMED`, e.g. the runs of `grpo` with beta 0.04 stored before that setting was named `grpo-kl`)
are read under today's name, with the stored name kept as `stored_method`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

DEFAULT_RESULTS = "benchmarks/results/real-model/runs.jsonl"


def code_version() -> str:
    """The commit this process runs (with `+dirty` for uncommitted changes to the code, i.e. outside `docs/` and
    `benchmarks/results/`, where the results file itself lives), recorded with every run."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":/", ":(exclude,top)docs",
                                ":(exclude,top)benchmarks/results"], cwd=here, capture_output=True, text=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


CODE_VERSION = code_version()  # read at start: the code a long-running process imported


def parse_seeds(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out += list(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


def parse_methods(text: str, lrs: list[float]) -> list[tuple[str, float]]:
    """'grpo=3e-4,isopo' + lrs [1e-4, 3e-4] -> [(grpo, 3e-4), (isopo, 1e-4), (isopo, 3e-4)]."""
    out = []
    for part in filter(None, text.split(",")):
        name, _, lr = part.partition("=")
        out += [(name, float(lr))] if lr else [(name, x) for x in lrs]
    return out


def load_results(path: str) -> list[dict]:
    """Every run of the JSON-lines file, under its method's current name (see the module doc)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [current_record(json.loads(line)) for line in f if line.strip()]


def current_record(record: dict) -> dict:
    """`record` with its method's current name in `settings.method` and `key` (`trl_isopo.methods.current_name`)."""
    from trl_isopo.methods import current_name

    stored = record["settings"]["method"]
    name = current_name(stored, record.get("label"))
    if name == stored:
        return record
    return {**record, "settings": {**record["settings"], "method": name}, "key": name + record["key"][len(stored):],
            "stored_method": stored}


def make_run(args, method: str, lr: float, seed: int):
    from trl_isopo.real.run import RealRun
    from trl_isopo.real.task import task_from_cli

    m, iters = args.steps_per_rollout, args.num_iterations
    steps = args.rollouts * m * iters if args.rollouts else args.steps
    return RealRun(method=method, lora=not args.full, learning_rate=lr, steps=steps,
                   prompts_per_rollout=args.prompts, num_generations=args.generations,
                   max_completion_length=args.max_completion_length, seed=seed, eval_size=args.eval_size,
                   eval_every=args.eval_every, eval_sampled=True, kl_prompts=args.kl_prompts,
                   kl_samples=args.kl_samples, steps_per_rollout=m, num_iterations=iters, micro_batch=args.micro_batch,
                   task=task_from_cli(args.task, args.task_config))


def _claim(workdir: str, key: str) -> bool:
    """Take `key` for this process (a file holding our PID, created exclusively), so several processes can work
    through one list; a claim whose process is gone (killed, crashed) is taken over."""
    folder = os.path.join(workdir, "claims")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, key.replace("|", "_"))
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(open(path).read().strip() or 0)
                os.kill(pid, 0)
                return False  # another live process has it
            except (ValueError, ProcessLookupError, PermissionError):
                os.unlink(path)  # stale
                continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def cmd_run(args) -> int:
    todo = [make_run(args, m, lr, s) for m, lr in parse_methods(args.methods, args.lrs) for s in parse_seeds(args.seeds)]
    if args.order == "seed":
        todo.sort(key=lambda run: run.seed)
    return train_all(args, todo)


def train_all(args, todo) -> int:
    """Train each run of `todo` that `--results` lacks and no other live process has claimed; append its record."""
    import torch

    torch.set_num_threads(args.threads)
    from trl_isopo.real.run import train_real

    os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
    for i, run in enumerate(todo):
        if run.key() in {r["key"] for r in load_results(args.results)}:  # re-read: other processes append too
            print(f"[{i + 1}/{len(todo)}] {run.key()}: in {args.results}, skipped", flush=True)
            continue
        if not _claim(args.workdir, run.key()):
            print(f"[{i + 1}/{len(todo)}] {run.key()}: running in another process, skipped", flush=True)
            continue
        print(f"[{i + 1}/{len(todo)}] {run.key()} ...", flush=True)
        t0 = time.time()
        record = train_real(run, os.path.join(args.workdir, run.key().replace("|", "_")), progress=False,
                            save_model=False, on_event=_print_base)
        record["wall_seconds"] = time.time() - t0
        record["threads"] = args.threads
        record["code"] = CODE_VERSION
        record["finished_at"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        with open(args.results, "a") as f:
            f.write(json.dumps(record) + "\n")
        ev = record["evals"]
        print(f"    greedy {100 * ev[0]['greedy']:.1f}% -> {100 * ev[-1]['greedy']:.1f}%, sampled "
              f"{100 * ev[0]['sampled']:.1f}% -> {100 * ev[-1]['sampled']:.1f}%, KL {ev[-1].get('kl', float('nan')):.3f}"
              f", {statistics.median(record['step_seconds']):.1f} s/step, {record['wall_seconds']:.0f} s wall, "
              f"{record['train_cpu_seconds']:.0f} + {record['eval_cpu_seconds']:.0f} CPU-s (train + eval)", flush=True)
    return 0


def _print_base(kind, point):
    if kind == "eval" and point["step"] == 0:
        print(f"    base model: held-out greedy score {point['greedy']:.3f}, exactly right "
              f"{100 * point['greedy_exact']:.1f}%", flush=True)


def _group(results: list[dict]) -> dict:
    groups: dict = {}
    for r in results:
        s = r["settings"]
        key = (s["method"], "lora" if s["lora"] else "full", s["learning_rate"], s["steps"],
               s.get("steps_per_rollout", 1))
        groups.setdefault(key, []).append(r)
    return groups


def _fmt_seeds(values, scale=100.0, digits=1):
    return " / ".join(f"{scale * v:.{digits}f}" for v in values)


def cmd_report(args) -> int:
    results = [r for r in load_results(args.results) if args.steps is None or r["settings"]["steps"] == args.steps]
    if not results:
        print(f"no results in {args.results}")
        return 1
    rows = []
    header = ("| method | weights | lr | steps | seeds | greedy score base → final | per seed final | greedy exactly right "
              "base → final (%) | sampled score base → final | per seed final | reward first 5 → last 5 | "
              "KL(π‖π0) final (nats) | per seed | s/step |")
    rows.append(header)
    rows.append("|" + "---|" * (header.count("|") - 1))
    for (method, weights, lr, steps, _), runs in sorted(_group(results).items(), key=lambda kv: (kv[0][1], kv[0][0], kv[0][2])):
        runs = sorted(runs, key=lambda r: r["settings"]["seed"])
        base_g = [r["evals"][0]["greedy"] for r in runs]
        fin_g = [r["evals"][-1]["greedy"] for r in runs]
        base_s = [r["evals"][0].get("sampled", math.nan) for r in runs]
        fin_s = [r["evals"][-1].get("sampled", math.nan) for r in runs]
        kl = [r["evals"][-1].get("kl", math.nan) for r in runs]
        r_first = [statistics.mean(x["reward"] for x in r["rewards"][:5]) for r in runs]
        r_last = [statistics.mean(x["reward"] for x in r["rewards"][-5:]) for r in runs]
        sps = statistics.median(s for r in runs for s in r["step_seconds"][1:] or r["step_seconds"])
        exact = [(r["evals"][0]["greedy_exact"], r["evals"][-1]["greedy_exact"]) for r in runs
                 if "greedy_exact" in r["evals"][0]]
        exact_txt = (f"{100 * statistics.mean(a for a, _ in exact):.1f} → {100 * statistics.mean(b for _, b in exact):.1f}"
                     f" ({len(exact)} of {len(runs)} runs)" if exact else "not recorded")
        rows.append(
            f"| {runs[0]['label']} | {weights} | {lr:g} | {steps} | {len(runs)} "
            f"| {statistics.mean(base_g):.3f} → **{statistics.mean(fin_g):.3f}** | {_fmt_seeds(fin_g, 1.0, 3)} "
            f"| {exact_txt} "
            f"| {statistics.mean(base_s):.3f} → **{statistics.mean(fin_s):.3f}** | {_fmt_seeds(fin_s, 1.0, 3)} "
            f"| {statistics.mean(r_first):.3f} → {statistics.mean(r_last):.3f} "
            f"| {statistics.mean(kl):.3f} | {_fmt_seeds(kl, 1.0, 3)} | {sps:.1f} |"
        )
    text = "\n".join(rows)
    print(text)
    if args.png:
        plot(results, args.png)
        print(f"\nwrote {args.png}")
    return 0


def sweep_points(results: list[dict], step: int = 8, seed: int = 0, lora: bool = True) -> dict:
    """{method: {lr: final evaluation}} of the `step`-step runs of seed `seed`. Only runs of that length: a run's
    training split (steps x prompts items, shuffled by the sampler) and its held-out set (which excludes them) depend
    on its length, so a longer run's evaluation at the same step is not the same measurement."""
    points: dict = {}
    for r in results:
        s = r["settings"]
        if s["seed"] != seed or s["lora"] != lora or s["steps"] != step:
            continue
        at = [e for e in r["evals"] if e["step"] == step]
        if at:
            points.setdefault(s["method"], {}).setdefault(s["learning_rate"], at[0])
    return points


def pick_lr(by_lr: dict) -> float:
    """The lr with the best greedy held-out score; ties go to the better sampled score, then the smaller lr."""
    return max(sorted(by_lr), key=lambda lr: (by_lr[lr]["greedy"], by_lr[lr].get("sampled", -1.0), -lr))


def cmd_sweep(args) -> int:
    points = sweep_points(load_results(args.results), args.step, args.seed, not args.full)
    if not points:
        print(f"no run with an evaluation at step {args.step} in {args.results}")
        return 1
    print(f"learning-rate sweep: seed {args.seed}, {args.step}-step runs, final held-out scores (greedy / sampled "
          "T=0.7, KL(pi||pi0) in nats); the pick maximizes the greedy score\n")
    print("| method | lr | greedy | sampled | KL | pick |")
    print("|---|---|---|---|---|---|")
    for method, by_lr in sorted(points.items()):
        best = pick_lr(by_lr)
        for lr in sorted(by_lr):
            e = by_lr[lr]
            print(f"| {method} | {lr:g} | {e['greedy']:.3f} | {e.get('sampled', math.nan):.3f} | "
                  f"{e.get('kl', math.nan):.2f} | {'**yes**' if lr == best else ''} |")
    return 0


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _group(results)
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for i, ((method, weights, lr, steps, m), runs) in enumerate(sorted(groups.items())):
        color = f"C{i % 10}"
        label = f"{runs[0]['label']} {weights} lr {lr:g}{f' M={m}' if m > 1 else ''} ({len(runs)} seeds)"
        for j, r in enumerate(runs):
            ev = r["evals"]
            kw = dict(color=color, alpha=0.8, label=label if j == 0 else None)
            ax[0].plot([e["step"] for e in ev], [100 * e["greedy"] for e in ev], "o-", **kw)
            ax[1].plot([e["step"] for e in ev], [100 * e.get("sampled", math.nan) for e in ev], "o-", **kw)
            ax[2].plot([e["step"] for e in ev], [e.get("kl", math.nan) for e in ev], "o-", **kw)
    ax[0].set(xlabel="optimizer step", ylabel="held-out mean task score, greedy (%)")
    ax[1].set(xlabel="optimizer step", ylabel="held-out mean task score, sampled T=0.7 (%)")
    ax[2].set(xlabel="optimizer step", ylabel="KL(π‖π0) on probe prompts (nats)")
    ax[0].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct (Q4_1, dequantized), Reasoning Gym chain_sum; one line per seed", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train the missing (method, lr, seed) runs and append them to --results")
    r.add_argument("--methods", default="grpo-kl,reinforce,isopo,tpo",
                   help="names in trl_isopo.methods, optionally name=lr")
    r.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=[3e-4],
                   help="learning rates for methods given without =lr")
    r.add_argument("--seeds", default="0-2")
    r.add_argument("--full", action="store_true", help="full weights (default LoRA r=16)")
    r.add_argument("--steps", type=int, default=16, help="optimizer steps in all (see --rollouts)")
    r.add_argument("--rollouts", type=int, default=0,
                   help="rollouts per run instead of --steps (steps = rollouts x M x num-iterations)")
    r.add_argument("--steps-per-rollout", type=int, default=1,
                   help="M: optimizer steps per rollout, each on 1/M of it (TRL steps_per_generation = M x GA)")
    r.add_argument("--num-iterations", type=int, default=1, help="TRL num_iterations: passes over each rollout")
    r.add_argument("--eval-every", type=int, default=8, help="held-out evaluation every N optimizer steps")
    add_run_options(r, prompts=4, eval_size=64, kl_prompts=8, micro_batch=0, results=DEFAULT_RESULTS)
    r.add_argument("--order", choices=["method", "seed"], default="method",
                   help="method: all seeds of the first method first (default); seed: every method's seed 0 first")
    rep = sub.add_parser("report", help="markdown table (seed means and per-seed values) and a PNG")
    rep.add_argument("--results", default=DEFAULT_RESULTS)
    rep.add_argument("--png", default="benchmarks/results/real-model/curves.png")
    rep.add_argument("--steps", type=int, default=None, help="only runs of this length (e.g. 16: not the sweep)")
    sw = sub.add_parser("sweep", help="learning-rate sweep table: N-step runs of one seed by lr, and the pick")
    sw.add_argument("--results", default=DEFAULT_RESULTS)
    sw.add_argument("--step", type=int, default=8, help="the sweep runs' length (steps)")
    sw.add_argument("--seed", type=int, default=0)
    sw.add_argument("--full", action="store_true", help="full-weight runs (default LoRA)")
    return p


def add_run_options(p, *, prompts, eval_size, kl_prompts, micro_batch, results) -> None:
    """The options `run` and the protocol's script share: sizes, task, evaluation, threads, where results go."""
    p.add_argument("--prompts", type=int, default=prompts, help="prompts per rollout")
    p.add_argument("--generations", type=int, default=8, help="completions per prompt (K)")
    p.add_argument("--micro-batch", type=int, default=micro_batch,
                   help="rows per forward/backward (0: one micro-batch per optimizer step)")
    p.add_argument("--max-completion-length", type=int, default=24)
    p.add_argument("--eval-size", type=int, default=eval_size, help="held-out questions")
    p.add_argument("--kl-prompts", type=int, default=kl_prompts, help="probe prompts of KL(pi || pi_0)")
    p.add_argument("--kl-samples", type=int, default=4, help="sampled completions per probe prompt")
    p.add_argument("--task", default=None, help="a numeric Reasoning Gym task (default chain_sum, 2 terms of 1-2 "
                   "digits)")
    p.add_argument("--task-config", default=None, help="the task's config as JSON (default: the task's own)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--workdir", default="outputs/real_model_learning")
    p.add_argument("--results", default=results)


def run_command(build_parser, commands: dict, argv=None) -> int:
    """A script's `main` (this one's and benchmarks/real_model_protocol.py's): the Hub offline, then `argv` parsed by
    `build_parser()` and its subcommand run (`commands`: name -> function of the parsed arguments)."""
    from trl_isopo.tiny import set_offline_env

    set_offline_env()
    args = build_parser().parse_args(argv)
    return commands[args.command](args)


def main(argv=None) -> int:
    return run_command(build_parser, {"run": cmd_run, "report": cmd_report, "sweep": cmd_sweep}, argv)


if __name__ == "__main__":
    sys.exit(main())
