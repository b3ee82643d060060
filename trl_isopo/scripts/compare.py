"""`trl-isopo compare`: resumable sweeps over task / reward / H / V / K / methods / episodes / seeds / optimizer.

Each finished (method, seed, setting) is appended as one JSON line to --output as soon as it ends; a restart with the
same arguments skips the lines already there, so a long sweep can be stopped and resumed. At the end (or with
--report-only) it prints, per setting, seed-mean errors at checkpoints, the final error, episodes to thresholds (the
paper's "steps to 1%" is the first episode whose seed mean is below 1%), KL drift and wall time, plus the paper's
Table 3 number where the setting is a Table 3 cell.

Matching (arXiv 2604.06159 §3): "prompt" = every method sees B prompts per episode (grouped methods: B*K rollouts);
"interaction" = every method gets B*K rollouts per episode, so a method with group size K_m (`name@K_m`) sees
B*K/K_m prompts and its learning rate is scaled by sqrt(K/K_m). All built-in methods are grouped with the same K, so
the two coincide unless group sizes differ (e.g. `--methods tpo,grpo@2`).

Methods are names of `trl_isopo.methods`. Regimes (`trl_isopo.lab.regime`): by default each method trains in its
protocol's regime, ISOPO and REINFORCE one optimizer step per rollout batch, GRPO and TPO 4 epochs, all at lr 1e-3.
`--epochs N` / `--lr X` set every method; `--method-epochs isopo=1,grpo-kl=4` / `--method-lr isopo=3e-3` set single
methods (these win). Every method always generates the same number of completions (episodes x B x K); only the
optimizer steps per batch differ. Results stored under a name whose setting has changed since
(`trl_isopo.methods.RENAMED`) are read under today's name.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

from trl_isopo.lab.cli_common import make_progress, parse_seeds, run_jobs, setup_process


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trl-isopo compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="reverse_copy", choices=["copy", "flip", "reverse_copy", "reverse_flip"])
    p.add_argument("--reward", default="terminal", choices=["bag", "sequential", "terminal"])
    p.add_argument("--horizon", "-H", default="4", help='H, or a list "7,8,9,10"')
    p.add_argument("--vocab", "-V", default="2", help='V, or a list "2,4"')
    p.add_argument("--group-size", "-K", type=int, default=8)
    p.add_argument("--prompts", "-B", type=int, default=100, help="prompts per episode (B)")
    p.add_argument("--methods", default="grpo-kl,reinforce,isopo,tpo",
                   help="names of trl_isopo.methods, optionally name@K")
    p.add_argument("--episodes", type=int, default=100)
    p.add_argument("--epochs", type=int, default=None,
                   help="optimizer steps per rollout batch (num_iterations) for every method (default: each "
                        "method's own: ISOPO and REINFORCE 1, GRPO and TPO 4)")
    p.add_argument("--method-epochs", default="",
                   help='per-method epochs, e.g. "isopo=1,grpo-kl=4" (wins over --epochs)')
    p.add_argument("--seeds", default="0", help='"0-19", "0,3", ...')
    p.add_argument("--optimizer", default="muon", choices=["muon", "adamw"])
    p.add_argument("--lr", type=float, default=None, help="learning rate for every method (default: each method's "
                                                                     "own, 1e-3 for all built-in methods)")
    p.add_argument("--method-lr", default="", help='per-method learning rates, e.g. "isopo=3e-3" (wins over --lr)')
    p.add_argument("--matching", default="prompt", choices=["prompt", "interaction"])
    p.add_argument("--kl-every", type=int, default=0, help="episodes between KL probes (0: only at the end)")
    p.add_argument("--output", default="outputs/compare.jsonl", help="JSON-lines results file (appended, resumable)")
    p.add_argument("--plot", help="also write a PNG of the learning curves here")
    p.add_argument("--checkpoints", default="", help='episodes for the table, e.g. "1,25,50,100" (default: auto)')
    p.add_argument("--thresholds", default="0.1,0.01", help="error thresholds for 'episodes to' (default 0.1,0.01)")
    p.add_argument("--metric", default="auto", choices=["auto", "exact", "token"],
                   help="error reported: exact-match (terminal default) or token error (bag/sequential default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workers", type=int, default=0,
                   help="0 (default): train in this process, one run after another; N >= 1: each run in a fresh "
                        "process, N at a time, each with --threads threads")
    p.add_argument("--report-only", action="store_true", help="train nothing; summarize what --output holds")
    p.add_argument("--no-progress", action="store_true")
    return p


def parse_method(spec: str) -> tuple[str, int | None]:
    """"tpo" -> ("tpo", None); "grpo@4" -> ("grpo", 4)."""
    name, _, k = spec.partition("@")
    return name.strip(), (int(k) if k else None)


def run_setting(base, group_size: int | None, matching: str):
    """The setting one method trains on under `matching` (see module doc)."""
    if group_size is None or group_size == base.group_size:
        return base
    if matching == "prompt":
        return dataclasses.replace(base, group_size=group_size)
    rollouts = base.prompts_per_step * base.group_size
    if rollouts % group_size:
        raise ValueError(f"B*K = {rollouts} is not divisible by the group size {group_size}")
    return dataclasses.replace(base, group_size=group_size, prompts_per_step=rollouts // group_size,
                               lr=base.lr * math.sqrt(base.group_size / group_size))


def result_key(method: str, seed: int, setting: dict) -> str:
    """Identity of one run in the results file (fields a file predates take their current defaults)."""
    from trl_isopo.lab.runner import Setting

    full = {**dataclasses.asdict(Setting()), **setting}
    return json.dumps({"method": method, "seed": seed, "setting": full}, sort_keys=True)


def load_results(path: str) -> list[dict]:
    """All complete JSON lines of `path` (a torn last line from an interrupted write is ignored), each under its
    method's current name (`trl_isopo.methods.current_name`; the stored name is kept as `stored_method`)."""
    from trl_isopo.methods import current_name

    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "method" in r and current_name(r["method"], r.get("label")) != r["method"]:
                r = {**r, "method": current_name(r["method"], r.get("label")), "stored_method": r["method"]}
            out.append(r)
    return out


def append_result(path: str, result: dict) -> None:
    """Append one result as a single JSON line and flush it to disk (after a torn last line, on a fresh line)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    torn = False
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
    with open(path, "a") as f:
        f.write(("\n" if torn else "") + json.dumps(result) + "\n")
        f.flush()
        os.fsync(f.fileno())


def planned_runs(args) -> list[tuple[str, int, object]]:
    """(method name, seed, Setting) for every run the arguments ask for, each method in its regime (module doc)."""
    from trl_isopo.lab.regime import parse_method_values, regime
    from trl_isopo.lab.runner import Setting

    method_epochs = parse_method_values(getattr(args, "method_epochs", ""), int)
    method_lr = parse_method_values(getattr(args, "method_lr", ""), float)
    runs = []
    for h in [int(x) for x in str(args.horizon).split(",")]:
        for v in [int(x) for x in str(args.vocab).split(",")]:
            base = Setting(task=args.task, reward=args.reward, horizon=h, vocab_size=v, group_size=args.group_size,
                           prompts_per_step=args.prompts, episodes=args.episodes, optimizer=args.optimizer,
                           kl_every=args.kl_every)
            for spec in args.methods.split(","):
                name, k = parse_method(spec)
                epochs, lr = regime(name, base.epochs, base.lr, args.epochs, args.lr, method_epochs, method_lr)
                mine = dataclasses.replace(base, epochs=epochs, lr=lr)
                for seed in parse_seeds(args.seeds):
                    runs.append((name, seed, run_setting(mine, k, args.matching)))
    return runs


def report(results: list[dict], args) -> str:
    """Tables per (H, V) of the results that belong to this invocation, with Table 3 numbers where they apply."""
    from trl_isopo.lab import report as rep
    from trl_isopo.lab.paper import paper_final
    from trl_isopo.lab.runner import fmt_pct

    key = {"exact": "exact_error", "token": "token_error"}.get(args.metric)
    key = key or ("exact_error" if args.reward == "terminal" else "token_error")
    thresholds = [float(t) for t in args.thresholds.split(",") if t]
    chunks = []
    by_hv: dict[tuple, list[dict]] = {}
    for r in results:
        by_hv.setdefault((r["setting"]["horizon"], r["setting"]["vocab_size"]), []).append(r)
    for (h, v), rs in sorted(by_hv.items()):
        eps = rs[0]["setting"]["episodes"]
        cps = [int(c) for c in args.checkpoints.split(",") if c] or sorted({1, eps // 4, eps // 2, eps} - {0})
        s = rs[0]["setting"]
        title = (f"{s['reward']} {s['task']}, H={h}, V={v}, K={s['group_size']}, B={s['prompts_per_step']}, "
                 f"{eps} episodes, {s['optimizer']} (epochs and lr per method in the table), {args.matching}-matched")
        lines = [title, rep.results_table(rs, cps, thresholds, key)]
        paper = []
        for m in dict.fromkeys(r["method"] for r in rs):
            try:
                paper.append(f"{m} {fmt_pct(paper_final(m, s, args.matching))}%")
            except KeyError:
                pass
        if paper:
            lines.append("paper Table 3 final error: " + ", ".join(paper))
        chunks.append("\n".join(lines))
    return "\n\n".join(chunks)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    setup_process(args.threads)

    runs = planned_runs(args)
    wanted = {result_key(m, seed, s.key()) for m, seed, s in runs}
    done = {result_key(r["method"], r["seed"], r["setting"]): r for r in load_results(args.output)}
    todo = [(m, seed, s) for m, seed, s in runs if result_key(m, seed, s.key()) not in done]
    print(f"compare: {len(runs)} runs planned, {len(runs) - len(todo)} already in {args.output}, "
          f"{0 if args.report_only else len(todo)} to train", flush=True)
    if not args.report_only and todo:
        bar = make_progress(sum(s.episodes for _, _, s in todo), not args.no_progress, "compare")
        for (m, seed, s), result in run_jobs(todo, args.threads, args.workers, bar):
            result["matching"] = args.matching
            result["command"] = ["trl-isopo", "compare"] + list(sys.argv[1:] if argv is None else argv)
            append_result(args.output, result)
            done[result_key(m, seed, s.key())] = result
        bar.close()
    mine = [r for k, r in done.items() if k in wanted]
    if not mine:
        print("no results yet")
        return 0
    print(report(mine, args))
    if args.plot:
        from trl_isopo.lab.report import plot_curves

        metric = "exact_error" if (args.metric == "exact" or (args.metric == "auto" and args.reward == "terminal")) \
            else "token_error"
        plot_curves(mine, args.plot, f"{args.reward} {args.task}", key=metric)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
