"""The protocol's two figures: score against KL (the ISOPO paper's Fig. 4 form, arXiv 2512.23353 §2: each run's KL
from the initial policy and held-out score at the end, convex hulls shaded per method; here also each run's path
through its evaluations), and held-out score against training CPU-seconds along each run. One panel per M."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence


def convex_hull(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Counter-clockwise hull vertices of 2-D points (Andrew's monotone chain; collinear points dropped)."""
    pts = sorted(set(points))
    if len(pts) <= 2:
        return pts

    def cross(o, a, b):
        return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])

    def half(seq):
        chain = []
        for p in seq:
            while len(chain) >= 2 and cross(chain[-2], chain[-1], p) <= 0:
                chain.pop()
            chain.append(p)
        return chain

    lower, upper = half(pts), half(reversed(pts))
    return lower[:-1] + upper[:-1]


def _panels(results, plt, width=5.2):
    ms = sorted({r["settings"].get("steps_per_rollout", 1) for r in results})
    fig, axes = plt.subplots(1, len(ms), figsize=(width * len(ms), 4.2), squeeze=False)
    return ms, fig, axes[0]


def _colors(results):
    methods = sorted({r["settings"]["method"] for r in results})
    return {m: f"C{i % 10}" for i, m in enumerate(methods)}


def _title(results, panels: int = 1) -> str:
    """The settings line, wrapped to the figure's width (about 80 characters per panel at font size 9)."""
    s = results[0]["settings"]
    weights = "LoRA" if s["lora"] else "full weights"
    text = (f"SmolLM2-135M-Instruct, {s['task']['name']}, {weights}; rollouts of {s['prompts_per_rollout']} prompts x "
            f"{s['num_generations']}, {s['eval_size']} held-out questions")
    return textwrap.fill(text, width=80 * panels)


def frontier_png(results: list[dict], path: str) -> None:
    """Final held-out score (greedy mean task score) against final KL(pi || pi_0), one point per run, hulls per
    method; each run's earlier evaluations drawn faintly as the path to its point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Polygon

    from trl_isopo.methods import get_method

    ms, fig, axes = _panels(results, plt)
    colors = _colors(results)
    for ax, m in zip(axes, ms):
        for method, color in colors.items():
            runs = [r for r in results if r["settings"]["method"] == method
                    and r["settings"].get("steps_per_rollout", 1) == m]
            pts = [(r["evals"][-1].get("kl", math.nan), r["evals"][-1]["greedy"]) for r in runs]
            pts = [p for p in pts if not math.isnan(p[0])]
            if not pts:
                continue
            for r in runs:  # the path each run took there: (KL, score) at every evaluation, faint
                trail = [(e["kl"], e["greedy"]) for e in r["evals"] if not math.isnan(e.get("kl", math.nan))]
                ax.plot([p[0] for p in trail], [p[1] for p in trail], "-", color=color, lw=0.8, alpha=0.3)
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=color, s=22,
                       label=f"{get_method(method).label} ({len(pts)})")
            hull = convex_hull(pts)
            if len(hull) >= 3:
                ax.add_patch(Polygon(hull, closed=True, color=color, alpha=0.15, lw=0))
        ax.set(xlabel="KL(π‖π0), nats (probe prompts)", ylabel="held-out score (greedy)",
               title=f"M = {m} optimizer step{'s' if m > 1 else ''} per rollout\n"
                     "(dots: end of run; lines: its evaluations)")
        ax.legend(fontsize=7)
    fig.suptitle(_title(results, len(ms)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def cpu_png(results: list[dict], path: str) -> None:
    """Held-out score at each evaluation against the training CPU-seconds spent so far, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trl_isopo.methods import get_method

    ms, fig, axes = _panels(results, plt)
    colors = _colors(results)
    for ax, m in zip(axes, ms):
        labelled = set()
        for r in sorted(results, key=lambda r: r["settings"]["method"]):
            s = r["settings"]
            if s.get("steps_per_rollout", 1) != m:
                continue
            ev = [e for e in r["evals"] if "train_cpu_seconds" in e]
            method = s["method"]
            ax.plot([e["train_cpu_seconds"] / 60 for e in ev], [e["greedy"] for e in ev], "o-", ms=3, alpha=0.7,
                    color=colors[method], label=None if method in labelled else get_method(method).label)
            labelled.add(method)
        ax.set(xlabel="training CPU-minutes (process CPU time, evaluations excluded)",
               ylabel="held-out score (greedy)", title=f"M = {m}")
        ax.legend(fontsize=7)
    fig.suptitle(_title(results, len(ms)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
