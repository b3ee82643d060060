"""PROMA overhead vs plain GRPO: the policy-loss forward+backward of one micro-batch, same model and batch.

For each shape it builds one GRPOTrainer and one PROMATrainer per variant (accumulation; intra with k =
`--intra-dim`) on identical model copies (helpers of benchmarks/isopo_overhead.py) and times `compute_loss(...)
.backward()` of each, interleaved over `--repeats` rounds in one process. PROMA runs at micro-batch index 1 of its
optimizer step, with a running gradient S from a warm-up call, so accumulation projects (index 0 has S = 0 and costs
no more than GRPO). Printed: the median of the per-round time ratios over GRPO, the ratio of the fastest runs (on a
shared machine contention only slows a run down) and the median milliseconds. On CPU glibc keeps freed memory for
reuse (`--malloc cached`, the default; `--malloc system` for its stock settings).

A last line per shape gives the floor of the intra variant: the time its range finders alone take inside the same
steps (the (2q+1) sketch products over every covered layer's inputs and output gradients, and their QRs), as a
fraction of GRPO's step. No implementation of the reference's algorithm with that k and q gets below it.

    python benchmarks/proma_overhead.py                                # shapes lora896, full896
    python benchmarks/proma_overhead.py --shapes full896 --seq 256 --repeats 9 --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from isopo_layer_costs import interleaved_times, sync  # noqa: E402  (same folder)
from isopo_overhead import SHAPES, _trainer, build, make_batch  # noqa: E402

VARIANTS = {"accumulation": dict(proma_mode="accumulation"), "intra": dict(proma_mode="intra")}
TARGETS = {"full": 1.15, "lora": 1.05}  # the aimed-for ratio over GRPO (docs/proma.md, "Overhead")


def grpo_run(trainer, batch):
    def run():
        trainer.model.zero_grad(set_to_none=True)
        trainer.compute_loss(trainer.model, batch).backward()
        sync()

    return run


def proma_run(trainer, batch):
    """Loss forward + backward as micro-batch 1 of a 2-micro-batch step (S from the warm-up call)."""

    def run():
        trainer.model.zero_grad(set_to_none=True)
        trainer._proma_index = 1
        with trainer.backward_window():
            trainer.compute_loss(trainer.model, batch).backward()
        sync()

    return run


def range_finder_ms(trainer, batch, repeats: int) -> float:
    """Median over `repeats` intra steps of the milliseconds spent in `intra.range_basis` (the sketch products)."""
    from trl_isopo.proma import intra

    original, spent = intra.range_basis, []

    def timed(*a, **k):
        sync()
        t0 = time.perf_counter()
        out = original(*a, **k)
        sync()
        spent[-1] += time.perf_counter() - t0
        return out

    intra.range_basis = timed
    try:
        step = proma_run(trainer, batch)
        for _ in range(repeats):
            spent.append(0.0)
            step()
    finally:
        intra.range_basis = original
    return 1e3 * statistics.median(spent)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="lora896,full896", help=f"comma-separated, from {sorted(SHAPES)}")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256, help="prompt + completion tokens per sequence")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--intra-dim", type=int, default=30)
    ap.add_argument("--malloc", default="cached", choices=["cached", "system"],
                    help="CPU: `cached` keeps freed memory in the process (trl_isopo.cpu_alloc), as isopo_overhead.py "
                         "does, so that no run pays for faulting its large temporaries in again; `system`: glibc's")
    args = ap.parse_args(argv)
    if args.malloc == "cached":
        from trl_isopo.cpu_alloc import keep_freed_memory

        keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    from trl import GRPOConfig, GRPOTrainer

    from trl_isopo.proma import PROMAConfig, PROMATrainer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device={device} threads={torch.get_num_threads()} batch={args.batch} seq={args.seq} vocab={args.vocab} "
          f"repeats={args.repeats} intra_dim={args.intra_dim} torch={torch.__version__} malloc={args.malloc}")
    for shape in args.shapes.split(","):
        model, tokenizer, cfg, lora_r = build(shape, args.vocab)
        out = tempfile.mkdtemp()
        runs = {"grpo": None}
        batch = make_batch(args.batch, args.seq, len(tokenizer), device)
        grpo = _trainer(GRPOTrainer, GRPOConfig, model, tokenizer, out + "/g", loss_type="bnpo")
        runs["grpo"] = grpo_run(grpo, batch)
        for name, knobs in VARIANTS.items():
            if name == "intra":
                knobs = dict(knobs, proma_intra_dim=args.intra_dim)
            trainer = _trainer(PROMATrainer, PROMAConfig, model, tokenizer, f"{out}/{name}", loss_type="bnpo",
                               gradient_accumulation_steps=2, proma_other_params="surrogate", **knobs)
            trainer.current_gradient_accumulation_steps = 2
            runs[f"proma-{name}"] = proma_run(trainer, batch)
            if name == "intra":
                intra_trainer = trainer
        times = interleaved_times(runs, args.repeats)
        kind = "lora" if lora_r else "full"
        base = times["grpo"]
        print(f"\n{shape} ({kind}, hidden {cfg.hidden_size}, MLP {cfg.intermediate_size}, {cfg.num_hidden_layers} "
              f"layers{f', LoRA r={lora_r}' if lora_r else ''}): target <= {TARGETS[kind]:.2f}x GRPO")
        print(f"  {'run':<20}{'median ms':>11}{'median ratio':>14}{'min ratio':>11}")
        for name, t in times.items():
            ratio = statistics.median(a / b for a, b in zip(t, base))
            print(f"  {name:<20}{1e3 * statistics.median(t):>11.1f}{ratio:>14.3f}{min(t) / min(base):>11.3f}")
        floor = range_finder_ms(intra_trainer, batch, args.repeats)
        print(f"  intra floor: its range finders alone take {floor:.1f} ms per step = "
              f"{floor / (1e3 * statistics.median(base)):.3f} of GRPO's median step (k = {args.intra_dim}, q = "
              f"{intra_trainer.args.proma_intra_power_iters}; LoRA layers use k = min(k, r))")


if __name__ == "__main__":
    main()
