"""ISOPO overhead vs plain GRPO: policy-loss forward+backward of one micro-batch, same model and batch.

For each shape it builds one GRPOTrainer and one ISOPOTrainer on identical model copies, then times
`compute_loss(...).backward()` for GRPO and each ISOPO variant (ISOPO: plus its once-per-step reductions, as with
gradient accumulation 1), interleaved over repeats. Two estimates of the time
ratio: the median of the per-round ratios, and the ratio of the fastest runs (contention on a shared machine only
ever slows a run down, so minima are the steadier estimate there); plus the spread of the per-round ratios. It also
prints peak memory ratios (CPU: torch profiler memory timeline; CUDA: max_memory_allocated) and the analytic floor:
the extra multiply-accumulates ISOPO must do under the routes it picks, over the plain step's. A last column checks
that floor against what runs: torch's FlopCounterMode counts the matrix-product MACs of one ISOPO step and one GRPO
step, and their difference is set against the floor's matrix-product part (`costs.gemm_macs`); 1.0000 means ISOPO
runs no GEMM work the floor does not price, and the floor prices none that ISOPO does not run.

On CPU the script re-executes itself with glibc's allocator told to keep freed memory (`--malloc cached`, the
default): by default every temporary above 32 MiB is a fresh mmap whose pages fault in on first touch, which costs
GRPO and ISOPO alike and, unlike CUDA's caching allocator, turns allocation into a large and variable part of the
step. `--malloc system` measures the stock allocator.

    python benchmarks/isopo_overhead.py                      # default shapes: small, lora896, full896
    python benchmarks/isopo_overhead.py --shapes full896 --seq 512 --repeats 9 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from isopo_layer_costs import (  # noqa: E402  (same folder)
    PROBE_WIDTH,
    VARIANTS,
    interleaved_times,
    layer_breakdown,
    profile_layer,
    sync,
    variant_settings,
)

SHAPES = {
    # name: (hidden, intermediate, layers, heads, kv_heads, lora_r)
    "small": (64, 256, 2, 4, 2, 0),
    "lora896": (896, 4864, 2, 14, 2, 16),
    "full896": (896, 4864, 2, 14, 2, 0),
    # Qwen3-0.6B's dimensions (28 layers, hidden 1024, MLP 3072, 16/8 heads) in a Qwen2 module: for the GPU check
    # (benchmarks/gpu_check.py) with --vocab 151936; random weights.
    "qwen3-0.6b-lora": (1024, 3072, 28, 16, 8, 16),
    "qwen3-0.6b-full": (1024, 3072, 28, 16, 8, 0),
}


def build(shape: str, vocab: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trl_isopo.tiny import build_word_tokenizer

    hidden, inter, layers, heads, kv, lora_r = SHAPES[shape]
    tokenizer = build_word_tokenizer([f"w{i}" for i in range(vocab - 4)])
    cfg = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    if lora_r:
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        lc = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, lora_dropout=0.0, target_modules=targets,
                        task_type="CAUSAL_LM", init_lora_weights=False)
        model = get_peft_model(model, lc)
    return model, tokenizer, cfg, lora_r


def _trainer(trainer_cls, config_cls, model, tokenizer, output_dir, **fields):
    """A trainer on its own copy of `model`, in training mode with gradient accumulation 1: one group of 8 prompts
    ("w0 w1"), 8-token completions, a zero reward (the benchmark feeds its own batches), no checkpoints or logging."""
    from datasets import Dataset

    args = config_cls(output_dir=output_dir, report_to="none", use_cpu=not torch.cuda.is_available(), bf16=False,
                      save_strategy="no", disable_tqdm=True, per_device_train_batch_size=8, num_generations=8,
                      max_completion_length=8, gradient_checkpointing=False, **fields)
    trainer = trainer_cls(copy.deepcopy(model), lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["w0 w1"] * 8}), processing_class=tokenizer)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def make_tpo_trainer(model, tokenizer, outdir):
    """A TPOTrainer set up like `make_trainers`' (TPO: eta 1, the whole group of 8 in the micro-batch)."""
    from trl_isopo import TPOConfig, TPOTrainer

    return _trainer(TPOTrainer, TPOConfig, model, tokenizer, outdir + "/t")


def tpo_step_fn(trainer, batch):
    """TPO's loss forward + backward on `batch` (one group; p_old from the forward itself, as with num_iterations=1)."""
    scores = torch.linspace(-1.0, 1.0, batch["prompt_ids"].shape[0], device=batch["prompt_ids"].device)

    def run():
        trainer.model.zero_grad(set_to_none=True)
        trainer.compute_loss(trainer.model, dict(batch, tpo_scores=scores)).backward()
        sync()

    return run


def make_trainers(model, tokenizer, outdir, other_params="surrogate"):
    from trl import GRPOConfig, GRPOTrainer

    from trl_isopo import ISOPOConfig, ISOPOTrainer

    plain = _trainer(GRPOTrainer, GRPOConfig, model, tokenizer, outdir + "/g", loss_type="bnpo")
    isopo = _trainer(ISOPOTrainer, ISOPOConfig, model, tokenizer, outdir + "/i", loss_type="bnpo",
                     isopo_other_params=other_params)
    return plain, isopo


def make_batch(B, T, vocab, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = T // 4
    ids = torch.randint(4, vocab, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for b in range(B):  # some left padding in prompts and right padding in completions
        mask[b, : b % 3] = 0
        mask[b, T - (b % 4) * 3 :] = 0 if b % 4 else 1
    return {
        "prompt_ids": ids[:, :P].to(device), "prompt_mask": mask[:, :P].to(device),
        "completion_ids": ids[:, P:].to(device), "completion_mask": mask[:, P:].to(device),
        "advantages": torch.randn(B, generator=g).to(device), "num_items_in_batch": mask[:, P:].sum().to(device),
    }


def step_fn(trainer, inputs, isopo: bool, end_step_ms: list | None = None):
    """One micro-batch's loss forward + backward; for ISOPO also its once-per-step reductions (EMA fold, metrics),
    as with gradient accumulation 1, the most frequent they can be. Their time is also appended to `end_step_ms`."""

    def run():
        trainer.model.zero_grad(set_to_none=True)
        if isopo:
            with trainer.isopo_active():
                trainer.compute_loss(trainer.model, inputs).backward()
            sync()
            t0 = time.perf_counter()
            trainer._isopo_end_step()
            if end_step_ms is not None:
                end_step_ms.append(1e3 * (time.perf_counter() - t0))
        else:
            trainer.compute_loss(trainer.model, inputs).backward()
        sync()

    return run


def peak_memory(fn) -> float:
    """Peak bytes allocated during fn (CUDA allocator stats, or the CPU profiler's memory timeline)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    return float(max(sum(s) for s in sizes))


def fmt_mib(b: float) -> str:
    return f"{b / 2**20:.0f}"


def input_groups(trainer, batch) -> list[list[str]]:
    """The covered layers grouped by the input tensor they read in one forward pass of `batch` (q/k/v, gate/up),
    each group in forward order."""
    modules = dict(trainer.model.named_modules())
    seen, alive, hooks = {}, [], []  # the inputs kept alive: a freed one's address could be reused by the next

    def record(name, x):
        seen.setdefault((x.data_ptr(), x.shape), []).append(name)
        alive.append(x)

    for name in trainer.isopo_coverage["covered"]:
        hooks.append(modules[name].register_forward_pre_hook(lambda _m, args, name=name: record(name, args[0])))
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    try:
        with torch.no_grad():
            trainer.model(input_ids=ids, attention_mask=mask)
    finally:
        for h in hooks:
            h.remove()
    return list(seen.values())


def analytic(trainer, cfg, B, T, valid, settings, groups) -> tuple[float, float, float]:
    """(plain MACs of the step, ISOPO's extra MACs under the routes it picks: the floor, and the part of those that
    runs as matrix products, with the sample as gathered (zero-padded): what FlopCounterMode should count).

    `valid`: the micro-batch's valid (non-padding) positions, from which the Fisher sample is drawn. `groups`:
    `input_groups`; the backward pass meets each in reverse order, and the layers after the first one on "gram"
    reuse its Fisher input products (`costs.input_group_costs`)."""
    from trl_isopo.layerwise.costs import gathered_rows, gemm_macs, input_group_costs, statistics_cost
    from trl_isopo.layerwise.precision import stat_dtype
    from trl_isopo.layerwise.statistics import item_bytes

    H, V = cfg.hidden_size, cfg.vocab_size
    N = B * T
    plain = 0.0
    for _, m in trainer.model.named_modules():
        if isinstance(m, torch.nn.Linear) and m is not trainer.model.get_output_embeddings():
            macs = N * m.in_features * m.out_features
            plain += macs * (3 if m.weight.requires_grad else 2)  # fwd, input grad, weight grad if trainable
    head_trainable = trainer.model.get_output_embeddings().weight.requires_grad
    plain += N * H * V * (3 if head_trainable else 2)
    plain += cfg.num_hidden_layers * 3 * 2 * B * T * T * H  # attention scores and values, fwd + bwd
    extra = gemm = 0.0
    k = settings.fisher_tokens
    S = (min(k, valid) if k > 0 else valid) if settings.needs_fisher else 0
    # As drawn: a fixed size min(k, B*T) (k <= 0: every position), padding picks included (`fisher_token_sample`).
    S_gathered = gathered_rows((k if 0 < k < N else N) if settings.needs_fisher else 0)
    modules = dict(trainer.model.named_modules())
    flags = (settings.needs_fisher, settings.interacting, settings.budget_bytes)
    for group in groups:
        layers = [modules[name] for name in reversed(group)]
        weight = layers[0].weight
        priced = input_group_costs([(m.in_features, m.out_features) for m in layers], B, T, S, *flags,
                                   euclidean=settings.needs_euclidean, route=settings.route,
                                   stat_cost=statistics_cost(weight.dtype, weight.device),
                                   item=item_bytes(stat_dtype(weight.dtype)))
        for m, (c, route, shared) in zip(layers, priced):
            extra += getattr(c, route)
            gemm += gemm_macs(B, T, m.in_features, m.out_features, S_gathered, *flags, route,
                              euclidean=settings.needs_euclidean, bias=m.bias is not None, input_shared=shared)
    # The advantage-weighted LM head (RowScaledChunkedLogProb) does the same tile work as TRL's kernel: no extra.
    return plain, extra, gemm


def counted_macs(fn) -> float:
    """Multiply-accumulates of the matrix products (mm, bmm, attention) one call of fn runs: torch's FlopCounterMode."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops() / 2


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="small,lora896,full896")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--layer-repeats", type=int, default=15,
                    help="rounds of the per-layer breakdown (0: skip it)")
    ap.add_argument("--other-params", default="surrogate", choices=["surrogate", "advantage_weighted"],
                    help="surrogate (default): LM head / norms get the same gradient code as GRPO, so the ratio "
                    "isolates the covered layers; advantage_weighted: the trainer's default (its own fused head)")
    ap.add_argument("--malloc", default="cached", choices=["cached", "system"],
                    help="CPU only: cached (default) re-runs under MALLOC_MMAP_MAX_=0 / MALLOC_TRIM_THRESHOLD_ so that "
                    "freed memory is reused as CUDA's caching allocator would; system: the stock glibc allocator")
    ap.add_argument("--profile-layer", metavar="D_IN,D_OUT",
                    help="instead of the tables: profile one covered-layer shape (ops per call, per-op times)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="model weights (and so the layers' inputs and output gradients): bfloat16 runs ISOPO's "
                    "GEMMs in bf16 with fp32 accumulation")
    ap.add_argument("--tpo", action="store_true", help="also time TPO's loss forward + backward (ratio to GRPO)")
    ap.add_argument("--json", metavar="PATH", help="also write every row (and the raw times) as JSON here")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = []
    if args.malloc == "cached" and not torch.cuda.is_available() and os.environ.get("MALLOC_MMAP_MAX_") != "0":
        env = dict(os.environ, MALLOC_MMAP_MAX_="0", MALLOC_TRIM_THRESHOLD_=str(2**46))
        os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)],
                  env)
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.profile_layer:
        d_in, d_out = (int(n) for n in args.profile_layer.split(","))
        batch = make_batch(args.batch, args.seq, args.vocab, device)
        mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
        print(f"# torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, B={args.batch} "
              f"T={args.seq}, malloc {args.malloc if device == 'cpu' else 'cuda caching'}")
        profile_layer(mask, d_in, d_out, {v: variant_settings(v) for v in args.variants.split(",")})
        return 0
    print(f"# torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"B={args.batch} T={args.seq} vocab={args.vocab}, dtype {args.dtype}, isopo_other_params={args.other_params}, "
          f"{args.repeats} interleaved repeats, malloc {args.malloc if device == 'cpu' else 'cuda caching'}")
    print("| shape | variant | GRPO ms (min) | ISOPO ms (min) | ratio of minima | median ratio [quartiles] "
          "| analytic floor | overhead / floor | peak MiB GRPO / ISOPO | peak mem ratio "
          "| extra GEMM MACs (M): counted / modelled = ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    breakdown = []
    # Built before any trainer: a config made after one would reset accelerate's state under it.
    settings = {v: variant_settings(v) for v in args.variants.split(",")}
    for shape in args.shapes.split(","):
        model, tokenizer, cfg, _ = build(shape, args.vocab, dtype=dtype)
        with tempfile.TemporaryDirectory() as tmp:
            plain, isopo = make_trainers(model, tokenizer, tmp, args.other_params)
            batch = make_batch(args.batch, args.seq, cfg.vocab_size, device)
            runs = {"grpo": step_fn(plain, batch, False)}
            tpo = make_tpo_trainer(model, tokenizer, tmp) if args.tpo else None
            if tpo is not None:
                runs["tpo"] = tpo_step_fn(tpo, batch)
            end_step_ms = {}
            for v in settings:
                end_step_ms[v] = []

                def run_v(s=settings[v], f=step_fn(isopo, batch, True, end_step_ms[v])):
                    isopo.isopo_backward.settings = s
                    f()

                runs[v] = run_v
            times = interleaved_times(runs, args.repeats)
            mem = {} if args.no_memory else {k: peak_memory(f) for k, f in runs.items()}
            counted = {k: counted_macs(f) for k, f in runs.items()}
            valid = int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())
            groups = input_groups(isopo, batch)
            for v in settings:
                ratios = sorted(a / b for a, b in zip(times[v], times["grpo"]))
                plain_macs, extra, gemm = analytic(isopo, cfg, args.batch, args.seq, valid, settings[v], groups)
                floor = extra / plain_macs
                ratio = min(times[v]) / min(times["grpo"])
                q1, q3 = (statistics.quantiles(ratios, n=4)[::2] if len(ratios) > 1 else (ratios[0], ratios[0]))
                mem_ratio = f"{mem[v] / mem['grpo']:.3f}" if mem else "-"
                mem_abs = f"{fmt_mib(mem['grpo'])} / {fmt_mib(mem[v])}" if mem else "-"
                print(f"| {shape} | {v} | {1e3 * min(times['grpo']):.1f} | {1e3 * min(times[v]):.1f} | {ratio:.3f} | "
                      f"{statistics.median(ratios):.3f} [{q1:.3f}, {q3:.3f}] | {1 + floor:.3f} | "
                      f"{(ratio - 1) / floor if floor > 0 else float('nan'):.2f} | {mem_abs} | {mem_ratio} | "
                      f"{(counted[v] - counted['grpo']) / 1e6:.2f} / {gemm / 1e6:.2f} = "
                      f"{(counted[v] - counted['grpo']) / gemm if gemm > 0 else float('nan'):.4f} |", flush=True)
                rows.append({"shape": shape, "variant": v, "dtype": args.dtype, "ratio_of_minima": ratio,
                             "median_ratio": statistics.median(ratios), "floor": 1 + floor,
                             "peak_mem_ratio": mem[v] / mem["grpo"] if mem else None,
                             "grpo_s": times["grpo"], "isopo_s": times[v]})
            if tpo is not None:
                ratios = sorted(a / b for a, b in zip(times["tpo"], times["grpo"]))
                ratio = min(times["tpo"]) / min(times["grpo"])
                print(f"| {shape} | TPO | {1e3 * min(times['grpo']):.1f} | {1e3 * min(times['tpo']):.1f} (TPO) | "
                      f"{ratio:.3f} | {statistics.median(ratios):.3f} | - | - | - | "
                      f"{mem['tpo'] / mem['grpo']:.3f} | - |" if mem else
                      f"| {shape} | TPO | {1e3 * min(times['grpo']):.1f} | {1e3 * min(times['tpo']):.1f} (TPO) | "
                      f"{ratio:.3f} | {statistics.median(ratios):.3f} | - | - | - | - | - |", flush=True)
                rows.append({"shape": shape, "variant": "tpo", "dtype": args.dtype, "ratio_of_minima": ratio,
                             "median_ratio": statistics.median(ratios), "grpo_s": times["grpo"],
                             "tpo_s": times["tpo"]})
            if args.layer_repeats > 0:
                mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
                breakdown += [f"| {shape} {r[2:]}" for r in
                              layer_breakdown(isopo, mask, settings, args.layer_repeats,
                                              1e3 * min(times["grpo"]),
                                              {v: min(ts) for v, ts in end_step_ms.items() if ts})]
        del model, plain, isopo, tpo
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "device": device, "dtype": args.dtype, "batch": args.batch,
                       "seq": args.seq, "vocab": args.vocab, "rows": rows}, f, indent=1)
    if breakdown:
        print("\n# per covered-layer shape: autograd weight(+bias) gradient vs ISOPO layer_grads, min of "
              f"{args.layer_repeats} alternated runs; floor = route extra MACs at that layer's own GEMM rate; "
              f"fixed cost per call = ISOPO minus plain on a {PROBE_WIDTH} x {PROBE_WIDTH} layer (dispatch, no arithmetic "
              "to speak of), times the number of covered layer calls")
        print("| shape | layer | variant (route) | plain ms | ISOPO ms | extra ms | floor ms | extra / floor "
              "| fixed cost per call x calls |")
        print("|---|---|---|---|---|---|---|---|---|")
        print("\n".join(breakdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
