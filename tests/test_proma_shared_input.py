"""PROMA intra's input range finder, computed once per distinct layer input (q/k/v, gate/up, LoRA A's on one input).

What is checked: the layers reading one input share Q_a (the range finder runs once per input and micro-batch in a
real step); a follower's step equals, bit for bit, the unshared step fed the first layer's Omega_a and its own
Omega_g; the first layer's step is unchanged; a follower's Q_a keeps its distribution (Monte Carlo against the
unshared draw); the engine's input cache keeps the shared entry across LoRA's interleaved B / A calls. The float64
oracle of a whole step with shared bases is tests/test_proma_trainer.py (its oracle takes Omega_a from the first
layer in backward order reading the same input).
"""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
from proma_steps import make_trainer, micro_batches, run_step  # noqa: E402

from math_settings import proma_settings  # noqa: E402
from trl_isopo.layerwise.inputs import InputCache, SharedInput  # noqa: E402
from trl_isopo.layerwise.micro_batch import MicroBatch  # noqa: E402
from trl_isopo.proma import intra  # noqa: E402
from trl_isopo.proma.intra import draw_sketches, factored_basis, sketch_size  # noqa: E402
from trl_isopo.proma.projection import proma_layer_step  # noqa: E402

F64 = torch.float64
B, L, D_IN = 3, 7, 10


def operands(seed, d_outs=(6, 4), dtype=F64):
    """X (B, L, D_IN) with finite garbage at padding, one G per d_out (zero at padding), the mask, advantages."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, :2] = False
    mask[2, 5:] = False
    X = torch.randn(B, L, D_IN, generator=g, dtype=dtype)
    Gs = [torch.randn(B, L, d, generator=g, dtype=dtype).masked_fill(~mask.unsqueeze(-1), 0.0) for d in d_outs]
    return X, Gs, mask, torch.randn(B, generator=g, dtype=dtype)


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("power_iters", [0, 1, 2])
def test_follower_equals_unshared_step_with_the_first_layers_input_sketch(power_iters):
    """Layer 1 (first) and layer 2 (follower) read X. Shared: layer 1's step is its unshared step; layer 2's is the
    unshared step with sketches (Omega_a of layer 1, Omega_g of layer 2), bit for bit, though layer 2 reads X with
    its padding rows zeroed (the narrower-operand copy q sees) and layer 1 reads the raw X (k / v)."""
    X, (G1, G2), mask, A = operands(0)
    s = proma_settings(mode="intra", intra_dim=4, intra_power_iters=power_iters)
    mb = MicroBatch(mask=mask, advantages=A)
    shared = SharedInput(X, mb)
    first = proma_layer_step(X, G1, mask, A, s, generator=gen(1), shared_input=shared)
    X_masked = X.masked_fill(~mask.unsqueeze(-1), 0.0)
    follower = proma_layer_step(X_masked, G2, mask, A, s, generator=gen(2), shared_input=shared)
    k = sketch_size(4, B * L, D_IN, 6)
    assert sketch_size(4, B * L, D_IN, 4) == k
    Oa1, Og1 = draw_sketches(B * L, k, gen(1), F64, X.device)
    Og2 = draw_sketches(B * L, k, gen(2), F64, X.device)[1]
    alone1 = proma_layer_step(X, G1, mask, A, s, sketches=(Oa1, Og1))
    want2 = proma_layer_step(X_masked, G2, mask, A, s, sketches=(Oa1, Og2))
    own2 = proma_layer_step(X_masked, G2, mask, A, s, generator=gen(2))
    assert torch.equal(first.grad_weight, alone1.grad_weight)
    assert torch.equal(follower.grad_weight, want2.grad_weight)
    assert not torch.allclose(follower.grad_weight, own2.grad_weight)  # it did not use its own Omega_a
    assert len(shared.statistics) == 1


def test_rows_are_shared_and_made_when_a_later_layer_needs_them():
    """xq = X Q_a is shared too: made by the first layer that needs it, from the shared Q_a."""
    X, (G1, G2), mask, _ = operands(1)
    shared = SharedInput(X, MicroBatch(mask=mask, advantages=torch.ones(B, dtype=F64)))
    b1 = factored_basis(X, G1, mask, 4, 1, gen(1), rows=False, shared_input=shared)
    b2 = factored_basis(X, G2, mask, 4, 1, gen(2), rows=True, shared_input=shared)
    b3 = factored_basis(X, G1, mask, 4, 1, gen(3), rows=True, shared_input=shared)
    assert b1.xq is None and b2.Q_a is b1.Q_a and b3.xq is b2.xq
    assert torch.equal(b2.xq, intra.masked_rows_times(X, b1.Q_a, mask))


def test_a_different_sketch_size_is_not_shared():
    """k = min(dim, rows, d_in, d_out): a layer with another k gets its own input basis."""
    X, (G1, G2), mask, _ = operands(2, d_outs=(6, 2))
    shared = SharedInput(X, MicroBatch(mask=mask, advantages=torch.ones(B, dtype=F64)))
    b1 = factored_basis(X, G1, mask, 4, 1, gen(1), shared_input=shared)
    b2 = factored_basis(X, G2, mask, 4, 1, gen(2), shared_input=shared)
    assert b1.Q_a.shape[1] == 4 and b2.Q_a.shape[1] == 2 and len(shared.statistics) == 4  # bases and rows, twice


def test_follower_basis_keeps_its_distribution():
    """Monte Carlo over 400 micro-batch seeds: the follower's input projector P_a = Q_a Q_a^T (shared) against the
    unshared one (its own Omega_a). Mean projectors and the mean captured fraction ||P_a X^T||^2 / ||X||^2 agree
    within 5 standard errors; an input basis drawn at another k (a different law) is told apart by the same test."""
    X, (G1, G2), mask, _ = operands(3)
    Xv = X[mask]  # valid rows

    def follower(seed, shared, k=4):
        share = SharedInput(X, MicroBatch(mask=mask, advantages=torch.ones(B, dtype=F64))) if shared else None
        if shared:
            factored_basis(X, G1, mask, k, 0, gen(2 * seed), rows=False, shared_input=share)
        Q = factored_basis(X, G2, mask, k, 0, gen(2 * seed + 1), rows=False, shared_input=share).Q_a
        P = Q @ Q.T
        return P, (Xv @ Q).square().sum() / Xv.square().sum()

    def summary(draws):
        P = torch.stack([d[0] for d in draws])
        f = torch.stack([d[1] for d in draws])
        return P.mean(0), P.std(0) / len(draws) ** 0.5, f.mean(), f.std() / len(draws) ** 0.5

    n = 400
    sP, sPe, sf, sfe = summary([follower(i, True) for i in range(n)])
    uP, uPe, uf, ufe = summary([follower(i + n, False) for i in range(n)])
    assert ((sP - uP).abs() <= 5 * (sPe.square() + uPe.square()).sqrt() + 1e-12).all()
    assert (sf - uf).abs() <= 5 * (sfe.square() + ufe.square()).sqrt()
    _, _, of, ofe = summary([follower(i + 2 * n, False, k=3) for i in range(n)])
    assert (of - uf).abs() > 5 * (ofe.square() + ufe.square()).sqrt()  # the test can tell laws apart


def test_input_cache_keeps_the_shared_entry_across_loras_interleaved_calls():
    """LoRA's backward runs v_B v_A k_B k_A q_B q_A: the A's input must still be cached when k_A and q_A run; older
    entries drop their masked copies; a third input evicts the oldest entry."""
    cache = InputCache()
    mb = MicroBatch(mask=torch.ones(2, 3, dtype=torch.bool), advantages=torch.ones(2))
    x = torch.randn(2, 3, 5)
    bs = [torch.randn(2, 3, 2) for _ in range(3)]
    entries = []
    for b in bs:
        cache.masked(b, mb, torch.float32)
        entries.append(cache.entry(x, mb))
    assert entries[0] is entries[1] is entries[2]
    first_b = cache.entry(bs[2], mb)
    assert torch.float32 in first_b.masked
    cache.entry(x, mb)
    cache.entry(torch.randn(2, 3, 4), mb)
    assert not first_b.masked  # not the newest: its masked copy is dropped
    assert cache.entry(bs[2], mb) is not first_b  # evicted: two newer inputs came after it
    assert cache.entry(x, MicroBatch(mask=mb.mask, advantages=mb.advantages)) is not entries[0]  # another micro-batch


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_input_range_finder_runs_once_per_input_in_a_training_step(tiny_tokenizer, tmp_path, monkeypatch, lora):
    """One step of 2 micro-batches on the tiny model: `range_basis` runs once per covered layer on its output
    gradients and once per distinct input on the inputs: per block q/k/v share one input and gate/up another (full
    weights: 4 inputs for 7 layers; LoRA on q, v, up: q's and v's A share one, 5 inputs for 6 factors)."""
    calls = []
    inner = intra.range_basis

    def counted(T, *args, **kwargs):
        calls.append(T.shape[-1])
        return inner(T, *args, **kwargs)

    monkeypatch.setattr(intra, "range_basis", counted)
    trainer = make_trainer(tiny_tokenizer, tmp_path, ga=2, lora=lora, proma_mode="intra", proma_intra_dim=3)
    run_step(trainer, micro_batches(tiny_tokenizer, (5, 6)))
    covered = trainer.proma_coverage["covered"]
    blocks = trainer.model.config.num_hidden_layers
    per_block = (6, 5) if lora else (7, 4)  # (covered layers, distinct inputs) per block
    assert len(covered) == blocks * per_block[0]
    assert len(calls) == 2 * blocks * sum(per_block)
