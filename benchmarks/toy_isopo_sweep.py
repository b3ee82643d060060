"""ISOPO regularizer sweep on the demo task (docs/isopo-regularizer.md): run it, or print its per-seed table.

Terminal-reward reverse-copy, H=4, V=2, B=50 prompts x K=8, AdamW lr 1e-3, one optimizer step per rollout batch,
4 seeds, each run in a fresh process (`trl-isopo compare --workers 1`), one run at a time. Resumable: finished runs
are kept in the JSON-lines file and skipped on a restart.

    python benchmarks/toy_isopo_sweep.py                       # train what is missing, then print the table
    python benchmarks/toy_isopo_sweep.py --report-only         # only the table (markdown)
    python benchmarks/toy_isopo_sweep.py --episodes 120 --methods isopo,reinforce

Methods are names in `trl_isopo.methods`; results stored under a name whose setting has changed since (the sweep's
`isopo` was c = 1, now `isopo-c1`; its `isopo-reg0` is today's `isopo`) are read under today's name
(`trl-isopo compare`'s `load_results`).
"""

from __future__ import annotations

import argparse
import os
import sys

GROUPS = ["isopo-c1,isopo,reinforce", "isopo-c0.1,isopo-c0.01", "isopo-ema-median,isopo-batch-median", "isopo-q"]
SOLVED_BELOW = 0.25


def compare_argv(methods: str, episodes: int, seeds: str, output: str) -> list[str]:
    return ["-H", "4", "-B", "50", "--methods", methods, "--episodes", str(episodes), "--epochs", "1",
            "--optimizer", "adamw", "--lr", "1e-3", "--seeds", seeds, "--threads", "1", "--workers", "1",
            "--kl-every", "15", "--checkpoints", f"1,{episodes // 4},{episodes // 2},{episodes}",
            "--thresholds", "0.5,0.25,0.1", "--no-progress", "--output", output]


def markdown(path: str, episodes: int, methods: list[str] | None = None) -> str:
    """Per-seed markdown table: final error and KL per seed, seed mean, solved count, per method."""
    from trl_isopo.scripts.compare import load_results

    rows: dict[str, list[dict]] = {}
    for r in load_results(path):
        if r["setting"]["episodes"] == episodes and (methods is None or r["method"] in methods):
            rows.setdefault(r["method"], []).append(r)
    out = ["| method | label | epochs | lr | final error % per seed (0 / 1 / 2 / 3) | mean | min over run % per seed "
           "| KL per seed (nats) | seeds <= 25% | s/run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in methods or rows:
        rs = sorted(rows.get(name, []), key=lambda r: r["seed"])
        if not rs:
            continue
        finals = [r["exact_error"][-1] for r in rs]
        out.append(
            f"| `{name}` | {rs[0]['label']} | {rs[0]['setting']['epochs']} | {rs[0]['setting']['lr']:g} | "
            + " / ".join(f"{100 * x:.0f}" for x in finals)
            + f" | {100 * sum(finals) / len(finals):.1f} | "
            + " / ".join(f"{100 * min(r['exact_error']):.0f}" for r in rs)
            + " | " + " / ".join(f"{r['final_kl']:.2f}" for r in rs)
            + f" | {sum(x <= SOLVED_BELOW for x in finals)}/{len(rs)} | "
            + f"{sum(r['wall_s'] for r in rs) / len(rs):.0f} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", help="comma-separated names in trl_isopo.methods (default: the sweep's groups, in order)")
    p.add_argument("--episodes", type=int, default=60)
    p.add_argument("--seeds", default="0-3")
    p.add_argument("--output", default=None, help="default outputs/isopo_reg_sweep.jsonl (60 episodes) or "
                                                   "outputs/isopo_reg_sweep_<episodes>ep.jsonl")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args(argv)
    output = args.output or ("outputs/isopo_reg_sweep.jsonl" if args.episodes == 60
                             else f"outputs/isopo_reg_sweep_{args.episodes}ep.jsonl")
    groups = [args.methods] if args.methods else GROUPS
    if not args.report_only:
        from trl_isopo.scripts.compare import main as compare

        for methods in groups:
            compare(compare_argv(methods, args.episodes, args.seeds, output))
    if os.path.exists(output):
        print(markdown(output, args.episodes, ",".join(groups).split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
