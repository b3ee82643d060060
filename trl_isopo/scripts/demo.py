"""`trl-isopo demo`: GRPO vs REINFORCE vs ISOPO vs TPO on the TPO paper's terminal-reward reverse-copy task, offline.

Every method trains the same tiny transformer (same seeds, prompts per step, K and episodes) through its real TRL
trainer. Prints a table (exact-match training error at checkpoints, episodes to thresholds, KL drift from the
initial policy, wall time), writes a PNG of the learning curves and the raw numbers (CSV + JSON) to --output-dir.
`--quick` is a small smoke version (tests); the default fits in about 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from trl_isopo.lab.cli_common import make_progress, parse_seeds, setup_process
from trl_isopo.lab.methods import DEMO_METHODS

# Default run: the paper's cheap CPU benchmark (tpo-spec §3.8: terminal reverse-copy, H=4, V=2, K=8, lr 1e-3,
# 4 epochs per rollout batch) with 50 prompts per step instead of 100 and 60 episodes, so four methods fit the
# 10-minute budget on 2 cores. AdamW by default: with our torch.optim.Muon port of the paper's optimizer every method
# first learns and then degrades here (docs/reproduction.md); `--optimizer muon` runs it.
FULL = dict(horizon=4, vocab_size=2, group_size=8, prompts_per_step=50, episodes=60, kl_every=15)
QUICK = dict(horizon=4, vocab_size=2, group_size=8, prompts_per_step=16, episodes=12, kl_every=6,
             kl_prompts=16, kl_samples=4)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trl-isopo demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small smoke run (about a minute)")
    p.add_argument("--output-dir", default="demo_out", help="where the table, PNG, CSV and JSON go (default demo_out)")
    p.add_argument("--methods", default=",".join(DEMO_METHODS), help="comma-separated registry names")
    p.add_argument("--seeds", default="0", help='e.g. "0" or "0-1" (default 0)')
    p.add_argument("--episodes", type=int, help="override the number of episodes")
    p.add_argument("--prompts", type=int, help="override prompts per episode (B)")
    p.add_argument("--horizon", type=int, help="override H")
    p.add_argument("--optimizer", default="adamw", choices=["muon", "adamw"],
                   help="adamw (default, lr 1e-3, wd 0) or muon (the TPO paper's routing; unstable here, see docs)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core machine 2 threads stall on every busy core)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def demo_setting(args):
    """The `Setting` a demo invocation trains on."""
    from trl_isopo.lab.runner import Setting

    kw = dict(QUICK if args.quick else FULL)
    for field, value in (("episodes", args.episodes), ("prompts_per_step", args.prompts), ("horizon", args.horizon)):
        if value is not None:
            kw[field] = value
    return Setting(task="reverse_copy", reward="terminal", optimizer=args.optimizer, **kw)


def checkpoints_for(episodes: int) -> list[int]:
    """Episode 1, a quarter, half and the end (deduplicated, increasing)."""
    return sorted({1, max(1, episodes // 4), max(1, episodes // 2), episodes})


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    setup_process(args.threads)
    from trl_isopo.lab import report
    from trl_isopo.lab.methods import available, get_method
    from trl_isopo.lab.runner import train_one

    setting = demo_setting(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        get_method(m)  # unknown names fail before any training
    missing = [m for m in methods if not available(m)]
    if missing:
        print(f"note: skipping {', '.join(missing)} (trainer not importable in this checkout)", file=sys.stderr)
        methods = [m for m in methods if m not in missing]
    seeds = parse_seeds(args.seeds)
    os.makedirs(args.output_dir, exist_ok=True)
    s = setting
    header = (f"trl-isopo demo{' --quick' if args.quick else ''}: terminal-reward {s.task}, H={s.horizon}, "
              f"V={s.vocab_size}, B={s.prompts_per_step} prompts x K={s.group_size}, {s.epochs} epochs/episode, "
              f"{s.episodes} episodes, optimizer {s.optimizer} lr {s.lr:g}, seeds {seeds}")
    print(header, flush=True)

    bar = make_progress(len(methods) * len(seeds) * s.episodes, not args.no_progress, "demo")
    results, t_start = [], time.perf_counter()
    for method in methods:
        for seed in seeds:
            bar.set_postfix_str(f"{method} seed {seed}")
            results.append(train_one(method, seed, setting, on_episode=lambda _: bar.update(1)))
    bar.close()

    checkpoints, thresholds = checkpoints_for(s.episodes), (0.5, 0.1)
    table = report.results_table(results, checkpoints, thresholds)
    total = time.perf_counter() - t_start
    print(table)
    print(f"total wall time {total:.0f} s; KL = mean over {s.kl_prompts} probe prompts x {s.kl_samples} samples "
          f"of KL(pi_theta || pi_initial) per completion, in nats")
    paths = {k: os.path.join(args.output_dir, f"demo_{k}") for k in ("curves.png", "curves.csv", "results.json",
                                                                      "table.txt")}
    report.plot_curves(results, paths["curves.png"], f"terminal {s.task}, H={s.horizon}, V={s.vocab_size}, "
                       f"K={s.group_size}, B={s.prompts_per_step}")
    report.write_csv(results, paths["curves.csv"])
    report.write_json(results, paths["results.json"], command=["trl-isopo", "demo"] + argv,
                      header=header, table=table, total_wall_s=total)
    with open(paths["table.txt"], "w") as f:
        f.write(header + "\n" + table + "\n")
    print("wrote " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
