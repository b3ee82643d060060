"""The prepared GPU check: one short run on one CUDA GPU (H200 class, ~8 minutes), no Hub needed.

1. ISOPO's float64 oracle tests and its bf16 tests on the GPU (`TRL_ISOPO_TEST_DEVICE=cuda`: the tests' trainers
   and batches live on the device).
2. Policy-loss forward + backward of GRPO vs ISOPO (p=-1, q=-1, interacting) vs TPO on the same batch, in bf16, on
   Qwen3-0.6B's dimensions with random weights (28 layers, hidden 1024, MLP 3072, vocabulary 151,936), LoRA r=16 and
   full weights: `benchmarks/isopo_overhead.py --dtype bfloat16 --tpo` (ratios of minima, median ratios, peak
   memory, GEMM MACs counted against the model).
3. The LM head alone at Qwen3-0.6B's shape (151,936 x 1024), bf16: TRL's fused kernel vs the advantage-weighted and
   the ISOPO-transformed head (`benchmarks/isopo_head_overhead.py`).

Prints a summary and writes everything (with the raw times and the pytest output tail) as JSON:

    python benchmarks/gpu_check.py --out gpu_check.json            # on the GPU machine
    python benchmarks/gpu_check.py --smoke --out /tmp/smoke.json    # CPU, small shapes, about a minute (tested)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ORACLE_TESTS = ["tests/test_isopo_oracle.py", "tests/test_isopo_bf16.py", "tests/test_isopo_head.py"]


def environment() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.cuda.is_available(), "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gib=round(props.total_memory / 2**30, 1), bf16=torch.cuda.is_bf16_supported())
    return info


def run_oracle(device: str, smoke: bool, timeout: int) -> dict:
    tests = [t for t in ORACLE_TESTS if os.path.exists(os.path.join(ROOT, t))]
    if smoke:  # one oracle case
        tests = ["tests/test_isopo_oracle.py::test_isopo_matches_oracle[p=-1,c=0-all-auto]"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    env = dict(os.environ, TRL_ISOPO_TEST_DEVICE=device)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    summary = (proc.stdout.strip().splitlines() or [""])[-1]
    return {"command": " ".join(cmd[1:]), "device": device, "returncode": proc.returncode, "summary": summary,
            "seconds": round(time.perf_counter() - t0, 1), "tail": proc.stdout[-3000:] + proc.stderr[-2000:]}


def run_benchmark(script: str, args: list[str], key: str, timeout: int) -> dict:
    """Run benchmarks/<script> with `args` and `--json`; its printed table, timing and the JSON's `key` entry."""
    out = os.path.join(ROOT, f".gpu_check_{key}_{os.getpid()}.json")
    cmd = [sys.executable, os.path.join(HERE, script), *args, "--json", out]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    result = {"command": " ".join(cmd[1:]), "returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
              "table": [line for line in proc.stdout.splitlines() if line.startswith(("|", "#"))],
              "tail": proc.stderr[-2000:]}
    if os.path.exists(out):
        with open(out) as f:
            result[key] = json.load(f)[key]
        os.remove(out)
    return result


def run_overhead(shapes: str, vocab: int, batch: int, seq: int, repeats: int, timeout: int) -> dict:
    args = ["--shapes", shapes, "--vocab", str(vocab), "--batch", str(batch), "--seq", str(seq), "--repeats",
            str(repeats), "--layer-repeats", "0", "--dtype", "bfloat16", "--tpo"]
    return run_benchmark("isopo_overhead.py", args, "rows", timeout)


def run_head(smoke: bool, timeout: int) -> dict:
    size = (["--hidden", "32", "--vocab", "512", "--batch", "4", "--prompt", "8", "--completion", "8", "--repeats", "1"]
            if smoke else ["--hidden", "1024", "--vocab", "151936", "--prompt", "128", "--completion", "384"])
    return run_benchmark("isopo_head_overhead.py", ["--dtype", "bfloat16", *size], "results", timeout)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--smoke", action="store_true", help="CPU-sized: small shapes, one oracle case")
    p.add_argument("--repeats", type=int, default=None, help="interleaved timing rounds (default 5; smoke 1)")
    p.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 512; smoke 64)")
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch (one group of 8)")
    p.add_argument("--skip-oracle", action="store_true")
    args = p.parse_args(argv)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if not args.smoke and device != "cuda":
        p.error("no CUDA device: this is the GPU check (use --smoke for the CPU version)")
    shapes = "small" if args.smoke else "qwen3-0.6b-lora,qwen3-0.6b-full"
    vocab = 512 if args.smoke else 151936
    repeats = args.repeats or (1 if args.smoke else 5)
    seq = args.seq or (64 if args.smoke else 512)
    report = {"environment": environment(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    print(json.dumps(report["environment"]), flush=True)
    if not args.skip_oracle:
        report["oracle"] = run_oracle(device, args.smoke, timeout=300)
        print(f"oracle tests on {device}: {report['oracle']['summary']} ({report['oracle']['seconds']} s)", flush=True)
    report["overhead"] = run_overhead(shapes, vocab, args.batch, seq, repeats, timeout=420)
    print("\n".join(report["overhead"]["table"]), flush=True)
    for row in report["overhead"].get("rows", []):
        print(f"{row['shape']:>16} {row['variant']:>12} {row['dtype']}: ratio of minima {row['ratio_of_minima']:.3f}, "
              f"median ratio {row['median_ratio']:.3f}")
    report["head"] = run_head(args.smoke, timeout=180)
    print("\n".join(report["head"]["table"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")
    failed = report.get("oracle", {}).get("returncode", 0) != 0 or report["overhead"]["returncode"] != 0
    failed = failed or report["head"]["returncode"] != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
