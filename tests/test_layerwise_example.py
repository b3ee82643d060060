"""The third method of examples/seqclip_method.py, written on the public per-layer protocol: its gradient through the
engine against a float64 brute force (per-sequence autograd, then the clipping formula), and its 2-step run."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from trl_isopo import MicroBatch

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "seqclip_method.py"
F64 = torch.float64


def load_example():
    spec = importlib.util.spec_from_file_location("seqclip_method", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def problem(seed=0, B=5, L=7):
    """Two covered linears (with biases) around a tanh, a masked per-token loss, left and right padding."""
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(F64)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64))
    x = torch.randn(B, L, 4, generator=g, dtype=F64)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, :3] = False
    mask[2, -2:] = False
    mask[4] = False  # an empty sequence: gradient 0, no clipping
    target = torch.randn(B, L, 3, generator=g, dtype=F64)
    A = torch.randn(B, generator=g, dtype=F64)
    return model, x, mask, target, A


def per_sequence_losses(model, x, mask, target):
    out = model(torch.where(mask.unsqueeze(-1), x, 0.0))
    return ((out - target).square().sum(-1) * mask).sum(-1)  # (B,)


def brute_force(model, x, mask, target, A, c):
    """sum_i A_i min(1, c / ||(V_i, b_i)||) (V_i, b_i) per linear, V_i by autograd of sequence i's loss alone."""
    losses = per_sequence_losses(model, x, mask, target)
    want = {}
    for name, layer in ((n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)):
        grads = [torch.autograd.grad(losses[i], [layer.weight, layer.bias], retain_graph=True)
                 for i in range(len(A))]  # fmt: skip
        norms = torch.stack([(gw.square().sum() + gb.square().sum()).sqrt() for gw, gb in grads])
        w = A * torch.where(norms > c, c / norms, torch.ones_like(norms))
        want[name] = (sum(wi * gw for wi, (gw, _) in zip(w, grads)), sum(wi * gb for wi, (_, gb) in zip(w, grads)))
    return want, norms


@pytest.mark.parametrize("seed", [0, 1])
def test_seqclip_matches_its_float64_oracle(seed):
    example = load_example()
    model, x, mask, target, A = problem(seed)
    want, norms = brute_force(model, x, mask, target, A, c=1.0)
    c = float(norms[norms > 0].median())  # some sequences clipped, some not, in the last layer at least
    want, _ = brute_force(model, x, mask, target, A, c=c)
    backward = example.SeqClipBackward(max_norm=c)
    covered = backward.install(model)
    assert covered == ["0", "2"]
    model.zero_grad()
    with backward.micro_batch(MicroBatch(mask=mask, advantages=A)):
        per_sequence_losses(model, x, mask, target).sum().backward()
    for name, (gw, gb) in want.items():
        layer = dict(model.named_modules())[name]
        torch.testing.assert_close(layer.weight.grad, gw, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(layer.bias.grad, gb, rtol=1e-10, atol=1e-12)
    clipped = [float(f) for f in backward.clipped]
    assert any(0 < f < 1 for f in clipped), clipped  # the oracle checks both branches of the min
    metrics = backward.end_step(lambda t: t)
    assert metrics == {"seqclip/clipped_fraction": pytest.approx(sum(clipped) / len(clipped))}
    backward.remove()


def test_seqclip_trainer_refuses_a_config_it_cannot_honour(tiny_tokenizer, tmp_path):
    from trl import GRPOConfig

    from trl_isopo.tiny import build_tiny_causal_lm, tiny_prompt_dataset, tiny_reward, tiny_training_args

    example = load_example()
    kw = tiny_training_args(tmp_path, per_device_train_batch_size=4, num_generations=4, use_cpu=True)
    model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
    with pytest.raises(TypeError, match="SeqClipTrainer needs a SeqClipConfig, got GRPOConfig."):
        example.SeqClipTrainer(model, tiny_reward, args=GRPOConfig(**kw), train_dataset=tiny_prompt_dataset(8),
                               processing_class=tiny_tokenizer)  # fmt: skip
    with pytest.raises(ValueError, match=r"epsilon=0\.3 has no effect: SeqClip does not clip"):
        example.SeqClipTrainer(model, tiny_reward, args=example.SeqClipConfig(**kw, epsilon=0.3),
                               train_dataset=tiny_prompt_dataset(8), processing_class=tiny_tokenizer)  # fmt: skip


def test_seqclip_script_trains_two_steps():
    out = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'seqclip/clipped_fraction'" in out.stdout.splitlines()[-1]
