"""Peak memory of the real-model job per method, as ratios to GRPO's on the same batch, and the cost of one more
micro-batch row: how to size `per_device_train_batch_size` (the job's `--micro-batch`).

Every configuration is one fresh process of `benchmarks/memory_timeline.py` running `trl-isopo real` for `--steps`
optimizer steps (same seed, prompts and rollout shape: 4 prompts x 8 completions, 24 completion tokens; the held-out
evaluation on `--eval-size` questions), so each peak is that process's own `ru_maxrss`. Per method and weights (LoRA
r = 16 or full) it prints the peak resident memory and the live-heap peak (glibc's bytes in use, without the free
memory malloc holds) at each micro-batch size, their ratios to GRPO's at the same size, and the slope between the
smallest and the largest size: GiB per row at the job's row length (printed: median padded prompt + completion
tokens). On a GPU it adds the CUDA peak (`torch.cuda.max_memory_allocated`).

Accumulation PROMA splits each optimizer step into its own 4 micro-batches (its update depends on the split): its
micro-batch of N rows is measured on a step of 4N rows (fewer prompts per rollout at N = 4), the others on the
job's 32-row step.

    python benchmarks/memory_benchmark.py                                   # LoRA and full, micro-batches 4 and 8
    python benchmarks/memory_benchmark.py --methods grpo,isopo --weights lora --micro-batches 4,8,16 --malloc system
    python benchmarks/memory_benchmark.py --no-activation-checkpointing     # what each row costs without recompute
    python benchmarks/memory_benchmark.py --steps 1 --eval-size 4 --methods grpo --weights lora --micro-batches 2,4
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 1024**3
GENERATIONS = 8  # completions per prompt (the job's default)


def job_args(method: str, full: bool, micro_batch: int, args) -> list[str]:
    """`trl-isopo real` arguments for one configuration (`None` where the method cannot take `micro_batch`)."""
    from trl_isopo.methods import get_method

    real = ["--method", method, "--steps", str(args.steps), "--eval-size", str(args.eval_size), "--eval-every", "0",
            "--malloc", args.malloc, "--threads", str(args.threads), "--seed", "0"]
    if full:
        real.append("--full")
    if not args.checkpointing:
        real.append("--no-activation-checkpointing")
    accumulation = get_method(method).fields.get("gradient_accumulation_steps")
    if accumulation:  # its own split: a step of `accumulation` micro-batches of `micro_batch` rows
        rows = micro_batch * accumulation
        if rows % GENERATIONS:
            return None
        return [*real, "--prompts", str(rows // GENERATIONS)]
    return [*real, "--micro-batch", str(micro_batch)]


def measure(real_args: list[str], workdir: str) -> dict:
    """One fresh process of memory_timeline.py; its JSON result."""
    out = os.path.join(workdir, "result.json")
    cmd = [sys.executable, os.path.join(HERE, "memory_timeline.py"), "--json", out, "--", *real_args,
           "--output-dir", os.path.join(workdir, "real")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=workdir)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    with open(out) as f:
        result = json.load(f)
    phases = result["phases"].values()
    tokens = sorted(result["row_tokens"])
    return {"peak_rss": result["peak_rss"], "peak_heap": max(p["peak_heap"] for p in phases),
            "cuda_peak": max(p["cuda_peak"] for p in phases) if result["cuda"] else None,
            "row_tokens": tokens[len(tokens) // 2] if tokens else None, "wall_seconds": result["wall_seconds"],
            "args": real_args}


def report(results: dict, methods: list[str], weights: list[str], sizes: list[int]) -> str:
    """The table: per weights and method, peaks at each size, ratios to GRPO, GiB per row."""
    cuda = any(r["cuda_peak"] is not None for r in results.values())
    kinds = [("peak_rss", "RSS")] + [("peak_heap", "live heap")] + ([("cuda_peak", "CUDA")] if cuda else [])
    lo, hi = min(sizes), max(sizes)
    lines = []
    for w in weights:
        tokens = {r["row_tokens"] for k, r in results.items() if k.startswith(f"{w}|") and r["row_tokens"]}
        lines.append(f"\n{w}: peak GiB (ratio to GRPO) at micro-batches of {', '.join(map(str, sizes))} rows; "
                     f"GiB per row from {lo} to {hi} rows (rows of {'/'.join(map(str, sorted(tokens)))} tokens)")
        for key, label in kinds:
            head = f"{'method':<14}" + "".join(f" {label + ' @' + str(n):>20}" for n in sizes) + f" {'GiB/row':>8}"
            lines.append(head)
            for m in methods:
                row = f"{m:<14}"
                for n in sizes:
                    r, g = results.get(f"{w}|{m}|{n}"), results.get(f"{w}|grpo|{n}")
                    if r is None or r[key] is None:
                        row += f" {'-':>20}"
                        continue
                    ratio = f"({r[key] / g[key]:.2f}x)" if g and g[key] else ""
                    row += f" {r[key] / GIB:>12.2f} {ratio:>7}"
                a, b = results.get(f"{w}|{m}|{lo}"), results.get(f"{w}|{m}|{hi}")
                slope = (b[key] - a[key]) / (hi - lo) / GIB if a and b and hi > lo and a[key] is not None else None
                row += f" {slope:>8.3f}" if slope is not None else f" {'-':>8}"
                lines.append(row)
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="grpo,isopo,tpo,proma", help="names of trl_isopo.methods (grpo is added)")
    p.add_argument("--weights", default="lora,full", help="lora, full or both")
    p.add_argument("--micro-batches", default="4,8", help="rows per micro-batch to measure")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps per run")
    p.add_argument("--eval-size", type=int, default=16, help="held-out questions per evaluation")
    p.add_argument("--malloc", choices=("cached", "system"), default="cached", help="the job's --malloc")
    p.add_argument("--activation-checkpointing", dest="checkpointing", action=argparse.BooleanOptionalAction,
                   default=True, help="the job's activation checkpointing (its default: on)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", help="write the settings and every configuration's numbers here (JSON)")
    args = p.parse_args(argv)
    methods = ["grpo"] + [m for m in args.methods.split(",") if m and m != "grpo"]
    weights = [w for w in args.weights.split(",") if w]
    sizes = sorted(int(n) for n in args.micro_batches.split(","))
    results = {}
    for w in weights:
        for n in sizes:
            for m in methods:
                real = job_args(m, w == "full", n, args)
                if real is None:
                    print(f"{w} {m} @{n}: skipped ({n} rows x 4 micro-batches is not whole prompts)", flush=True)
                    continue
                with tempfile.TemporaryDirectory() as workdir:
                    results[f"{w}|{m}|{n}"] = r = measure(real, workdir)
                print(f"{w} {m} @{n}: peak RSS {r['peak_rss'] / GIB:.2f} GiB, live heap {r['peak_heap'] / GIB:.2f} "
                      f"GiB, {r['wall_seconds']:.0f} s", flush=True)
    print(report(results, methods, weights, sizes))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "settings": vars(args), "results": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
