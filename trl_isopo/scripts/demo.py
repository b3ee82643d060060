"""`trl-isopo demo`: GRPO vs REINFORCE vs ISOPO vs TPO on the TPO paper's terminal-reward reverse-copy task, offline.

Every method trains the same tiny transformer (same seeds, prompts per episode, K and episodes, so the same number of
generated completions) through its real TRL trainer, each in its own regime: ISOPO and REINFORCE (the ISOPO paper's
baseline) take one optimizer step per rollout batch, GRPO and TPO the TPO paper's 4 epochs. The ISOPO setting is
p=-1 without regularization plus GRPO's KL term (beta 0.04), the best of the toy sweep in docs/isopo-regularizer.md.
Prints a table (seed-mean exact-match training error at checkpoints, each seed's final error, episodes to
thresholds, KL drift from the initial policy, wall time), writes a PNG of the learning curves (seed band and
per-seed lines) and the raw numbers (CSV + JSON) to --output-dir. `--quick` is a small one-seed smoke version
(tests); the default (3 seeds, each run in a fresh process, 2 at a time) fits in about 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from trl_isopo.lab.cli_common import make_progress, parse_seeds, run_jobs, setup_process

# The demo's four methods (names of trl_isopo.methods). Its ISOPO is the setting that reached <= 25% final error in
# the most seeds of the toy sweep (docs/isopo-regularizer.md): p=-1 without regularization plus GRPO's KL term to the
# initial policy. GRPO is the TPO paper's baseline, with that KL term.
DEMO_METHODS = ("grpo-kl", "reinforce", "isopo-kl", "tpo")

# Default run: the TPO paper's cheap CPU benchmark (docs/reproduction.md: terminal reverse-copy, H=4, V=2, K=8,
# lr 1e-3) with 50 prompts per episode instead of 100 and 60 episodes, 3 seeds. AdamW by default: with our
# torch.optim.Muon port of the paper's optimizer every method first learns and then degrades here
# (docs/reproduction.md); `--optimizer muon` runs it.
FULL = dict(horizon=4, vocab_size=2, group_size=8, prompts_per_step=50, episodes=60, kl_every=15)
QUICK = dict(horizon=4, vocab_size=2, group_size=8, prompts_per_step=16, episodes=12, kl_every=6,
             kl_prompts=16, kl_samples=4)
SOLVED_BELOW = 0.25  # a seed "reaches <=25%" if its final exact-match error is at most this


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trl-isopo demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small one-seed smoke run (about a minute)")
    p.add_argument("--output-dir", default="demo_out", help="where the table, PNG, CSV and JSON go (default demo_out)")
    p.add_argument("--methods", default=",".join(DEMO_METHODS),
                   help=f"comma-separated names in trl_isopo.methods (default {','.join(DEMO_METHODS)})")
    p.add_argument("--seeds", help='e.g. "0" or "0-4" (default 0-2; 0 with --quick)')
    p.add_argument("--episodes", type=int, help="override the number of episodes")
    p.add_argument("--prompts", type=int, help="override prompts per episode (B)")
    p.add_argument("--horizon", type=int, help="override H")
    p.add_argument("--epochs", type=int,
                   help="optimizer steps per rollout batch for every method (default: each method's own regime)")
    p.add_argument("--method-epochs", default="", help='per-method epochs, e.g. "isopo-kl=4" (wins over --epochs)')
    p.add_argument("--lr", type=float, help="learning rate for every method (default: each method's own, 1e-3)")
    p.add_argument("--method-lr", default="", help='per-method learning rates, e.g. "isopo=3e-3" (wins over --lr)')
    p.add_argument("--optimizer", default="adamw", choices=["muon", "adamw"],
                   help="adamw (default, wd 0) or muon (the TPO paper's routing; unstable here, see docs)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per run (default 1: on a shared 2-core machine 2 threads stall on busy cores)")
    p.add_argument("--workers", type=int,
                   help="N >= 1: each run in a fresh process, N at a time (default 2); 0: all runs in this process, "
                        "one after another (default with --quick)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def demo_setting(args):
    """The base `Setting` a demo invocation trains on (epochs and lr are then set per method)."""
    from trl_isopo.lab.runner import Setting

    kw = dict(QUICK if args.quick else FULL)
    for field, value in (("episodes", args.episodes), ("prompts_per_step", args.prompts), ("horizon", args.horizon)):
        if value is not None:
            kw[field] = value
    return Setting(task="reverse_copy", reward="terminal", optimizer=args.optimizer, **kw)


def method_settings(args, base, methods):
    """{method: Setting} with each method's epochs and lr (its protocol's regime, then the command-line overrides)."""
    from trl_isopo.lab.regime import parse_method_values, regime

    method_epochs = parse_method_values(args.method_epochs, int)
    method_lr = parse_method_values(args.method_lr, float)
    out = {}
    for m in methods:
        epochs, lr = regime(m, base.epochs, base.lr, args.epochs, args.lr, method_epochs, method_lr)
        out[m] = dataclasses.replace(base, epochs=epochs, lr=lr)
    return out


def checkpoints_for(episodes: int) -> list[int]:
    """Episode 1, a quarter, half and the end (deduplicated, increasing)."""
    return sorted({1, max(1, episodes // 4), max(1, episodes // 2), episodes})


def findings(results, key: str = "exact_error") -> list[str]:
    """One line per method restating its numbers (no claim beyond them)."""
    from trl_isopo.lab.report import group_by_method

    lines = []
    for rs in group_by_method(results).values():
        finals = [r[key][-1] for r in rs]
        solved = sum(f <= SOLVED_BELOW for f in finals)
        s = rs[0]["setting"]
        lines.append(f"{rs[0]['label']} ({s['epochs']} optimizer step{'s' if s['epochs'] > 1 else ''} per rollout "
                     f"batch, lr {s['lr']:g}): final error {solved} of {len(rs)} seed{'s' if len(rs) > 1 else ''} "
                     f"<= {100 * SOLVED_BELOW:g}% (per seed: {', '.join(f'{100 * f:.0f}%' for f in finals)}); "
                     f"lowest error reached by any seed {100 * min(min(r[key]) for r in rs):.0f}%")
    return lines


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    setup_process(args.threads)
    from trl_isopo.lab import report
    from trl_isopo.methods import get_method

    base = demo_setting(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in methods:
        get_method(m)  # unknown names fail before any training
    settings = method_settings(args, base, methods)
    seeds = parse_seeds(args.seeds if args.seeds is not None else ("0" if args.quick else "0-2"))
    workers = args.workers if args.workers is not None else (0 if args.quick else 2)
    os.makedirs(args.output_dir, exist_ok=True)
    s = base
    completions = s.episodes * s.prompts_per_step * s.group_size
    regimes = "; ".join(f"{m} {st.epochs} epoch{'s' if st.epochs > 1 else ''}/batch lr {st.lr:g}"
                        for m, st in settings.items())
    header = (f"trl-isopo demo{' --quick' if args.quick else ''}: terminal-reward {s.task}, H={s.horizon}, "
              f"V={s.vocab_size}, B={s.prompts_per_step} prompts x K={s.group_size}, {s.episodes} episodes "
              f"({completions} generated completions per method and seed), optimizer {s.optimizer}, seeds {seeds}, "
              f"{f'{workers} worker process' + ('es' if workers > 1 else '') if workers > 0 else 'in-process'} x "
              f"{args.threads} torch thread{'s' if args.threads > 1 else ''}\n"
              f"regimes (optimizer steps per rollout batch, lr): {regimes}")
    print(header, flush=True)

    jobs = [(m, seed, settings[m]) for m in methods for seed in seeds]
    bar = make_progress(len(jobs) * s.episodes, not args.no_progress, "demo")
    t_start = time.perf_counter()
    done = {(m, seed): r for (m, seed, _), r in run_jobs(jobs, args.threads, workers, bar)}
    bar.close()
    results = [done[(m, seed)] for m, seed, _ in jobs]

    checkpoints, thresholds = checkpoints_for(s.episodes), (0.5, 0.1)
    table = report.results_table(results, checkpoints, thresholds, solved_below=SOLVED_BELOW)
    total = time.perf_counter() - t_start
    notes = findings(results)
    print(table)
    print("\n".join(notes))
    print(f"total wall time {total:.0f} s; final = error of the last episode's rollouts (sampled before its update); "
          f"KL = mean over {s.kl_prompts} probe prompts x {s.kl_samples} samples of KL(pi_theta || pi_initial) per "
          f"completion, in nats (a deterministic policy, right or wrong, is at about ln 16 = 2.77 here: the initial "
          f"policy is near uniform over the 16 completions)")
    paths = {k: os.path.join(args.output_dir, f"demo_{k}") for k in ("curves.png", "curves.csv", "results.json",
                                                                      "table.txt")}
    report.plot_curves(results, paths["curves.png"], f"terminal {s.task}, H={s.horizon}, V={s.vocab_size}, "
                       f"K={s.group_size}, B={s.prompts_per_step}, {len(seeds)} seed{'s' if len(seeds) > 1 else ''}")
    report.write_csv(results, paths["curves.csv"])
    report.write_json(results, paths["results.json"], command=["trl-isopo", "demo"] + argv,
                      header=header, table=table, findings=notes, total_wall_s=total)
    with open(paths["table.txt"], "w") as f:
        f.write(header + "\n" + table + "\n" + "\n".join(notes) + "\n\n" + report.per_seed_table(results) + "\n")
    print("wrote " + ", ".join(paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
