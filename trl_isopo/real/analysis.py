"""Analysis of the M-steps protocol: paired differences over seeds, bootstrap intervals and plain-words verdicts.

Runs of two methods at the same seed saw the same prompts in the same order (`trl_isopo.real.protocol`), so each
method is compared with GRPO seed by seed: d_s = x_method(s) - x_grpo(s) for the final held-out score (greedy mean
task score) and the final KL(pi || pi_0). Two 95 % intervals of the mean of d: the percentile bootstrap over
resampled seeds, and Student's t (mean +- t_{0.975, n-1} * sd / sqrt(n)). At 3-5 seeds the bootstrap is too narrow
(for normal differences it covers the mean about 75 % of the time at n = 3, 84 % at n = 5;
benchmarks/interval_coverage.py), so a claim is resolved only when both intervals clear its boundary (0, or a stated
margin); when they do not, the seed count that would resolve it is the t-test sample size for the observed paired
SD: the smallest n with n >= ((t_{1-alpha/2, n-1} + t_{power, n-1}) * sd / |mean - boundary|)^2.
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


# A difference, and so a verdict, needs this many paired seeds: with 2 the percentile bootstrap can only return the
# range of the two differences, an interval with no coverage to speak of.
MIN_SEEDS = 3
# Seed counts above this are reported as "more than" it.
MAX_SEEDS_QUOTED = 1000


def bootstrap_means(diffs: Sequence[float], n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """(n_boot,) means of `diffs` resampled with replacement (same length)."""
    d = np.asarray(diffs, dtype=np.float64)
    return d[rng.integers(0, len(d), size=(n_boot, len(d)))].mean(axis=1)


def bootstrap_ci(diffs: Sequence[float], n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> tuple:
    """(lo, hi): the percentile bootstrap interval of the mean of `diffs`."""
    means = bootstrap_means(diffs, n_boot, np.random.default_rng(seed))
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


@functools.lru_cache(maxsize=64)
def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom (0.5 < p < 1): bisection on its CDF, the density
    integrated by Simpson's rule from 0 (no SciPy in the base install)."""
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def cdf(x: float) -> float:
        n = 2000  # even: Simpson
        h = x / n
        f = [math.exp(log_c - (df + 1) / 2 * math.log1p((i * h) ** 2 / df)) for i in range(n + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def t_interval(diffs: Sequence[float], level: float = 0.95) -> tuple:
    """(lo, hi): Student's t interval of the mean of `diffs` (n >= 2)."""
    n = len(diffs)
    half = t_quantile((1 + level) / 2, n - 1) * statistics.stdev(diffs) / math.sqrt(n)
    mean = statistics.mean(diffs)
    return mean - half, mean + half


def seeds_to_resolve(mean: float, sd: float, boundary: float = 0.0, alpha: float = 0.05, power: float = 0.8):
    """Seeds for a two-sided level-alpha t interval of a paired mean to exclude `boundary` with probability `power`,
    if the true difference is the observed `mean` with paired SD `sd`: the smallest n (at least `MIN_SEEDS`) with
    n >= ((t_{1-alpha/2, n-1} + t_{power, n-1}) * sd / |mean - boundary|)^2 (the shifted-central-t approximation of
    the noncentral t). None when mean == boundary (no size does)."""
    gap = abs(mean - boundary)
    if gap == 0.0:
        return None
    z = statistics.NormalDist().inv_cdf
    n = max(MIN_SEEDS, math.ceil(((z(1 - alpha / 2) + z(power)) * sd / gap) ** 2))  # t > z: a lower bound
    while n < ((t_quantile(1 - alpha / 2, n - 1) + t_quantile(power, n - 1)) * sd / gap) ** 2:
        n += 1
    return n


@dataclass(frozen=True)
class Difference:
    """Mean over paired seeds of `quantity`(method) - `quantity`(other), its bootstrap interval (lo, hi), its t
    interval (t_lo, t_hi) and paired SD."""

    quantity: str
    method: str
    other: str
    steps_per_rollout: int
    n: int
    mean: float
    sd: float
    lo: float
    hi: float
    t_lo: float
    t_hi: float

    def text(self, digits: int = 3) -> str:
        return (f"{self.mean:+.{digits}f} [{self.lo:+.{digits}f}, {self.hi:+.{digits}f}] "
                f"(t: [{self.t_lo:+.{digits}f}, {self.t_hi:+.{digits}f}])")

    def clears(self, boundary: float, below: bool) -> bool:
        """Both intervals lie strictly below `boundary` (when `below`) or strictly above it."""
        return max(self.hi, self.t_hi) < boundary if below else min(self.lo, self.t_lo) > boundary

    def seeds_needed(self, boundary: float = 0.0):
        return seeds_to_resolve(self.mean, self.sd, boundary)


def final_points(results: list[dict], lrs: dict | None = None) -> dict:
    """{(M, method): {seed: {"score", "kl", "sampled", "cpu", "lr"}}} from the final evaluations. Per (M, method)
    one learning rate: `lrs[method]` if given, else the one with the most seeds (a tie is an error: name it)."""
    by_lr: dict = {}
    for r in results:
        s = r["settings"]
        key = (s.get("steps_per_rollout", 1), s["method"])
        by_lr.setdefault(key, {}).setdefault(s["learning_rate"], []).append(r)
    points = {}
    for key, groups in sorted(by_lr.items()):
        if lrs and key[1] in lrs:
            lr = lrs[key[1]]
            if lr not in groups:
                continue
        else:
            most = max(len(g) for g in groups.values())
            best = [lr for lr, g in groups.items() if len(g) == most]
            if len(best) > 1:
                raise ValueError(f"{key[1]} at M={key[0]} has {most} seeds at each of lrs {sorted(best)}; pick one "
                                 "with --methods NAME=LR")
            lr = best[0]
        points[key] = {}
        for r in groups[lr]:
            e = r["evals"][-1]
            points[key][r["settings"]["seed"]] = {"score": e["greedy"], "kl": e.get("kl", math.nan),
                                                  "sampled": e.get("sampled", math.nan),
                                                  "cpu": r.get("train_cpu_seconds", math.nan), "lr": lr}
    return points


def paired_difference(points: dict, method: str, other: str, m: int, quantity: str, n_boot: int = 10_000,
                      seed: int = 0):
    """The `Difference` of `method` to `other` at M = `m` over their common seeds (None with fewer
    than `MIN_SEEDS`)."""
    a, b = points.get((m, method), {}), points.get((m, other), {})
    seeds = sorted(set(a) & set(b))
    if len(seeds) < MIN_SEEDS:
        return None
    d = [a[s][quantity] - b[s][quantity] for s in seeds]
    lo, hi = bootstrap_ci(d, n_boot, seed=seed)
    return Difference(quantity, method, other, m, len(d), statistics.mean(d), statistics.stdev(d), lo, hi,
                      *t_interval(d))


def _unresolved(diff: Difference, boundary: float, what: str) -> str:
    n = diff.seeds_needed(boundary)
    if n is None:
        more = "no seed count would: the observed mean sits on the boundary"
    elif n > MAX_SEEDS_QUOTED:  # a mean a hair from the boundary: the count is real but says only "never"
        more = (f"more than {MAX_SEEDS_QUOTED} paired seeds: the observed mean is {abs(diff.mean - boundary):.3f} from "
                f"the boundary {boundary:+.3f} (paired SD {diff.sd:.3f})")
    else:
        more = (f"about {n} paired seeds would resolve a true difference of this size (paired SD {diff.sd:.3f}, 80 % "
                "power, 5 % two-sided)")
    return f"not resolved at this power ({what} {diff.text()} over {diff.n} seeds; {more})"


def _status(diff: Difference, boundary: float, below: bool) -> str:
    """'yes' if both intervals lie on the claimed side of `boundary` (below it when `below`), 'no' if both lie on the
    other side."""
    if diff.clears(boundary, below):
        return "yes"
    if diff.clears(boundary, not below):
        return "no"
    return "unresolved"


@dataclass(frozen=True)
class Margins:
    """What counts as equal: scores within `score` (mean task score, 0-1) of each other; a KL within `kl_relative`
    of the comparator's mean KL."""

    score: float = 0.05
    kl_relative: float = 0.2


def _label(method: str) -> str:
    from trl_isopo.methods import get_method

    return get_method(method).label


def verdicts(points: dict, margins: Margins = Margins(), n_boot: int = 10_000) -> list[str]:
    """Plain-words verdicts, per M, on (a) ISOPO drifts less than REINFORCE at equal score when M > 1, (b) ISOPO
    without a clip stays as close to pi_0 as GRPO with one, (c) TPO >= GRPO in score with lower KL."""
    out = []
    isopos = [m for m in ("isopo", "isopo-fig6") if any(k[1] == m for k in points)]
    for m in sorted({k[0] for k in points}):
        def diff(a, b, q):
            return paired_difference(points, a, b, m, q, n_boot)

        for iso in isopos:
            if m > 1:
                out.append(_verdict_a(m, iso, diff(iso, "reinforce", "kl"), diff(iso, "reinforce", "score"), margins))
            out.append(_verdict_b(m, iso, diff(iso, "grpo", "kl"), points.get((m, "grpo"), {}), margins))
        out.append(_verdict_c(m, diff("tpo", "grpo", "score"), diff("tpo", "grpo", "kl"), margins))
    return out


def _missing(tag, m, what):
    return f"({tag}) M={m}: no verdict, {what} lack at least {MIN_SEEDS} paired seeds."


def _verdict_a(m, iso, kl: Difference | None, score: Difference | None, margins: Margins) -> str:
    head = f"(a) M={m}, {_label(iso)} vs REINFORCE, 'drifts less at equal score'"
    if kl is None or score is None:
        return _missing("a", m, f"{iso} and reinforce")
    k, s = _status(kl, 0.0, below=True), _status(score, -margins.score, below=False)
    facts = f"KL difference {kl.text()} nats, score difference {score.text()} ({kl.n} seeds)"
    if k == "yes" and s == "yes":
        return f"{head}: yes. ISOPO ends closer to pi_0 ({facts}; score within -{margins.score} or better)."
    if k == "no":
        return f"{head}: no, ISOPO drifts more ({facts})."
    if s == "no":
        return f"{head}: no, not at equal score: ISOPO scores lower by more than {margins.score} ({facts})."
    parts = [_unresolved(kl, 0.0, "KL difference")] if k != "yes" else []
    parts += [_unresolved(score, -margins.score, "score difference")] if s != "yes" else []
    return f"{head}: " + "; ".join(parts) + "."


def _verdict_b(m, iso, kl: Difference | None, grpo: dict, margins: Margins) -> str:
    head = f"(b) M={m}, {_label(iso)} (no clip) vs GRPO (clip 0.2), 'as close to pi_0'"
    if kl is None:
        return _missing("b", m, f"{iso} and grpo")
    margin = margins.kl_relative * statistics.mean(v["kl"] for v in grpo.values())
    k = _status(kl, margin, below=True)
    facts = (f"KL difference {kl.text()} nats over {kl.n} seeds, margin +{margin:.3f} nats = {margins.kl_relative:g} "
             "x GRPO's mean KL")
    if k == "yes":
        return f"{head}: yes, ISOPO's KL is at most GRPO's plus the margin ({facts})."
    if k == "no":
        return f"{head}: no, ISOPO drifts further than GRPO by more than the margin ({facts})."
    return f"{head}: " + _unresolved(kl, margin, "KL difference") + f"; margin +{margin:.3f} nats."


def _verdict_c(m, score: Difference | None, kl: Difference | None, margins: Margins) -> str:
    head = f"(c) M={m}, TPO vs GRPO (clip 0.2), 'score >= GRPO's with lower KL'"
    if kl is None or score is None:
        return _missing("c", m, "tpo and grpo")
    s, k = _status(score, -margins.score, below=False), _status(kl, 0.0, below=True)
    facts = f"score difference {score.text()}, KL difference {kl.text()} nats ({kl.n} seeds)"
    if s == "yes" and k == "yes":
        return f"{head}: yes ({facts}; score within -{margins.score} or better)."
    if s == "no" or k == "no":
        why = ["TPO scores lower by more than the margin"] * (s == "no") + ["TPO drifts more"] * (k == "no")
        return f"{head}: no, {' and '.join(why)} ({facts})."
    parts = [_unresolved(score, -margins.score, "score difference")] if s != "yes" else []
    parts += [_unresolved(kl, 0.0, "KL difference")] if k != "yes" else []
    return f"{head}: " + "; ".join(parts) + "."


def differences_table(points: dict, reference: str = "grpo", n_boot: int = 10_000) -> str:
    """Markdown: per M and method, the seed means and the paired differences to `reference` with 95 % intervals."""
    ref = "GRPO" if reference == "grpo" else reference
    rows = [f"| M | method | lr | seeds | score | KL (nats) | train CPU-s | score − {ref} [bootstrap] (t) "
            f"| KL − {ref} [bootstrap] (t) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for (m, method), by_seed in sorted(points.items()):
        vals = list(by_seed.values())
        mean = {q: statistics.mean(v[q] for v in vals) for q in ("score", "kl", "cpu")}
        cells = []
        for q in ("score", "kl"):
            d = None if method == reference else paired_difference(points, method, reference, m, q, n_boot)
            cells.append("—" if d is None else d.text())
        rows.append(f"| {m} | {_label(method)} | {vals[0]['lr']:g} | {len(vals)} | {mean['score']:.3f} | "
                    f"{mean['kl']:.3f} | {mean['cpu']:.0f} | {cells[0]} | {cells[1]} |")
    return "\n".join(rows)


def sweep_table(results: list[dict]) -> tuple[str, dict]:
    """(markdown, {(M, method): picked lr}) of a learning-rate sweep: per (M, method, lr) the seed means of the final
    greedy score and KL; the pick maximizes the mean score (ties: the smaller KL, then the smaller lr)."""
    cells: dict = {}
    for r in results:
        s = r["settings"]
        e = r["evals"][-1]
        cells.setdefault((s.get("steps_per_rollout", 1), s["method"]), {}).setdefault(s["learning_rate"], []).append(
            (e["greedy"], e.get("kl", math.nan)))
    rows = ["| M | method | lr | seeds | score | KL (nats) | pick |", "|---|---|---|---|---|---|---|"]
    picks = {}
    for key, by_lr in sorted(cells.items()):
        means = {lr: (statistics.mean(x for x, _ in v), statistics.mean(k for _, k in v), len(v))
                 for lr, v in by_lr.items()}
        picks[key] = max(sorted(means), key=lambda lr: (means[lr][0], -means[lr][1], -lr))
        for lr, (score, kl, n) in sorted(means.items()):
            rows.append(f"| {key[0]} | {key[1]} | {lr:g} | {n} | {score:.3f} | {kl:.3f} | "
                        f"{'**yes**' if lr == picks[key] else ''} |")
    return "\n".join(rows), picks


def step_diagnostic(record: dict) -> tuple[str, float]:
    """(name, value): the run's per-step diagnostic averaged over its optimizer steps. ISOPO: `isopo/scale_spread`
    over every step; TPO: `tpo/max_abs_p_minus_q` over every step; methods with a clip: `clip_ratio/region_mean` over
    the steps after a rollout's first (on the first, pi = pi_old and nothing can be clipped)."""
    log = record.get("step_log", [])
    for key, name in (("isopo/scale_spread", "scale spread"), ("tpo/max_abs_p_minus_q", "max \\|p−q\\|")):
        vals = [s[key] for s in log if key in s]
        if vals:
            return name, statistics.mean(vals)
    first = {g + 1 for g in record.get("generation_steps", [])}  # log steps are 1-based
    vals = [s["clip_ratio/region_mean"] for s in log if "clip_ratio/region_mean" in s and s["step"] not in first]
    return "clip fraction", statistics.mean(vals) if vals else math.nan


def runs_table(results: list[dict]) -> str:
    """Markdown, one row per run (seed-major): greedy score at each evaluation, final sampled score and KL, the mean
    per-step diagnostic (`step_diagnostic`) and the run's CPU-seconds (training and evaluation)."""
    rollouts = sorted({e.get("rollout", 0) for r in results for e in r["evals"]})
    rows = [f"| seed | M | method | lr | greedy score at rollouts {' / '.join(map(str, rollouts))} | final sampled | "
            "final KL, nats | per-step diagnostic (mean) | CPU-s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["settings"]["seed"], r["settings"].get("steps_per_rollout", 1),
                                            r["settings"]["method"])):
        s, ev = r["settings"], r["evals"]
        by_rollout = {e.get("rollout", 0): e["greedy"] for e in ev}
        scores = " / ".join(f"{by_rollout[k]:.3f}" if k in by_rollout else "–" for k in rollouts)
        name, value = step_diagnostic(r)
        cpu = r.get("cpu_seconds", math.nan)
        rows.append(f"| {s['seed']} | {s.get('steps_per_rollout', 1)} | `{s['method']}` | {s['learning_rate']:g} | "
                    f"{scores} | {ev[-1].get('sampled', math.nan):.3f} | {ev[-1].get('kl', math.nan):.2f} | "
                    f"{name} {value:.3g} | {cpu:.0f} |")
    return "\n".join(rows)
