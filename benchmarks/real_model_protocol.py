"""The M-steps protocol on the real model (docs/real-model-results.md, "M optimizer steps per rollout"): run, pick, analyze.

Every run trains one method at one learning rate, seed and M (optimizer steps per rollout) on the same rollouts
budget (`trl_isopo.real.protocol.Protocol`: 8 rollouts of 8 prompts x 8 completions, full weights, 128 held-out
questions) and is appended to a JSON-lines file keyed by its settings, so an interrupted sweep resumes and several
processes can share one list (as `real_model_learning.py run`, whose loop this is).

    # 1. learning-rate sweep on seeds kept out of the comparison, each M
    python benchmarks/real_model_protocol.py run --lrs 3e-6,1e-5,3e-5 --seeds 100-101 --results benchmarks/results/real-model/protocol-sweep.jsonl
    python benchmarks/real_model_protocol.py pick --results benchmarks/results/real-model/protocol-sweep.jsonl
    # 2. the comparison at the picked rates (NAME=LR per method), 5 seeds, M = 1 and 4
    python benchmarks/real_model_protocol.py run --methods grpo=1e-5,grpo-kl=1e-5,... --seeds 0-4
    # 3. the figures, the paired bootstrap table and the verdicts
    python benchmarks/real_model_protocol.py analyze
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = "benchmarks/results/real-model/protocol.jsonl"
FIGURES = "benchmarks/results/real-model/protocol"


def _learning():
    """benchmarks/real_model_learning.py (its results file, resumable loop and parsers)."""
    spec = importlib.util.spec_from_file_location("real_model_learning", os.path.join(HERE, "real_model_learning.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_protocol(args):
    from trl_isopo.real.protocol import Protocol
    from trl_isopo.real.task import task_from_cli

    return Protocol(rollouts=args.rollouts, prompts=args.prompts, generations=args.generations,
                    micro_batch=args.micro_batch, epochs=args.epochs, lora=args.lora, eval_size=args.eval_size,
                    eval_every_rollouts=args.eval_every_rollouts, kl_prompts=args.kl_prompts,
                    kl_samples=args.kl_samples, max_completion_length=args.max_completion_length,
                    task=task_from_cli(args.task, args.task_config))


def protocol_runs(args) -> list:
    """Every (method, lr, seed, M) run, seed-major (then M, then method) unless --order method: an interrupted list
    leaves whole seeds, which stay paired."""
    rml = _learning()
    protocol = make_protocol(args)
    ms = [int(x) for x in str(args.steps_per_rollout).split(",")]
    todo = [protocol.run(m, lr, seed, k) for m, lr in rml.parse_methods(args.methods, args.lrs)
            for seed in rml.parse_seeds(args.seeds) for k in ms]
    if args.order == "seed":
        todo.sort(key=lambda run: (run.seed, run.steps_per_rollout))
    return todo


def cmd_run(args) -> int:
    return _learning().train_all(args, protocol_runs(args))


def _parse_lrs(text: str | None) -> dict:
    return {name: float(lr) for name, _, lr in (p.partition("=") for p in (text or "").split(",") if p) if lr}


def cmd_pick(args) -> int:
    from trl_isopo.real.analysis import sweep_table

    results = _learning().load_results(args.results)
    if not results:
        print(f"no results in {args.results}")
        return 1
    table, picks = sweep_table(results)
    print("learning-rate sweep: seed means of the final held-out greedy score and KL(pi || pi_0); the pick "
          "maximizes the score\n")
    print(table)
    by_m: dict = {}
    for (m, method), lr in sorted(picks.items()):
        by_m.setdefault(m, []).append(f"{method}={lr:g}")
    for m, items in sorted(by_m.items()):
        print(f"\nM={m}: --methods {','.join(items)} --steps-per-rollout {m}")
    return 0


def cmd_analyze(args) -> int:
    from trl_isopo.real.analysis import Margins, differences_table, final_points, runs_table, verdicts
    from trl_isopo.real.figures import cpu_png, frontier_png

    rml = _learning()
    results = rml.load_results(args.results)
    if args.seeds:  # e.g. only the seeds every method has finished, so that each row pairs the same seeds
        keep = set(rml.parse_seeds(args.seeds))
        results = [r for r in results if r["settings"]["seed"] in keep]
    if not results:
        print(f"no results in {args.results}" + (f" for seeds {args.seeds}" if args.seeds else ""))
        return 1
    lrs = _parse_lrs(args.methods)
    points = final_points(results, lrs)
    kept = [r for r in results if points.get((r["settings"].get("steps_per_rollout", 1), r["settings"]["method"]), {})
            .get(r["settings"]["seed"], {}).get("lr") == r["settings"]["learning_rate"]]
    os.makedirs(os.path.dirname(os.path.abspath(args.figures)) or ".", exist_ok=True)
    frontier_png(kept, args.figures + "-frontier.png")
    cpu_png(kept, args.figures + "-cpu.png")
    lines = [f"{len(kept)} runs; differences to {args.reference} paired by seed with two 95 % intervals over seeds: "
             f"the percentile bootstrap ({args.bootstrap} resamples) and Student's t; a claim is resolved only when "
             "both clear its boundary", "", differences_table(points, reference=args.reference,
                                                                    n_boot=args.bootstrap),
             "", f"verdicts (equal score: within {args.score_margin:g}; as close to pi_0: KL within "
             f"{args.kl_margin:g} x GRPO's):"]
    lines += ["- " + line for line in verdicts(points, Margins(args.score_margin, args.kl_margin),
                                               n_boot=args.bootstrap)]
    lines += ["", "per run:", "", runs_table(kept)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(f"wrote {args.figures}-frontier.png, {args.figures}-cpu.png" + (f", {args.out}" if args.out else ""))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from trl_isopo.real.protocol import PROTOCOL_METHODS, Protocol

    rml = _learning()
    d = Protocol()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="train the missing (method, lr, seed, M) runs and append them to --results")
    r.add_argument("--methods", default=",".join(PROTOCOL_METHODS), help="names in trl_isopo.methods, optionally "
                   "name=lr")
    r.add_argument("--lrs", type=lambda s: [float(x) for x in s.split(",")], default=[1e-5],
                   help="learning rates for methods given without =lr")
    r.add_argument("--seeds", default="0-4")
    r.add_argument("--steps-per-rollout", default="1,4", help="the M values (comma-separated)")
    r.add_argument("--rollouts", type=int, default=d.rollouts)
    r.add_argument("--epochs", type=int, default=d.epochs,
                   help="TRL num_iterations for the methods with a pi_old (GRPO, REINFORCE, TPO); ISOPO keeps 1")
    r.add_argument("--lora", action="store_true", help="a LoRA r=16 adapter instead of full weights")
    r.add_argument("--eval-every-rollouts", type=int, default=d.eval_every_rollouts)
    r.add_argument("--order", choices=["method", "seed"], default="seed")
    rml.add_run_options(r, prompts=d.prompts, eval_size=d.eval_size, kl_prompts=d.kl_prompts,
                        micro_batch=d.micro_batch, results=RESULTS)
    pk = sub.add_parser("pick", help="the learning-rate sweep's table and pick per (M, method)")
    pk.add_argument("--results", default=RESULTS.replace(".jsonl", "-sweep.jsonl"))
    an = sub.add_parser("analyze", help="frontier and CPU PNGs, paired bootstrap table, verdicts")
    an.add_argument("--results", default=RESULTS)
    an.add_argument("--methods", default=None, help="NAME=LR pins a method's learning rate (default: per (M, "
                    "method) the lr with the most seeds)")
    an.add_argument("--figures", default=FIGURES, help="PNG path prefix (-frontier.png, -cpu.png)")
    an.add_argument("--seeds", default=None, help="only these seeds (e.g. 0-2); default: every seed in --results")
    an.add_argument("--out", default=None, help="also write the printed tables and verdicts to this file")
    an.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples")
    an.add_argument("--reference", default="grpo", help="the method the paired differences are taken to")
    an.add_argument("--score-margin", type=float, default=0.05, help="score differences within it count as equal")
    an.add_argument("--kl-margin", type=float, default=0.2,
                    help="a KL within this fraction of GRPO's mean counts as 'as close to pi_0'")
    return p


def main(argv=None) -> int:
    return _learning().run_command(build_parser, {"run": cmd_run, "pick": cmd_pick, "analyze": cmd_analyze}, argv)


if __name__ == "__main__":
    sys.exit(main())
