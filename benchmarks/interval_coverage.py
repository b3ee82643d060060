"""How often the protocol analysis' two 95 % intervals cover the true mean of paired differences at few seeds.

Draws n normal differences (true mean 0) many times and counts the draws whose percentile-bootstrap interval
(`trl_isopo.real.analysis.bootstrap_ci`) and whose Student's t interval (`t_interval`) contain 0. This is why a claim
in `real_model_protocol.py analyze` is resolved only when the t interval clears its boundary too.

    python benchmarks/interval_coverage.py --draws 4000 --seeds 3,4,5,8
"""

from __future__ import annotations

import argparse

import numpy as np

from trl_isopo.real.analysis import bootstrap_ci, t_interval


def coverage(n: int, draws: int, n_boot: int, seed: int = 0) -> tuple[float, float]:
    """(bootstrap, t) fractions of `draws` samples of n standard-normal values whose interval contains 0."""
    rng = np.random.default_rng(seed)
    boot = t = 0
    for i in range(draws):
        d = rng.standard_normal(n).tolist()
        lo, hi = bootstrap_ci(d, n_boot, seed=i)
        boot += lo <= 0.0 <= hi
        lo, hi = t_interval(d)
        t += lo <= 0.0 <= hi
    return boot / draws, t / draws


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--draws", type=int, default=4000)
    ap.add_argument("--seeds", default="3,4,5,8", help="comma-separated numbers of paired seeds")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples per interval")
    args = ap.parse_args(argv)
    print("| paired seeds | bootstrap coverage | t coverage |\n|---|---|---|")
    for n in map(int, args.seeds.split(",")):
        b, t = coverage(n, args.draws, args.bootstrap)
        print(f"| {n} | {b:.3f} | {t:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
