"""How ISOPO's and PROMA's extra cost grows with sequence length and width: the cost models, and measured points.

1. **Model** (no timing): the extra multiply-accumulates of every covered linear layer of one micro-batch (B
   sequences of L tokens), from the cost models the package runs on (`layerwise.costs.route_costs` for ISOPO with
   the route "auto" picks; `proma.projection.proma_extra_macs` for PROMA's accumulation at a micro-batch with a
   running gradient, and for intra), over GRPO's forward + backward MACs at the same shapes: the linear layers
   (3 GEMMs each with full weights; with LoRA the frozen base 2 and the adapters 3), causal attention
   (3 B H L^2 d_head) and the LM head over every token. Every MAC is priced alike, as on a GPU where all of them
   are tensor-core GEMMs; `--stat-cost 2` prices the statistics as on a CPU without float32-output bf16 GEMMs.
   The model has no per-call fixed cost and no memory traffic beyond ISOPO's charge per float of V.
2. **Measured** (one layer per width, the MLP's up projection d -> d_ff): autograd's weight-gradient GEMM against
   each method's per-layer work on the same random inputs (ISOPO's `layer_grads`; `proma_layer_step` with a running
   gradient, or intra), alternated `--repeats` times (minima). The model's extra MACs at the rate of that layer's own
   GEMM predict the extra milliseconds; measured / predicted checks the model. The layer ratio is 1 + extra / (3
   GEMMs), the layer's own forward + backward.

    python benchmarks/cost_scaling.py --threads 2                  # both tables
    python benchmarks/cost_scaling.py --model-only --stat-cost 2   # the CPU bf16 pricing, no timing
    python benchmarks/cost_scaling.py --widths smollm2-135m --seqs 256,512 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import functools
import os
import warnings
import sys
import tempfile
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from isopo_layer_costs import interleaved_times  # noqa: E402  (same folder)


class Shapes(NamedTuple):
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def linears(self) -> list[tuple[int, int]]:
        """(d_in, d_out) of one block's q, k, v, o, gate, up, down projections."""
        d, q, kv, f = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return [(d, q), (d, kv), (d, kv), (q, d), (d, f), (d, f), (f, d)]


# Which of `Shapes.linears` read the input of an earlier one in the block (k, v after q; up after gate): PROMA intra
# computes their input range finder once (`intra.factored_basis`' shared_input; the sketch sizes agree here), ISOPO
# its Fisher sample and, for the layers on "gram" after the first one there, the input products
# (`statistics.gram_input_statistics`). The backward pass meets them in reverse order (v, k, q; up, gate).
SHARES_INPUT = (False, True, True, False, False, True, False)


MODELS = {  # the models' config.json values
    "smollm2-135m": Shapes(576, 1536, 30, 9, 3, 64, 49152),
    "qwen3-0.6b": Shapes(1024, 3072, 28, 16, 8, 128, 151936),
    "qwen3-1.7b": Shapes(2048, 6144, 28, 16, 8, 128, 151936),
}


@functools.cache
def method_settings():
    """{name: settings} as the trainers build them from their configs' defaults (PROMA in both modes, with the
    2 micro-batches per optimizer step accumulation needs)."""
    from trl_isopo import ISOPOConfig, PROMAConfig

    common = dict(output_dir=tempfile.gettempdir(), use_cpu=True, report_to="none")
    proma = dict(common, gradient_accumulation_steps=2)
    return {"isopo": ISOPOConfig(**common).isopo_settings(),
            "proma-acc": PROMAConfig(**proma, proma_mode="accumulation").proma_settings(),
            "proma-intra": PROMAConfig(**proma, proma_mode="intra").proma_settings(),
            # a budget that holds the materialized V (B, d_out, d_in) of a 2048 x 6144 layer at B = 8
            "proma-acc 512M": PROMAConfig(**proma, proma_mode="accumulation", proma_chunk_mb=512).proma_settings()}


def layer_extra(method: str, st, B: int, L: int, d_in: int, d_out: int, stat_cost: float) -> float:
    """Extra MACs of one covered layer call that reads its input alone (no bias, as in Llama / Qwen blocks)."""
    return group_extra(method, st, B, L, [(d_in, d_out)], stat_cost)


def group_extra(method: str, st, B: int, L: int, group: list[tuple[int, int]], stat_cost: float) -> float:
    """Extra MACs of the covered layers reading one input, `group` in forward order: PROMA's layers after the first
    share the input range finder; ISOPO's as `costs.input_group_costs` prices them, in backward order."""
    from trl_isopo.layerwise.costs import gathered_rows, input_group_costs
    from trl_isopo.proma.projection import proma_extra_macs

    if method != "isopo":
        return sum(proma_extra_macs(st, B, L, a, b, chained=True, stat_cost=stat_cost, input_shared=i > 0)
                   for i, (a, b) in enumerate(group))
    S = gathered_rows(min(st.fisher_tokens or B * L, B * L)) if st.needs_fisher else 0  # the GEMMs' rows
    costs = input_group_costs(list(reversed(group)), B, L, S, st.needs_fisher, st.interacting, st.budget_bytes,
                              euclidean=st.needs_euclidean, stat_cost=stat_cost, route=st.route)
    return sum(getattr(cost, route) for cost, route, _ in costs)


def input_groups(linears: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`linears` split into the runs that read one input (SHARES_INPUT), each in forward order."""
    groups = []
    for shape, shares in zip(linears, SHARES_INPUT):
        if shares:
            groups[-1].append(shape)
        else:
            groups.append([shape])
    return groups


def model_ratios(m: Shapes, B: int, L: int, lora_rank: int, stat_cost: float) -> dict[str, float]:
    """{method: predicted step ratio over GRPO} for one micro-batch of model `m` (module docstring, table 1)."""
    N = B * L
    attention = 3 * B * m.heads * L * L * m.head_dim
    head = N * m.hidden * m.vocab
    # The covered layers by the input they read: LoRA's A factors read the layer's input, each B factor its own.
    groups = input_groups(m.linears())
    if lora_rank:
        groups = ([[(d_in, lora_rank) for d_in, _ in g] for g in groups]
                  + [[(lora_rank, d_out)] for _, d_out in m.linears()])
    base = sum(N * d_in * d_out for d_in, d_out in m.linears())
    if lora_rank:
        grpo = m.layers * (2 * base + 3 * sum(N * a * b for g in groups for a, b in g) + attention) + 2 * head
    else:
        grpo = m.layers * (3 * base + attention) + 3 * head
    return {name: 1 + m.layers * sum(group_extra(name, st, B, L, g, stat_cost) for g in groups) / grpo
            for name, st in method_settings().items()}


def layer_runs(B: int, L: int, d_in: int, d_out: int, dtype: torch.dtype) -> tuple[dict, dict]:
    """({"grpo": autograd's weight-gradient GEMM, method: its per-layer work}, {method: settings}) on the same
    random inputs with some padding (G zero there, as the covered layers see it)."""
    from trl_isopo.isopo.isopo_backward import ISOPOBackward
    from trl_isopo.layerwise.micro_batch import MicroBatch
    from trl_isopo.layerwise.scratch import Scratch
    from trl_isopo.proma.projection import proma_layer_step

    g = torch.Generator().manual_seed(d_in + d_out + L)
    lengths = torch.randint(L // 2, L + 1, (B,), generator=g)
    mask = torch.arange(L).unsqueeze(0) < lengths.unsqueeze(1)
    x = torch.randn(B, L, d_in, generator=g).to(dtype)
    gr = (torch.randn(B, L, d_out, generator=g) * mask.unsqueeze(-1)).to(dtype)
    A = torch.randn(B, generator=g)
    settings = {k: v for k, v in method_settings().items() if k != "proma-acc 512M"}
    runs = {"grpo": lambda: gr.reshape(-1, d_out).T @ x.reshape(-1, d_in)}
    isopo = ISOPOBackward(settings["isopo"])
    isopo.ema.ema = {f"layer/{k}": 1.0 for k in ("e", "f", "rho", "ntk")}  # steady state: EMA history exists
    mb = MicroBatch(mask=mask, advantages=A)

    def run_isopo():
        isopo.layer_grads("layer", x, gr, mb, False)
        isopo.clear(keep_scratch=True)
        isopo.records.clear()
        isopo.lambdas.clear()
        isopo.ema.discard_step()

    runs["isopo"] = run_isopo
    running = torch.randn(d_out, d_in, generator=g) * 1e-2
    for name in ("proma-acc", "proma-intra"):
        st, scratch = settings[name], Scratch()

        def run(st=st, scratch=scratch):
            proma_layer_step(x, gr, mask, A, st, running=running if st.needs_running else None,
                             generator=torch.Generator().manual_seed(0), scratch=scratch,
                             keep_running=st.needs_running)

        runs[name] = run
    return runs, settings


def measured_rows(model: str, m: Shapes, B: int, L: int, dtype: torch.dtype, repeats: int, stat_cost: float):
    d_in, d_out = m.hidden, m.intermediate
    runs, settings = layer_runs(B, L, d_in, d_out, dtype)
    times = {k: min(v) * 1e3 for k, v in interleaved_times(runs, repeats).items()}
    rate = B * L * d_in * d_out / times["grpo"]  # MACs per ms of this layer's own GEMM
    rows = []
    for name, st in settings.items():
        extra = times[name] - times["grpo"]
        predicted = layer_extra(name, st, B, L, d_in, d_out, stat_cost) / rate
        rows.append(f"| {model} {d_in}->{d_out} | {L} | {name} | {times['grpo']:.0f} | {extra:.0f} | {predicted:.0f} | "
                    f"{extra / predicted if predicted > 0 else float('nan'):.2f} | "
                    f"{1 + extra / (3 * times['grpo']):.3f} | {1 + predicted / (3 * times['grpo']):.3f} |")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default=",".join(MODELS), help=f"comma-separated, from {list(MODELS)}")
    ap.add_argument("--seqs", default="256,512,1024,2048", help="sequence lengths L (tokens per sequence)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per micro-batch B")
    ap.add_argument("--lora-rank", type=int, default=16, help="the model table's LoRA rows (adapters on all 7)")
    ap.add_argument("--stat-cost", type=float, default=1.0,
                    help="model table: price of a statistics MAC over a weight-gradient MAC (costs.statistics_cost)")
    ap.add_argument("--model-only", action="store_true", help="only the model table")
    ap.add_argument("--measure-seqs", default="256,512,1024,2048",
                    help="sequence lengths measured (comma-separated per width, ';' between widths)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="measured layers' dtype")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--malloc", default="cached", choices=["cached", "system"],
                    help="CPU only: cached (default) re-runs under glibc settings that keep freed memory, as "
                         "benchmarks/isopo_overhead.py does")
    args = ap.parse_args(argv)
    if args.malloc == "cached" and not args.model_only and os.environ.get("MALLOC_MMAP_MAX_") != "0":
        env = dict(os.environ, MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(2**46))
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)],
                  env)
    warnings.filterwarnings("ignore", category=FutureWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    widths, seqs = args.widths.split(","), [int(s) for s in args.seqs.split(",")]
    print(f"# torch {torch.__version__}, B={args.batch}, package defaults (ISOPO p=-1 c=0 |J|=250; PROMA "
          f"accumulation / intra k=30 q=1), statistics MAC priced {args.stat_cost}x")
    print("\n## Model: predicted step ratio over GRPO (one micro-batch; PROMA accumulation with a running S)\n")
    print("| model | weights | L | " + " | ".join(method_settings()) + " |")
    print("|---|---|---|" + "---|" * len(method_settings()))
    for model in widths:
        for rank in (0, args.lora_rank):
            for L in seqs:
                r = model_ratios(MODELS[model], args.batch, L, rank, args.stat_cost)
                print(f"| {model} | {'LoRA r=' + str(rank) if rank else 'full'} | {L} | "
                      + " | ".join(f"{v:.3f}" for v in r.values()) + " |")
    if args.model_only:
        return
    dtype = getattr(torch, args.dtype)
    from trl_isopo.layerwise.costs import statistics_cost

    stat_cost = statistics_cost(dtype, torch.device("cpu"))
    per_width = args.measure_seqs.split(";")
    print(f"\n## Measured: one layer per width, {args.dtype}, {torch.get_num_threads()} threads, {args.repeats} "
          f"alternated repeats (minima), statistics priced {stat_cost}x, malloc {args.malloc}\n")
    print("| layer | L | method | GEMM ms | extra ms | model ms | measured / model | layer ratio | model |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, model in enumerate(widths):
        for L in (int(s) for s in per_width[min(i, len(per_width) - 1)].split(",")):
            for row in measured_rows(model, MODELS[model], args.batch, L, dtype, args.repeats, stat_cost):
                print(row, flush=True)


if __name__ == "__main__":
    main()
