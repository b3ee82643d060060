"""PROMATrainer on prepared micro-batches (no generation) and its float64 oracle, shared by tests/test_proma_trainer.py
and the 2-process script tests/scripts/proma_ddp.py.

`run_step` drives `PROMATrainer.training_step` as TRL's loop does for one optimizer step (gradient sync on the last
micro-batch only). `oracle_step_grads` rebuilds the same step from per-sequence autograd gradients (one forward and
backward per sequence, through TRL's own forward outside the PROMA window) and the dense projections of
tests/proma_oracle.py: the ridge fit by lstsq, the intra projectors from an SVD of the sketched range.
"""

from __future__ import annotations

import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from isopo_oracle import layer_io, make_batch, surrogate_logps  # noqa: E402
from isopo_steps import prepared_trainer  # noqa: E402
from proma_oracle import oracle_basis, oracle_step  # noqa: E402

from trl_isopo.proma import PROMAConfig, PROMATrainer, sketch_seed  # noqa: E402
from trl_isopo.proma.intra import draw_sketches, sketch_size  # noqa: E402

F64 = torch.float64
LORA_TARGETS = ["q_proj", "v_proj", "up_proj"]


def make_trainer(tokenizer, out_dir, ga: int, batch_size: int = 4, lora: bool = False, **knobs) -> PROMATrainer:
    """A float64 tiny-model PROMATrainer fed prepared micro-batches; `knobs`: PROMAConfig fields (and beta). The
    covered layers' backward order is recorded in `trainer.backward_order` (names, first call each)."""
    trainer = prepared_trainer(PROMATrainer, PROMAConfig, tokenizer, out_dir, ga, batch_size, lora=lora,
                               lora_targets=LORA_TARGETS, **knobs)
    backward, order = trainer.proma_backward, []
    inner = backward.grads

    def grads(call):
        if call.name not in order:
            order.append(call.name)
        return inner(call)

    backward.grads, trainer.backward_order = grads, order
    return trainer


def input_sketch_owners(X: dict, ks: dict, order: list[str]) -> dict[str, str]:
    """name -> the covered layer whose Omega_a gives this layer's input basis Q_a: the first in backward `order` of
    the layers reading the same input tensor (same storage and shape) with the same sketch size k."""
    owners, first = {}, {}
    for n in order:
        x = X[n]
        owners[n] = first.setdefault((x.data_ptr(), tuple(x.shape), ks[n]), n)
    return owners


def micro_batches(tokenizer, seeds) -> list[dict]:
    """One micro-batch of 4 sequences per seed: left-padded prompts, right-padded completions (lengths rotated by
    the seed, one empty), advantages with a zero and negatives."""
    out = []
    for s in seeds:
        r = s % 4
        prompt_lens, completion_lens = (3, 5, 2, 4), (4, 1, 3, 0)
        mb = make_batch(tokenizer, seed=s, prompt_lens=prompt_lens[r:] + prompt_lens[:r],
                        completion_lens=completion_lens[r:] + completion_lens[:r])  # fmt: skip
        mb.pop("num_items_in_batch")
        g = torch.Generator().manual_seed(1000 + s)
        advantages = torch.randn(4, generator=g)
        advantages[(r + 1) % 4] = 0.0
        out.append({**mb, "advantages": advantages})
    return out


def run_step(trainer: PROMATrainer, window: list[dict], model=None) -> dict[str, torch.Tensor]:
    """One optimizer step's gradients (name -> float64) over the micro-batches of `window`; `.grad` is cleared
    first, the parameters are not updated."""
    model = trainer.model if model is None else model
    model.zero_grad(set_to_none=True)
    items = sum(int(mb["completion_mask"].sum()) for mb in window) * trainer.accelerator.num_processes
    for k, mb in enumerate(window):
        trainer.accelerator.gradient_state._set_sync_gradients(k == len(window) - 1)
        inputs = {**mb, "num_items_in_batch": torch.tensor(items)}
        trainer.training_step(model, inputs, inputs["num_items_in_batch"])
    params = {n.removeprefix("module."): p for n, p in model.named_parameters() if p.requires_grad}
    return {n: p.grad.detach().to(F64).clone() for n, p in params.items() if p.grad is not None}


def per_sequence_data(trainer: PROMATrainer, inputs: dict, ga: int = 1) -> dict:
    """Per sequence i of one micro-batch: the gradients of every trainable parameter (covered weights: V_i, biases)
    of its share of the bnpo surrogate, -sum_t m_it log pi_it / (the micro-batch's completion tokens x `ga`), and every
    covered layer's input X (B, L, d_in) and output gradient G (B, L, d_out) of the summed surrogate.

    One plain forward of the whole micro-batch through TRL's own code outside the PROMA window (the same values, bit
    for bit, as the trainer's forward), then one `autograd.grad` per sequence on that graph: sequences do not
    interact, so each is that sequence's own gradient (a forward per sequence would round the model's float32
    RMSNorm differently and blur the comparison at 1e-7). The seed includes 1 / ga as the trainer's does: TRL's fused
    log-prob kernel rounds d loss / d logits to float32, so scaling afterwards would differ at 1e-7 for ga = 3."""
    layers = {n: m for n, m in trainer.model.named_modules() if n in set(trainer.proma_coverage["covered"])}
    params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    with layer_io(layers) as store:
        logps = surrogate_logps(trainer, inputs)
    mask = inputs["completion_mask"].to(logps.dtype)
    per_seq = -(logps * mask).sum(1) / (mask.sum().clamp(min=1.0) * ga)
    outs = [store[n][1] for n in layers]
    grads = []
    for i in range(per_seq.shape[0]):
        g = torch.autograd.grad(per_seq[i], list(params.values()), allow_unused=True, retain_graph=True)
        grads.append({n: torch.zeros_like(p) if gr is None else gr for (n, p), gr in zip(params.items(), g)})
    gouts = torch.autograd.grad(per_seq.sum(), outs, allow_unused=True)
    return {
        "grads": grads,
        "V": {n: torch.stack([g[f"{n}.weight"] for g in grads]) for n in layers},
        "b": {n: [g.get(f"{n}.bias") for g in grads] for n in layers},
        "X": {n: store[n][0] for n in layers},
        "G": {n: torch.zeros_like(o) if go is None else go for (n, o), go in zip(zip(layers, outs), gouts)},
        "mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1).bool(),
    }


def oracle_step_grads(trainer: PROMATrainer, window: list[dict], global_step: int = 0, process: int = 0,
                      plain: bool = False) -> dict[str, torch.Tensor]:
    """The expected gradients of one optimizer step over `window` (bnpo: each micro-batch's token mean / GA).

    Covered weights and biases: the PROMA chain over the micro-batches by `proma_oracle.oracle_step` (biases:
    accumulation only, on their own per-sequence gradients). Other parameters: sum_i A_i grad_i (advantage-weighted).
    `plain`: the plain sum sum_m G_m for every covered layer (the negative control).
    """
    s = trainer.proma_backward.settings
    ga = len(window)
    covered = trainer.proma_coverage["covered"]
    chain: dict[str, torch.Tensor | None] = dict.fromkeys([f"{n}.{p}" for n in covered for p in ("weight", "bias")])
    others: dict[str, torch.Tensor] = {}
    for index, mb in enumerate(window):
        data = per_sequence_data(trainer, mb, ga)
        A = mb["advantages"].to(F64)
        active = index >= trainer.args.proma_skip_fraction * ga
        for n, grads in ((k, [g[k] for g in data["grads"]]) for k in data["grads"][0]):
            if n.rsplit(".", 1)[0] in covered:
                continue
            total = sum(a * g for a, g in zip(A.tolist(), grads))
            others[n] = total if n not in others else others[n] + total
        B, L = data["mask"].shape
        ks = {n: sketch_size(s.intra_dim, B * L, data["X"][n].shape[-1], data["G"][n].shape[-1]) for n in covered}
        owners = input_sketch_owners(data["X"], ks, trainer.backward_order)
        for n in covered:
            V = data["V"][n]
            Pa = Pg = None
            mode = s.mode if active and not plain else "off"
            if s.intra and mode != "off":
                X, G, mask, k = data["X"][n], data["G"][n], data["mask"], ks[n]

                def sketches(layer):
                    gen = torch.Generator().manual_seed(sketch_seed(trainer.args.seed, process, global_step, index,
                                                                    covered.index(layer)))
                    return draw_sketches(B * L, k, gen, F64, X.device)

                # Omega_g from the layer's own generator, Omega_a from the one of the first layer reading its input
                Oa, Og = sketches(owners[n])[0], sketches(n)[1]
                Qa, Qg = oracle_basis(X, mask, Oa, s.intra_power_iters), oracle_basis(G, mask, Og, s.intra_power_iters)
                Pa, Pg = Qa @ Qa.T, Qg @ Qg.T
            knobs = dict(s=s.shrinkage, lam=s.ridge, solver=s.solver, sweeps=s.sweeps, bound=s.relative_bound,
                         si=s.intra_shrinkage, target=s.intra_target)  # fmt: skip
            key = f"{n}.weight"
            if mode == "off":
                G_m = torch.einsum("b,boi->oi", A, V)
                chain[key] = G_m if chain[key] is None else chain[key] + G_m
            else:
                chain[key] = oracle_step(V, A, chain[key], mode=mode, Pa=Pa, Pg=Pg, **knobs)
            if data["b"][n][0] is not None:
                Vb = torch.stack(data["b"][n]).unsqueeze(-1)
                bmode = "accumulation" if s.accumulation and mode != "off" else "off"
                key = f"{n}.bias"
                if bmode == "off":
                    G_b = torch.einsum("b,boi->oi", A, Vb)
                    chain[key] = G_b if chain[key] is None else chain[key] + G_b
                else:
                    chain[key] = oracle_step(Vb, A, chain[key], mode="accumulation", s=s.shrinkage, lam=s.ridge,
                                             solver=s.solver, sweeps=s.sweeps, bound=s.relative_bound)  # fmt: skip
    out = {k: (v.squeeze(-1) if k.endswith(".bias") else v) for k, v in chain.items() if v is not None}
    out.update(others)
    return out


def sketches_by_content(trainer: PROMATrainer) -> None:
    """Seed each layer's intra sketches by the micro-batch's content (its mask and advantages) instead of (process,
    step, index): the same micro-batch then gets the same Omega on whichever process and at whichever position it
    runs, so runs that split the micro-batches differently can be compared exactly."""
    import zlib

    backward = trainer.proma_backward

    def generator(name, mb, device):
        key = zlib.crc32(mb.mask.cpu().numpy().tobytes() + mb.advantages.cpu().numpy().tobytes())
        return torch.Generator(device=device).manual_seed(sketch_seed(key, backward.layer_index[name]))

    backward.generator = generator


DDP_SEEDS = {"intra": ((31,), (32,)), "accumulation": ((41, 51), (42, 52))}  # per rank
DDP_KNOBS = {"intra": dict(proma_mode="intra", proma_intra_dim=3), "accumulation": dict(proma_mode="accumulation")}
