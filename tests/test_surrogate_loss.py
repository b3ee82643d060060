"""The advantage-free surrogate, written from the per-token log-probs (layerwise/surrogate.py), is GRPO's own loss with
advantages 1 and ratio 1: the same gradient w.r.t. the log-probs for every supported loss_type, with the tool mask
and the high-entropy token mask, and the metrics GRPO logs."""

import pytest
import torch
from isopo_oracle import logps_grad, make_batch, make_trainer
from trl import GRPOTrainer

from trl_isopo.tiny import build_tiny_causal_lm


@pytest.mark.parametrize("masks", ["completion", "tool+high-entropy"])
@pytest.mark.parametrize("loss_type", ["bnpo", "grpo", "dr_grpo", "dapo"])
def test_surrogate_gradient_is_grpo_loss_gradient(tiny_tokenizer, tmp_path, loss_type, masks):
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=1)
    extra = {} if masks == "completion" else dict(top_entropy_quantile=0.5)
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, loss_type=loss_type, **extra)
    trainer.current_gradient_accumulation_steps = 3
    inputs = make_batch(tiny_tokenizer)
    if masks != "completion":
        tool = torch.ones_like(inputs["completion_mask"])
        tool[:, 1] = 0  # a tool-output token in every completion
        inputs["tool_mask"] = tool
    with trainer.isopo_active():
        ours = logps_grad(trainer, lambda x: trainer.compute_loss(trainer.model, x), inputs)
    grpo_inputs = {**inputs, "advantages": torch.ones_like(inputs["advantages"]), "old_per_token_logps": None}
    trainer._metrics["train"].clear()
    theirs = logps_grad(trainer, lambda x: GRPOTrainer._compute_loss(trainer, trainer.model, x), grpo_inputs)
    grpo_keys = set(trainer._metrics["train"])
    # (TRL's fused log-prob kernel returns float32 log-probs even for a float64 model)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    live = ours != 0
    assert live.any() and not live.all()  # the masks removed tokens
    trainer._metrics["train"].clear()
    with trainer.isopo_active():
        trainer.compute_loss(trainer.model, inputs)
    assert grpo_keys <= set(trainer._metrics["train"]), grpo_keys - set(trainer._metrics["train"])
    assert all(v == [0.0] for k, v in trainer._metrics["train"].items() if k.startswith("clip_ratio/"))
