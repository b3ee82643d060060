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


def results_table(results: list[dict], checkpoints, thresholds, key: str = "exact_error") -> str:
    """Plain-text table: seed-mean error (%) at checkpoints and at the end, episodes to thresholds, KL, wall time."""
    metric = "exact-match" if key == "exact_error" else "token"
    head = ["method", "seeds"] + [f"ep {c}" for c in checkpoints] + ["final"]
    head += [f"ep to <{100 * t:g}%" for t in thresholds] + ["KL(pi||pi0)", "wall s", "s/ep"]
    rows = []
    for name, rs in group_by_method(results).items():
        s = summarize(rs, checkpoints, thresholds, key)
        rows.append(
            [rs[0]["label"], str(s["seeds"])]
            + [fmt_pct(s["at"].get(c)) for c in checkpoints]
            + [fmt_pct(s["final"])]
            + ["-" if s["to"][t] is None else str(s["to"][t]) for t in thresholds]
            + [f"{s['final_kl']:.2f}", f"{s['wall_s']:.0f}", f"{s['s_per_episode']:.2f}"]
        )
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    out = [f"{metric} training error (%), seed mean", line(head), line(["-" * w for w in widths])]
    return "\n".join(out + [line(r) for r in rows])


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
    """PNG: seed-mean training error per episode for each method (thin lines: seeds), and KL drift at probes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax, axk) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [2, 1]})
    for i, (name, rs) in enumerate(group_by_method(results).items()):
        color = f"C{i}"
        curves = np.array([r[key] for r in rs])
        x = np.arange(1, curves.shape[1] + 1)
        if len(rs) > 1:
            for c in curves:
                ax.plot(x, c, color=color, alpha=0.2, lw=0.8)
        ax.plot(x, curves.mean(0), color=color, lw=2, label=rs[0]["label"])
        kl = np.array([r["kl"] for r in rs]).mean(0)
        axk.plot(rs[0]["kl_episodes"], kl, "o-", color=color, label=rs[0]["label"])
    ax.set(xlabel="episode", ylabel=("exact-match" if key == "exact_error" else "token") + " training error",
           title=title, ylim=(0, 1))
    ax.grid(alpha=0.3)
    ax.legend()
    axk.set(xlabel="episode", ylabel="KL(pi_theta || pi_0) per sequence (nats)", title="drift from the initial policy")
    axk.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
