"""One command on the GPU machine: install the wheelhouse offline beside the device's own packages, run the GPU check.

    python3 gpu/run.py              # on the device, from the repository root, with gpu/wheelhouse carried
    python3 gpu/run.py --smoke      # the same on a CPU machine, tiny (benchmarks/gpu_check.py --smoke)

1. `pip install --no-index --find-links W --no-deps --target SITE W/*.whl`: the wheels `gpu/wheelhouse.py` chose,
   into a fresh folder; nothing of the device's own packages (its torch included) is touched or uninstalled.
2. The environment the check will see (PYTHONPATH = repository root, SITE, then the device's site-packages):
   every requirement of trl-isopo, recursively, checked against the distributions found there (markers, version
   specifiers); unmet ones are recorded and printed, and the run goes on (what matters is what the tests say).
3. `benchmarks/gpu_check.py` with what is left of the total budget (`--budget`, default 480 s).

Files written to `$OUT` if set, else `--out` (default gpu/out): run.json (install, environment check, timings),
gpu_check.json (the check's report, rewritten after each part), gpu_check.log (its output). Exit status: the
check's, or 2 when the install failed.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OFFLINE = dict(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               TRL_EXPERIMENTAL_SILENCE="1", PYTHONUNBUFFERED="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
SHOWN = ("torch", "triton", "transformers", "trl", "datasets", "peft", "accelerate", "tokenizers", "huggingface-hub",
         "pyarrow", "numpy")


def unmet_requirements(root: str = "trl-isopo") -> tuple[list[dict], dict]:
    """Walk `root`'s requirements (Requires-Dist, markers for this interpreter, extras followed) through the installed
    distributions. Returns (unmet [{"requirement", "by", "found"}], {name: (version, location)} of SHOWN)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    dists = {}
    for d in importlib.metadata.distributions():  # sys.path order: the first one found is the one imported
        dists.setdefault(canonicalize_name(d.metadata["Name"] or ""), d)
    unmet, seen = [], set()
    queue = [(Requirement(root), "-")]
    while queue:
        req, by = queue.pop(0)
        name = canonicalize_name(req.name)
        dist = dists.get(name)
        if dist is None or not req.specifier.contains(dist.version, prereleases=True):
            unmet.append({"requirement": str(req), "by": by, "found": None if dist is None else dist.version})
            continue
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        for line in dist.requires or []:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in {""} | set(req.extras)):
                queue.append((sub, f"{name} {dist.version}"))
    shown = {}
    for n in SHOWN:
        d = dists.get(canonicalize_name(n))
        shown[n] = None if d is None else [d.version, str(d.locate_file(""))]
    return unmet, shown


def install(wheelhouse: str, site: str) -> dict:
    wheels = sorted(glob.glob(os.path.join(wheelhouse, "*.whl")))
    if not wheels:
        return {"status": "failed", "error": f"no wheels in {wheelhouse} (run gpu/wheelhouse.py; carry it)"}
    shutil.rmtree(site, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheelhouse, "--no-deps",
           "--no-compile", "--no-cache-dir", "--target", site, *wheels]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **OFFLINE))
    return {"status": "ok" if proc.returncode == 0 else "failed", "command": " ".join(cmd[1:8]) + " ... W/*.whl",
            "wheels": [os.path.basename(w) for w in wheels], "seconds": round(time.perf_counter() - t0, 1),
            "output": (proc.stdout + proc.stderr)[-3000:]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU rehearsal: gpu_check.py --smoke")
    p.add_argument("--wheelhouse", default=os.path.join(HERE, "wheelhouse"))
    p.add_argument("--site", default="/tmp/trl-isopo-site", help="install folder (emptied first)")
    p.add_argument("--out", default=os.environ.get("OUT") or os.path.join(HERE, "out"))
    p.add_argument("--budget", type=float, default=None, help="total seconds, install included (default 480; smoke "
                   "900)")
    p.add_argument("--no-install", action="store_true", help="reuse what --site holds")
    p.add_argument("--check-env", metavar="PATH", help=argparse.SUPPRESS)  # internal: step 2 in the final environment
    p.add_argument("check_args", nargs="*", help="passed on to gpu_check.py (after --)")
    args = p.parse_args(argv)
    if args.check_env:
        unmet, shown = unmet_requirements()
        with open(args.check_env, "w") as f:
            json.dump({"unmet": unmet, "packages": shown}, f)
        return 0
    t0 = time.monotonic()
    budget = args.budget or (900.0 if args.smoke else 480.0)
    os.makedirs(args.out, exist_ok=True)
    run = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "python": sys.executable,
           "smoke": args.smoke, "budget_s": budget, "site": args.site}
    run_json = os.path.join(args.out, "run.json")

    def save():
        with open(run_json, "w") as f:
            json.dump(run, f, indent=1)

    manifest = os.path.join(args.wheelhouse, "manifest.json")
    if os.path.exists(manifest):
        with open(manifest) as f:
            m = json.load(f)
        run["wheelhouse"] = {k: m.get(k) for k in ("created", "python_version", "total_mib", "trusted_unrecorded")}
    if not args.no_install:
        run["install"] = install(args.wheelhouse, args.site)
        save()
        print(f"install: {run['install']['status']} ({run['install'].get('seconds')} s, "
              f"{len(run['install'].get('wheels', []))} wheels)", flush=True)
        if run["install"]["status"] != "ok":
            print(run["install"].get("error") or run["install"]["output"], file=sys.stderr)
            return 2
    env = dict(os.environ, **OFFLINE)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (ROOT, args.site, os.environ.get("PYTHONPATH")) if x)
    check = os.path.join(args.out, ".env_check.json")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--check-env", check], env=env,
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode == 0:
        with open(check) as f:
            run["environment"] = json.load(f)
        os.remove(check)
        for u in run["environment"]["unmet"]:
            print(f"unmet: {u['requirement']} (needed by {u['by']}; found {u['found']})", flush=True)
        for n, v in run["environment"]["packages"].items():
            print(f"  {n}: {v[0] + ' at ' + v[1] if v else 'absent'}", flush=True)
    else:
        run["environment"] = {"error": proc.stderr[-3000:]}
    save()
    left = budget - (time.monotonic() - t0)
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "--out",
           os.path.join(args.out, "gpu_check.json"), "--budget", f"{left:.0f}", *(["--smoke"] if args.smoke else []),
           *args.check_args]
    run["check"] = {"command": " ".join(cmd[1:]), "budget_s": round(left)}
    save()
    with open(os.path.join(args.out, "gpu_check.log"), "w") as log:
        child = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in child.stdout:  # to the console and the log as it comes
            sys.stdout.write(line)
            sys.stdout.flush()
            log.write(line)
            log.flush()
        child.wait()
    run["check"].update(returncode=child.returncode, seconds=round(time.monotonic() - t0, 1))
    save()
    print(f"gpu/run.py: check exited {child.returncode} after {run['check']['seconds']} s; files in {args.out}")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
