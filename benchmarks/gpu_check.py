"""The prepared GPU check: one run on one CUDA GPU (H200 class), about 8 minutes in all, no Hub needed.

Parts, in this order, each a subprocess with its own time limit, all inside one total budget (`--budget`, default
480 s): a part starts only while at least MIN_PART_S of the budget is left and its limit is cut to what is left;
parts that find the budget spent are recorded as skipped. The JSON report (`--out`) is rewritten after every part, so
a run killed from outside still leaves every finished part. A part that runs past its limit is killed with its
process group and recorded with status "timeout" and the output it had printed.

Tests on the device (`TRL_ISOPO_TEST_DEVICE=cuda`: the tests' trainers, batches and tensors live on the GPU), one
pytest run per part, each test's outcome read from pytest's JUnit XML:
  oracle      tests/test_isopo_oracle.py      float64 oracle, every route and setting
  bf16        tests/test_isopo_bf16.py        half operands through the GPU's float32-output GEMMs
  lm_head     tests/test_isopo_head.py        the ISOPO head through TRL's Triton fold, full and compact row
              tests/test_isopo_head_compact.py  layouts (the CPU-only trainer test deselected)
  fused_head  tests/test_isopo_fused_head.py  the row-scaled head kernel against TRL's (Triton fold on CUDA)
  syncs       tests/test_isopo_syncs.py       host syncs; on CUDA a layer under set_sync_debug_mode("error")
Benchmarks (bf16, random weights, Qwen3-0.6B's dimensions):
  head        benchmarks/isopo_head_overhead.py: the LM head alone (151,936 x 1024), TRL's kernel vs the
              advantage-weighted and ISOPO heads
  overhead    benchmarks/isopo_overhead.py --tpo: GRPO vs ISOPO (p=-1, q=-1, interacting) vs TPO policy-loss
              forward + backward on 8 x 512 tokens, LoRA r=16 then full weights (one subprocess per shape)

    python benchmarks/gpu_check.py --out gpu_check.json           # on the GPU machine (gpu/run.py calls it)
    python benchmarks/gpu_check.py --smoke --out /tmp/smoke.json   # CPU, tiny shapes, ~1-2 minutes (tested)

Exit status 0 when every planned part ran and passed, 1 otherwise (the report says which and why).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MIN_PART_S = 20  # a part needs at least this much budget left to start
PER_TEST_TIMEOUT_S = 90  # with pytest-timeout installed: one hung test fails alone instead of eating its part
SMOKE_ORACLE = "tests/test_isopo_oracle.py::test_isopo_matches_oracle[p=-1,c=0-all-auto]"
PACKAGES = ("torch", "triton", "transformers", "trl", "datasets", "peft", "accelerate", "tokenizers",
            "huggingface-hub", "trl-isopo")


def plan(smoke: bool) -> list[tuple[str, str, list, int]]:
    """(name, kind, arguments, time limit s) of every part, in running order. Limits are budgets for an H200: the
    tests take ~30 s on this project's CPU; on a GPU their tiny kernels are launch-bound and Triton compiles once."""
    if smoke:
        return [("oracle", "pytest", [SMOKE_ORACLE], 180),
                ("head", "head", ["--hidden", "32", "--vocab", "512", "--batch", "4", "--prompt", "8",
                                  "--completion", "8", "--repeats", "1"], 180),
                ("overhead", "overhead", ["small"], 300)]
    return [("oracle", "pytest", ["tests/test_isopo_oracle.py"], 75),
            ("bf16", "pytest", ["tests/test_isopo_bf16.py"], 100),
            ("lm_head", "pytest", ["tests/test_isopo_head.py", "tests/test_isopo_head_compact.py", "-k",
                                   "not train_and_resume"], 60),
            ("fused_head", "pytest", ["tests/test_isopo_fused_head.py"], 60),
            ("syncs", "pytest", ["tests/test_isopo_syncs.py"], 45),
            ("head", "head", ["--hidden", "1024", "--vocab", "151936", "--prompt", "128", "--completion", "384"],
             60),
            ("overhead", "overhead", ["qwen3-0.6b-lora", "qwen3-0.6b-full"], 130)]  # limit per shape


def environment() -> dict:
    import torch

    info = {"python": sys.version.split()[0], "executable": sys.executable, "cuda": torch.cuda.is_available(),
            "versions": {}, "paths": {}}
    for name in PACKAGES:
        try:
            info["versions"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info["versions"][name] = None
    for mod in ("torch", "transformers", "trl", "datasets", "trl_isopo"):  # which copy is imported (wheelhouse?)
        spec = importlib.util.find_spec(mod)
        info["paths"][mod] = os.path.dirname(spec.origin) if spec and spec.origin else None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported(),
                    cuda_runtime=torch.version.cuda)
    return info


def run_limited(cmd: list[str], env: dict, limit: float) -> tuple[dict, str, str]:
    """Run `cmd` in ROOT for at most `limit` seconds; on timeout kill its whole process group. (record, out, err)."""
    t0 = time.perf_counter()
    rec = {"command": " ".join(cmd[1:]), "limit_s": round(limit, 1)}
    # The working tree's trl_isopo first, also for `python benchmarks/<script>.py` (whose sys.path[0] is benchmarks/)
    env = dict(env, PYTHONPATH=os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p))
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    except OSError as e:
        return {**rec, "status": "error", "returncode": None, "error": repr(e), "seconds": 0.0}, "", ""
    try:
        out, err = proc.communicate(timeout=limit)
        status = "ok" if proc.returncode == 0 else "failed"
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        status = "timeout"
    except BaseException:  # interrupted (SIGTERM, Ctrl-C): the child runs in its own session, so end it here
        _kill_group(proc)
        raise
    return {**rec, "status": status, "returncode": proc.returncode,
            "seconds": round(time.perf_counter() - t0, 1)}, out or "", err or ""


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _terminate(signum, frame):  # SIGTERM -> SystemExit: the finally blocks kill the running part and mark the report
    raise SystemExit(128 + signum)


def junit_summary(path: str) -> dict:
    """Counts, failed tests (id and the first 400 characters of the message) and the 5 slowest tests."""
    if not os.path.exists(path):
        return {}
    cases = ET.parse(path).getroot().iter("testcase")
    res = {"passed": 0, "failed": 0, "skipped": 0, "failures": [], "slowest": []}
    timed = []
    for c in cases:
        name = f"{c.get('classname', '')}::{c.get('name')}"
        timed.append((float(c.get("time", 0.0)), name))
        bad = c.find("failure") if c.find("failure") is not None else c.find("error")
        if bad is not None:
            res["failed"] += 1
            res["failures"].append({"test": name, "message": (bad.get("message") or bad.text or "")[:400]})
        elif c.find("skipped") is not None:
            res["skipped"] += 1
        else:
            res["passed"] += 1
    res["slowest"] = [{"test": n, "s": round(t, 2)} for t, n in sorted(timed, reverse=True)[:5]]
    return res


def run_pytest(args: list[str], device: str, limit: float, scratch: str) -> dict:
    xml = os.path.join(scratch, "junit.xml")
    if os.path.exists(xml):
        os.remove(xml)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", f"--junitxml={xml}", *args]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd.append(f"--timeout={PER_TEST_TIMEOUT_S}")
    rec, out, err = run_limited(cmd, dict(os.environ, TRL_ISOPO_TEST_DEVICE=device), limit)
    lines = out.strip().splitlines()
    rec.update(device=device, summary=lines[-1] if lines else "", tests=junit_summary(xml),
               tail=out[-3000:] + err[-2000:])
    return rec


def run_benchmark(script: str, args: list[str], key: str, limit: float, scratch: str) -> dict:
    """benchmarks/<script> with `args` and `--json`: its printed table (also when killed), timing, the JSON's `key`."""
    out_json = os.path.join(scratch, f"{key}.json")
    if os.path.exists(out_json):
        os.remove(out_json)
    rec, out, err = run_limited([sys.executable, os.path.join(HERE, script), *args, "--json", out_json],
                                dict(os.environ), limit)
    rec.update(table=[line for line in out.splitlines() if line.startswith(("|", "#"))], tail=err[-2000:])
    if os.path.exists(out_json):
        with open(out_json) as f:
            rec[key] = json.load(f)[key]
    return rec


class Report:
    """The JSON report, rewritten (atomically) after every change."""

    def __init__(self, path: str, data: dict):
        self.path, self.data = path, data
        self.write()

    def write(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)

    def __setitem__(self, key, value):
        self.data[key] = value
        self.write()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--smoke", action="store_true", help="CPU-sized: one oracle case, tiny shapes")
    p.add_argument("--budget", type=float, default=None, help="total seconds for all parts (default 480; smoke 900)")
    p.add_argument("--parts", default=None, help="comma-separated subset of the parts (default: all, in order)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved timing rounds (default 5; smoke 1)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 512; smoke 64)")
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch (one group of 8)")
    args = p.parse_args(argv)
    t_start = time.monotonic()
    signal.signal(signal.SIGTERM, _terminate)
    budget = args.budget or (900.0 if args.smoke else 480.0)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.smoke and device != "cuda":
        p.error("no CUDA device: this is the GPU check (use --smoke for the CPU version)")
    parts = plan(args.smoke)
    if args.parts:
        wanted = args.parts.split(",")
        unknown = set(wanted) - {name for name, *_ in parts}
        if unknown:
            p.error(f"unknown parts {sorted(unknown)}; parts: {[name for name, *_ in parts]}")
        parts = [part for part in parts if part[0] in wanted]
    repeats = args.repeats or (1 if args.smoke else 5)
    seq = args.seq or (64 if args.smoke else 512)
    vocab = 512 if args.smoke else 151936
    report = Report(args.out, {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "smoke": args.smoke,
                               "budget_s": budget, "status": "running", "order": [name for name, *_ in parts]})
    sys.path.insert(0, ROOT)  # as the parts see it (run_limited)
    report["environment"] = environment()
    print(json.dumps(report.data["environment"]), flush=True)
    scratch = tempfile.mkdtemp(prefix="gpu_check_")
    failed, finished = False, False
    try:
        for name, kind, part_args, limit in parts:
            left = budget - (time.monotonic() - t_start)
            if left < MIN_PART_S:
                report[name] = {"status": "skipped", "reason": f"budget spent ({left:.0f} s of {budget:.0f} left)"}
                print(f"{name}: skipped, budget spent", flush=True)
                failed = True
                continue
            if kind == "pytest":
                rec = run_pytest(part_args, device, min(limit, left), scratch)
                msg = f"{rec['summary']} ({rec['seconds']} s, {rec['status']})"
            elif kind == "head":
                rec = run_benchmark("isopo_head_overhead.py", ["--dtype", "bfloat16", *part_args], "results",
                                    min(limit, left), scratch)
                msg = "\n".join(rec["table"]) + f"\n({rec['seconds']} s, {rec['status']})"
            else:  # one subprocess per shape; rows merged
                rec = {"status": "ok", "returncode": 0, "runs": {}, "rows": []}
                for shape in part_args:
                    left = budget - (time.monotonic() - t_start)
                    if left < MIN_PART_S:
                        rec["runs"][shape] = {"status": "skipped", "reason": "budget spent"}
                        rec["status"], rec["returncode"] = "skipped", None
                        continue
                    bench = ["--shapes", shape, "--vocab", str(vocab), "--batch", str(args.batch), "--seq", str(seq),
                             "--repeats", str(repeats), "--layer-repeats", "0", "--dtype", "bfloat16", "--tpo",
                             "--variants", "p=-1,q=-1,interacting"]
                    run = run_benchmark("isopo_overhead.py", bench, "rows", min(limit, left), scratch)
                    rec["runs"][shape] = run
                    rec["rows"] += run.pop("rows", [])
                    if run["status"] != "ok" and rec["status"] == "ok":
                        rec["status"], rec["returncode"] = run["status"], run["returncode"]
                    report[name] = rec
                    print("\n".join(run["table"]) + f"\n({shape}: {run['seconds']} s, {run['status']})", flush=True)
                msg = f"{len(rec['rows'])} rows"
            report[name] = rec
            failed = failed or rec["status"] != "ok"
            print(f"{name}: {msg}", flush=True)
        finished = True
    finally:  # also on an exception or a signal turned into one: the report says the run did not finish
        shutil.rmtree(scratch, ignore_errors=True)
        report.data["seconds"] = round(time.monotonic() - t_start, 1)
        report["status"] = "interrupted" if not finished else "failed" if failed else "passed"
    print(f"wrote {args.out}: {report.data['status']} in {report.data['seconds']} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
