"""Tables, raw-number files and learning-curve plots for lab results (lists of `runner.train_one` dicts)."""

from __future__ import annotations

import csv
import json
import os
from collections import defaultdict

from .runner import fmt_pct, summarize


def group_by_method(results: list[dict]) -> dict[str, list[dict]]:
    """{method: [result per seed]} in first-seen order."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        groups[r["method"]].append(r)
    return dict(groups)


def results_table(results: list[dict], checkpoints, thresholds, key: str = "exact_error",
                  solved_below: float = 0.25) -> str:
    """Plain-text table, one row per method: its regime (epochs per rollout batch, lr), seed-mean error (%) at the
    checkpoints and at the end, each seed's final error, the seeds whose final error is <= `solved_below`, episodes
    to thresholds (of the seed mean), seed-mean final KL drift and wall time."""
    metric = "exact-match" if key == "exact_error" else "token"
    head = ["method", "epochs", "lr", "seeds"] + [f"ep {c}" for c in checkpoints] + ["final", "final per seed"]
    head += [f"<={100 * solved_below:g}%"] + [f"ep to <{100 * t:g}%" for t in thresholds]
    head += ["KL(pi||pi0)", "wall s", "s/ep"]
    rows = []
    for name, rs in group_by_method(results).items():
        s = summarize(rs, checkpoints, thresholds, key)
        finals = [r[key][-1] for r in rs]
        regimes = {(r["setting"]["epochs"], r["setting"]["lr"]) for r in rs}
        epochs = "/".join(str(e) for e in sorted({e for e, _ in regimes}))
        lr = "/".join(f"{x:g}" for x in sorted({x for _, x in regimes}))
        rows.append(
            [rs[0]["label"], epochs, lr, str(s["seeds"])]
            + [fmt_pct(s["at"].get(c)) for c in checkpoints]
            + [fmt_pct(s["final"]), " ".join(f"{100 * f:.0f}" for f in finals)]
            + [f"{sum(f <= solved_below for f in finals)}/{len(finals)}"]
            + ["-" if s["to"][t] is None else str(s["to"][t]) for t in thresholds]
            + [f"{s['final_kl']:.2f}", f"{s['wall_s']:.0f}", f"{s['s_per_episode']:.2f}"]
        )
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    out = [f"{metric} training error (%); ep N, final: seed mean; final per seed: in seed order; "
           f"<={100 * solved_below:g}%: seeds whose final error is at most that",
           line(head), line(["-" * w for w in widths])]
    return "\n".join(out + [line(r) for r in rows])


def per_seed_table(results: list[dict], key: str = "exact_error") -> str:
    """One line per (method, seed): final error (%), lowest error over the run (%) and final KL drift (nats)."""
    rows = [["method", "seed", "final %", "min %", "KL"]]
    for name, rs in group_by_method(results).items():
        for r in rs:
            rows.append([r["label"], str(r["seed"]), fmt_pct(r[key][-1]), fmt_pct(min(r[key])), f"{r['final_kl']:.2f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([line(rows[0]), line(["-" * w for w in widths])] + [line(r) for r in rows[1:]])


def write_csv(results: list[dict], path: str) -> None:
    """Long format: one row per (method, seed, episode) with exact/token error, mean reward."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "seed", "episode", "exact_error", "token_error", "mean_reward"])
        for r in results:
            for i, (e, t, m) in enumerate(zip(r["exact_error"], r["token_error"], r["mean_reward"])):
                w.writerow([r["method"], r["seed"], i + 1, f"{e:.6f}", f"{t:.6f}", f"{m:.6f}"])


def write_json(results: list[dict], path: str, **extra) -> None:
    """All raw results plus `extra` metadata (e.g. the command line and the table)."""
    with open(path, "w") as f:
        json.dump({**extra, "results": results}, f, indent=1)


def plot_curves(results: list[dict], path: str, title: str, key: str = "exact_error") -> None:
    """PNG: seed-mean training error per episode for each method (band: lowest to highest seed, thin lines: seeds),
    and KL drift at the probes (seed mean, thin: seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax, axk) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    for i, (name, rs) in enumerate(group_by_method(results).items()):
        color = f"C{i}"
        curves = np.array([r[key] for r in rs])
        x = np.arange(1, curves.shape[1] + 1)
        e = rs[0]["setting"].get("epochs")
        label = rs[0]["label"] + (f", {e} ep/batch" if e else "") + (f" ({len(rs)} seeds)" if len(rs) > 1 else "")
        if len(rs) > 1:
            ax.fill_between(x, curves.min(0), curves.max(0), color=color, alpha=0.12, lw=0)
            for c in curves:
                ax.plot(x, c, color=color, alpha=0.35, lw=0.7)
        ax.plot(x, curves.mean(0), color=color, lw=2, label=label)
        kls = np.array([r["kl"] for r in rs])
        if len(rs) > 1:
            for k in kls:
                axk.plot(rs[0]["kl_episodes"], k, color=color, alpha=0.35, lw=0.7)
        axk.plot(rs[0]["kl_episodes"], kls.mean(0), "o-", color=color, label=rs[0]["label"])
    ax.set(xlabel="episode", ylabel=("exact-match" if key == "exact_error" else "token") + " training error",
           title=title, ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    axk.set(xlabel="episode", ylabel="KL(pi_theta || pi_0) per sequence (nats)", title="drift from the initial policy")
    axk.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
