"""Cost of the ISOPO-transformed LM head (`isopo_lm_head=True`) against TRL's fused log-prob kernel, on one head.

    python benchmarks/isopo_head_overhead.py [--hidden 576 --vocab 49152 --batch 8 --prompt 128 --completion 256]
        [--repeats 3] [--dtype float32|bfloat16] [--json out.json]

Times forward + backward of the head alone (hidden states and weight trainable, the bnpo surrogate on the completion
tokens) in TRL's full row layout, interleaved, minimum of `--repeats`:
- "TRL": `ChunkedLogProbFunction` (what GRPO runs; ISOPO with isopo_other_params="surrogate");
- "advantage-weighted": `RowScaledChunkedLogProb` with each row scaled by its sequence's advantage (ISOPO's default
  head, isopo_other_params="advantage_weighted");
- "ISOPO head <variant>": the same kernel with `head.ISOPOHead` (statistics over vocabulary tiles, coefficients,
  row-scaled weight gradient).
Ratios are against "TRL". The defaults are SmolLM2-135M's head (hidden 576, vocabulary 49152).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from trl.kernels.chunked_logprob import ChunkedLogProbFunction

from trl_isopo.isopo.head import ISOPOHead
from trl_isopo.layerwise.head import RowScaledChunkedLogProb, head_row_values
from trl_isopo.isopo.isopo_backward import ISOPOBackward
from trl_isopo.layerwise.micro_batch import MicroBatch

from isopo_layer_costs import variant_settings  # same folder

VARIANTS = ("p=-1", "q=-1", "interacting")  # isopo_layer_costs.VARIANTS' (c = 0; c changes no cost of the head)
CHUNK = 4096  # TRL's default vocabulary chunk of the fused head


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dt = getattr(torch, a.dtype)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    B, P, C, H, V = a.batch, a.prompt, a.completion, a.hidden, a.vocab
    L = P + C
    mask = torch.ones(B, L, dtype=torch.bool)
    for b in range(B):  # left-padded prompts, right-padded completions of varied lengths
        mask[b, : (b * P) // (2 * B)] = False
        mask[b, L - (b * C) // (2 * B) :] = False
    N = B * (L - 1)
    hidden0 = (torch.randn(N, H, generator=g) * 2).to(dev, dt)
    weight0 = (torch.randn(V, H, generator=g) / H**0.5).to(dev, dt)
    targets = torch.randint(0, V, (N,), generator=g).to(dev)
    scored = mask[:, 1:].clone()
    scored[:, : L - 1 - C] = False
    gl = (-scored.float() / scored.sum()).reshape(-1).to(dev)  # d(-mean logp) / d logp
    A = torch.randn(B, generator=g).to(dev)
    mb = MicroBatch(mask=mask.to(dev), advantages=A, logits_to_keep=C, seed=3)
    cfg = (1.0, CHUNK, None, 1.0, ())

    def step(fn, extra=()):
        def run():
            h = hidden0.detach().clone().requires_grad_()
            w = weight0.detach().clone().requires_grad_()
            out = fn.apply(h, w, None, targets, *extra, *cfg)
            torch.autograd.grad((out[0] * gl).sum(), (h, w))
            if dev.type == "cuda":
                torch.cuda.synchronize()

        return run

    runs = {"TRL": step(ChunkedLogProbFunction)}
    runs["advantage-weighted"] = step(RowScaledChunkedLogProb, (head_row_values(N, mb, A).float(),))
    contexts = {}
    for name in VARIANTS:
        ctx = ISOPOBackward(variant_settings(name))
        contexts[name] = ctx
        runs[f"ISOPO head {name}"] = step(RowScaledChunkedLogProb, (ISOPOHead(ctx, "lm_head", mb),))
    times = {k: [] for k in runs}
    for f in runs.values():
        f()
    for _ in range(a.repeats):
        for k, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
        for ctx in contexts.values():  # the per-step work of the trainer: fold the EMA, drop the records
            ctx.ema.end_step()
            ctx.records.clear()
            ctx.lambdas.clear()
    base = min(times["TRL"])
    print(f"# torch {torch.__version__}, {dev}, threads {a.threads}, {a.dtype}; head {V} x {H}, B={B} "
          f"prompt {P} + completion {C} (rows {N}, scored {int(scored.sum())}), min of {a.repeats}")
    print("| head | forward + backward ms (min) | ratio to TRL's kernel |")
    print("|---|---|---|")
    result = {}
    for k, ts in times.items():
        result[k] = {"ms": 1e3 * min(ts), "ratio": min(ts) / base}
        print(f"| {k} | {1e3 * min(ts):.0f} | {min(ts) / base:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": result}, f, indent=1)


if __name__ == "__main__":
    main()
