"""The ISOPO LM head in TRL's compact row layout (Triton devices: only positions with a valid label reach the kernel),
run on the CPU by switching TRL's layout choice (the fold stays the CPU one).

The compact layout gives the full layout's gradients; a micro-batch with no scored position (every completion empty,
or every one masked by `mask_truncated_completions`) gives the kernel zero rows: the head then gets a zero gradient
and the other parameters theirs, where indexing the empty rows used to fail (a device-side assert on a GPU).
"""

import pytest
import torch
import trl.trainer.utils as trl_utils
from isopo_oracle import make_batch, make_trainer, rel_err

from trl_isopo.isopo.head import ISOPOHead
from trl_isopo.tiny import build_tiny_causal_lm

CALL = ISOPOHead.__call__

KNOBS = [dict(p=-1.0, reg=0.0, fisher_tokens=0), dict(p=-1.0, reg=0.0, fisher_tokens=3), dict(interacting=True, p=-1.0)]


def grads(trainer, inputs, compact: bool, monkeypatch):
    monkeypatch.setattr(trl_utils, "_use_triton", lambda device: compact)
    seen = []

    def spy(self, hidden, *rest):
        seen.append(hidden.shape[0])
        return CALL(self, hidden, *rest)

    monkeypatch.setattr(ISOPOHead, "__call__", spy)
    trainer.model.zero_grad(set_to_none=True)
    with trainer.isopo_active():
        trainer.compute_loss(trainer.model, inputs).backward()
    trainer.isopo_backward.ema.discard_step()
    trainer.isopo_backward.records.clear()
    trainer.isopo_backward.lambdas.clear()
    return {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}, seen


@pytest.fixture
def trainer(tiny_tokenizer, tmp_path):
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=2)
    return make_trainer(model, tiny_tokenizer, tmp_path, isopo_lm_head=True)


@pytest.mark.parametrize("knobs", KNOBS, ids=["p=-1,all", "p=-1,sampled", "interacting"])
def test_compact_layout_equals_full_layout(trainer, tiny_tokenizer, monkeypatch, knobs):
    from trl_isopo.isopo.isopo_backward import ISOPOSettings

    ctx = trainer.isopo_backward
    ctx.settings = ISOPOSettings(**{**ctx.settings.__dict__, **knobs})
    inputs = make_batch(tiny_tokenizer, seed=1)
    full, rows_full = grads(trainer, inputs, False, monkeypatch)
    compact, rows_compact = grads(trainer, inputs, True, monkeypatch)
    B, P, C = inputs["prompt_ids"].shape[0], inputs["prompt_ids"].shape[1], inputs["completion_ids"].shape[1]
    assert rows_full == [B * (P + C - 1)] and rows_compact == [int(inputs["completion_mask"].sum())]
    assert full.keys() == compact.keys() and "lm_head.weight" in full
    for n in full:
        assert rel_err(compact[n], full[n]) < 1e-6, n  # TRL folds float64 tiles in float32
    assert full["lm_head.weight"].norm() > 0


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "full"])
def test_no_scored_position_gives_zero_head_gradient(trainer, tiny_tokenizer, monkeypatch, compact):
    inputs = make_batch(tiny_tokenizer, seed=1, completion_lens=(0,))
    assert int(inputs["completion_mask"].sum()) == 0
    got, rows = grads(trainer, inputs, compact, monkeypatch)
    B, P, C = inputs["prompt_ids"].shape[0], inputs["prompt_ids"].shape[1], inputs["completion_ids"].shape[1]
    assert rows == [0 if compact else B * (P + C - 1)]
    assert all(torch.isfinite(g).all() for g in got.values())
    head = got.get("lm_head.weight")
    assert head is None or head.abs().max() == 0
