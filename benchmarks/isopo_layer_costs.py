"""Per-layer costs behind `isopo_overhead.py`: alternated timing of callables, the per-layer breakdown (autograd's
weight gradient vs ISOPO's `layer_grads` on the same inputs, against the analytic floor) and a one-shape profile.

Imported by `isopo_overhead.py` (run from this folder, which is on `sys.path` when a benchmark script runs).
"""

from __future__ import annotations

import time

import torch


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved_times(runs: dict, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each run: one warm-up call each, then `repeats` rounds calling every run once in turn."""
    for f in runs.values():
        f()
    times = {k: [] for k in runs}
    for _ in range(repeats):
        for k, f in runs.items():
            sync()
            t0 = time.perf_counter()
            f()
            sync()
            times[k].append(time.perf_counter() - t0)
    return times


# Shape of the per-call fixed-cost probe: a layer so narrow that ISOPO's arithmetic is negligible, so its extra time
# over the plain GEMM is the per-call dispatch (a few dozen small tensor ops and their Python glue).
PROBE_WIDTH = 16

# The ISOPO variants the overhead benchmarks time, as ISOPOConfig fields; every other field keeps its default (c = 0
# unless the variant names it).
VARIANTS = {
    "p=-1": dict(isopo_p=-1.0),
    "p=-1 c=1": dict(isopo_p=-1.0, isopo_reg=1.0),
    "q=-1": dict(isopo_p=0.0, isopo_q=-1.0),
    "interacting": dict(isopo_interacting=True),
}


def variant_settings(variant: str):
    """What ISOPOTrainer runs for `variant`: `ISOPOConfig.isopo_settings()` of a config with the variant's fields (and
    TrainingArguments' default seed, as the benchmarks' trainers)."""
    import tempfile

    from trl_isopo import ISOPOConfig

    args = ISOPOConfig(output_dir=tempfile.gettempdir(), use_cpu=not torch.cuda.is_available(), report_to="none",
                       **VARIANTS[variant])
    return args.isopo_settings()


def _layer_runs(mask, d_in, d_out, bias, variant_settings, mb, dtype=torch.float32) -> dict:
    """{"plain": autograd's weight (+ bias) gradient, variant: ISOPO's `layer_grads`}, callables on the same random
    inputs (in the layer's `dtype`) and padding mask."""
    from trl_isopo.isopo.isopo_backward import ISOPOBackward

    B, L = mask.shape
    g = torch.Generator().manual_seed(d_in * 7 + d_out)
    x = torch.randn(B, L, d_in, generator=g).to(mask.device, dtype)
    gr = (torch.randn(B, L, d_out, generator=g) * mask.unsqueeze(-1)).to(mask.device, dtype)  # 0 at padding

    def plain():
        gw = gr.reshape(-1, gr.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        return gw, (gr.sum((0, 1)) if bias else None)

    runs = {"plain": plain}
    for v, st in variant_settings.items():
        ctx = ISOPOBackward(st)
        ctx.ema.ema = {f"layer/{k}": 1.0 for k in ("e", "f", "rho", "ntk")}  # steady state: EMA history exists

        def run(ctx=ctx):
            out = ctx.layer_grads("layer", x, gr, mb, bias)
            # Scratch storage (V, Fisher sample rows) stays allocated, as from one covered layer to the next in a
            # backward pass: the trainer frees it once per micro-batch, not per layer.
            ctx.clear(keep_scratch=True)
            # The per-step reductions are timed end to end (`end_step_ms`); here only drop their inputs.
            ctx.records.clear()
            ctx.lambdas.clear()
            ctx.ema.discard_step()
            return out

        runs[v] = run
    return runs


def _layer_times(mask, d_in, d_out, bias, variant_settings, repeats, mb, dtype=torch.float32):
    """ms per call (list over `repeats` alternated rounds) of each of `_layer_runs`."""
    runs = _layer_runs(mask, d_in, d_out, bias, variant_settings, mb, dtype)
    return {k: [1e3 * t for t in ts] for k, ts in interleaved_times(runs, repeats).items()}


def profile_layer(mask, d_in, d_out, variant_settings, rows: int = 15) -> None:
    """One layer shape, each variant: tensor ops dispatched per `layer_grads` call, and torch's profiler table (self
    CPU time per op and input shape, 20 calls after a warm-up): where a layer call's time goes."""
    from torch.profiler import ProfilerActivity, profile
    from torch.utils._python_dispatch import TorchDispatchMode

    from trl_isopo.layerwise.micro_batch import MicroBatch

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    mb = MicroBatch(mask=mask.bool(), advantages=torch.randn(mask.shape[0], generator=torch.Generator().manual_seed(1)))
    for name, run in _layer_runs(mask, d_in, d_out, False, variant_settings, mb).items():
        for _ in range(3):
            run()
        with CountOps() as ops:
            run()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(20):
                run()
        print(f"\n# {d_in}->{d_out} {name}: {ops.n} tensor ops per call; profile of 20 calls")
        print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=rows,
                                                                 max_name_column_width=28, max_shapes_column_width=60))


def layer_breakdown(trainer, mask, variant_settings, repeats, step_ms, end_step_ms=None):
    """Per covered-layer shape: autograd's weight (+ bias) gradient vs ISOPO's `layer_grads` on the same random
    inputs and padding mask, alternated `repeats` times (sub-second runs, so minima are steady on a noisy machine).

    Returns table rows: per shape and variant, and per variant the sums over all covered layers (extra ms, floor ms:
    the floor of a layer is its route's extra MACs at the rate (MACs / ms) of that layer's own weight-gradient GEMM).
    The implied step ratio adds `end_step_ms[variant]`, the measured once-per-step reductions (EMA fold, metrics).
    A last column prices the per-call fixed cost, measured on a PROBE_WIDTH-wide layer, times the number of calls.
    Each layer runs alone here: the Fisher input products that the layers reading one input share in the step
    (q/k/v, gate/up: `statistics.gram_input_statistics`) are paid by each, so the sums bound the step's from above.
    """
    end_step_ms = end_step_ms or {}
    from collections import Counter

    from trl_isopo.layerwise.micro_batch import MicroBatch
    from trl_isopo.layerwise.costs import route_costs, statistics_cost

    covered = set(trainer.isopo_coverage["covered"])
    # The layer's dtype too: bf16 weights see bf16 inputs and output gradients (LoRA adapters stay float32).
    shapes = Counter((m.in_features, m.out_features, m.bias is not None, m.weight.dtype)
                     for n, m in trainer.model.named_modules() if n in covered)
    calls = sum(shapes.values())
    B, L = mask.shape
    mb = MicroBatch(mask=mask.bool(), advantages=torch.randn(B, generator=torch.Generator().manual_seed(1)))
    rows, totals = [], {v: [0.0, 0.0] for v in variant_settings}
    for (d_in, d_out, bias, dtype), count in sorted(shapes.items(), key=lambda kv: kv[0][:3]):
        times = _layer_times(mask, d_in, d_out, bias, variant_settings, repeats, mb, dtype)
        base = min(times["plain"])
        rate = B * L * d_in * d_out / base
        for v, st in variant_settings.items():
            S = min(st.fisher_tokens or B * L, int(mask.sum())) if st.needs_fisher else 0
            c = route_costs(B, L, d_in, d_out, S, st.needs_fisher, st.interacting, st.budget_bytes,
                            euclidean=st.needs_euclidean, stat_cost=statistics_cost(dtype, torch.device("cpu")))
            floor_ms = min(c.gram, c.mat) / rate
            extra = min(times[v]) - base
            totals[v][0] += count * extra
            totals[v][1] += count * floor_ms
            rows.append(f"| {d_in}->{d_out}{'+b' if bias else ''} x{count} | {v} ({c.best}) | {base:.1f} | {min(times[v]):.1f} | "
                        f"{extra:.1f} | {floor_ms:.1f} | {extra / floor_ms:.2f} | |")
    probe = _layer_times(mask, PROBE_WIDTH, PROBE_WIDTH, False, variant_settings, repeats, mb)
    for v, (extra, floor_ms) in totals.items():
        extra += end_step_ms.get(v, 0.0)
        fixed = max(0.0, min(probe[v]) - min(probe["plain"]))
        rows.append(f"| all covered layers | {v} | | | {extra:.0f} | {floor_ms:.0f} | {extra / floor_ms:.2f} | "
                    f"{fixed:.2f} ms x {calls} = {fixed * calls:.0f} ms; extra / (floor + that) "
                    f"{extra / (floor_ms + fixed * calls):.2f} | implied step ratio {1 + extra / step_ms:.3f} (floor "
                    f"{1 + floor_ms / step_ms:.3f}; includes {end_step_ms.get(v, 0.0):.1f} ms end of step) |")
    return rows
