"""The backward object's mechanics (`trl_isopo/layerwise/engine.py`): install / remove, the micro-batch window, the
per-object plain mode, the TRL kernel interception, and the extension point (a subclass supplying `layer_grads`)."""

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import trl.trainer.utils as trl_utils

from trl_isopo.layerwise.engine import LayerBackward
from trl_isopo.layerwise.head import FusedHeadInterception
from trl_isopo.isopo.isopo_backward import ISOPOBackward
from math_settings import isopo_settings
from trl_isopo.layerwise.micro_batch import MicroBatch
from trl_isopo.layerwise import MethodName


class PlainBackward(LayerBackward):
    """A second method through the extension point: the ordinary gradient, times a per-sequence factor."""

    def __init__(self, factor):
        super().__init__(MethodName(title="Plain", prefix="plain"))
        self.factor = factor

    def grads(self, call):
        dt, X, G = call.dtype, call.X, call.G
        w = self.factor.to(dt)
        gw = torch.einsum("b,blo,bli->oi", w, G.to(dt), X.to(dt))
        gb = torch.einsum("b,blo->o", w, G.to(dt) * call.mask.unsqueeze(-1)) if call.has_bias else None
        return gw, gb


def model_and_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x = torch.randn(4, 6, 3, generator=g, dtype=torch.float64)
    mask = torch.rand(4, 6, generator=g) > 0.3
    return model, x, mask


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_extension_point_gets_the_weighted_per_sequence_gradient():
    """A `LayerBackward` subclass's `layer_grads` gives the layer gradients: with factors w, sum_i w_i grad(loss_i)
    (float64 brute force, one backward per sequence); the input gradients stay those of the unweighted loss."""
    model, x, mask = model_and_batch()
    w = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    want = [torch.zeros_like(p) for p in model.parameters()]
    for i in range(4):
        model.zero_grad()
        (model(x[i : i + 1]) * mask[i : i + 1, :, None]).sum().backward()
        want = [a + w[i] * p.grad for a, p in zip(want, model.parameters())]
    backward = PlainBackward(w)
    assert backward.install(model) == ["0", "2"]
    model.zero_grad()
    with backward.micro_batch(MicroBatch(mask=mask, advantages=torch.zeros(4))):
        (model(x) * mask[..., None]).sum().backward()
    for got, ref in zip(grads(model), want):
        assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
    backward.remove()
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_outside_the_window_and_in_plain_mode_the_gradient_is_ordinary():
    """Outside the window (and inside it in `plain()` mode) covered layers give autograd's gradient; another
    object's plain mode does not change this one's backward (the mode is per object, not process-wide)."""
    model, x, mask = model_and_batch(1)
    (model(x) * mask[..., None]).sum().backward()
    ordinary = grads(model)
    backward, other = PlainBackward(torch.full((4,), 2.0, dtype=torch.float64)), PlainBackward(torch.ones(4))
    backward.install(model)
    mb = MicroBatch(mask=mask, advantages=torch.zeros(4))
    for mode in ("outside", "plain", "other plain", "window"):
        model.zero_grad()
        if mode == "outside":
            (model(x) * mask[..., None]).sum().backward()
        else:
            with backward.micro_batch(mb):
                loss = (model(x) * mask[..., None]).sum()
                with backward.plain() if mode == "plain" else other.plain() if mode == "other plain" else contextlib.nullcontext():
                    loss.backward()
        doubled = mode in ("other plain", "window")
        for got, ref in zip(grads(model), ordinary):
            assert torch.allclose(got, 2 * ref if doubled else ref, rtol=1e-12, atol=1e-12), mode


def test_window_checks_and_clears():
    """A covered layer without its backward in a window where others had theirs raises; the window's state is
    cleared on exit either way."""
    model, x, mask = model_and_batch(2)
    backward = ISOPOBackward(isopo_settings(fisher_tokens=0))
    backward.install(model)
    mb = MicroBatch(mask=mask, advantages=torch.ones(4))
    with pytest.raises(RuntimeError, match=r"\['0'\].*used outside the module's own forward"):
        with backward.micro_batch(mb):
            h = model[1](model[0](x).detach())  # layer 0's backward never runs
            model[2](h).sum().backward()
    assert backward.calls == {} and backward.current is None
    with backward.micro_batch(mb):
        model(x).sum().backward()
    assert backward.calls == {} and len(backward.records) == 1 + 2  # records are kept for the step


def test_deep_copy_rebinds_the_replaced_forwards():
    model, x, _ = model_and_batch(3)
    PlainBackward(torch.ones(4)).install(model)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].weight.zero_()
        twin[0].bias.zero_()
    assert torch.equal(twin(x), twin[2](twin[1](torch.zeros(4, 6, 5, dtype=torch.float64))))
    assert not torch.equal(model(x), twin(x))


def test_kernel_interception_is_installed_removed_and_passes_through():
    """The interception replaces TRL's module global while installed and restores it on removal (also when a later
    one sits on top); outside its owner's window it returns TRL's kernel's results, bit for bit."""
    original = trl_utils._ChunkedLogProbFunction
    owner = PlainBackward(torch.ones(2))
    first, second = FusedHeadInterception(owner, "advantage_weighted"), FusedHeadInterception(owner, "method")
    first.install()
    second.install()
    try:
        assert trl_utils._ChunkedLogProbFunction is second and second.original is first and first.original is original
        g = torch.Generator().manual_seed(0)
        h = torch.randn(6, 8, generator=g, requires_grad=True)
        w = torch.randn(11, 8, generator=g, requires_grad=True)
        t = torch.randint(0, 11, (6,), generator=g)
        args = (1.0, 4, None, 1.0, ())
        ref = original.apply(h, w, None, t, *args)
        out = trl_utils._ChunkedLogProbFunction.apply(h, w, None, t, *args)
        assert torch.equal(out[0], ref[0])
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(out[0].sum(), (h, w)),
                                                     torch.autograd.grad(ref[0].sum(), (h, w))))
        first.remove()  # not on top: stays in the chain as a pass-through
        assert trl_utils._ChunkedLogProbFunction is second
    finally:
        second.remove()
        first.remove()
    assert trl_utils._ChunkedLogProbFunction is original


def test_trainer_installs_and_removes(tiny_tokenizer, tmp_path):
    """ISOPOTrainer installs its backward (covered forwards, the head interception for "advantage_weighted") and
    `remove_isopo` restores the model and TRL's kernel."""
    from isopo_oracle import make_trainer

    from trl_isopo.tiny import build_tiny_causal_lm

    before = trl_utils._ChunkedLogProbFunction
    trainer = make_trainer(build_tiny_causal_lm(tiny_tokenizer, seed=0), tiny_tokenizer, tmp_path,
                           isopo_other_params="advantage_weighted")
    assert isinstance(trl_utils._ChunkedLogProbFunction, FusedHeadInterception)
    own = {n for n, m in trainer.model.named_modules() if "forward" in m.__dict__}  # incl. accelerate's wrapper
    trainer.remove_isopo()
    left = {n for n, m in trainer.model.named_modules() if "forward" in m.__dict__}
    assert set(trainer.isopo_coverage["covered"]) < own - left  # covered layers and the weighted leaf modules
    assert all(trainer.model.get_submodule(n).forward.__func__ is type(trainer.model.get_submodule(n)).forward
               for n in own - left - {""})
    assert trl_utils._ChunkedLogProbFunction is before


def test_hub_kernels_cannot_drop_the_weighted_forwards(tiny_model_dir, tiny_tokenizer, tmp_path):
    """transformers (5.25+, with `kernels` installed) loads models with Hub kernels on and re-kernelizes at every
    train() / eval() switch, which resets RMSNorm's instance forward. The trainer turns them off, so after the switches
    GRPOTrainer makes each step the norms are still advantage-weighted: zero advantages give a zero gradient for every
    parameter (with the norms' forward reset, they would get the advantage-free surrogate's gradient)."""
    from isopo_oracle import make_batch, make_trainer
    from isopo_oracle_checks import isopo_grads
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    kernels_on = model.use_kernels
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, isopo_other_params="advantage_weighted")
    assert not trainer.model.use_kernels
    trainer.model.eval()
    trainer.model.train()
    inputs = make_batch(tiny_tokenizer)
    inputs["advantages"] = torch.zeros_like(inputs["advantages"])
    got = isopo_grads(trainer, inputs)
    norms = [n for n in got if "norm" in n]
    assert norms and all(float(v.abs().max()) == 0.0 for v in got.values()), {n: float(v.norm()) for n, v in got.items()}
    if not kernels_on:
        pytest.skip("this transformers/kernels install loads models without Hub kernels; the rest was checked")


def test_a_forward_replaced_after_install_stops_the_next_micro_batch(tiny_tokenizer, tmp_path):
    """If something re-sets a weighted module's forward after the trainer was built, the next window raises instead
    of letting that module's gradient silently become the ordinary one."""
    from isopo_oracle import make_batch, make_trainer
    from isopo_oracle_checks import isopo_grads

    from trl_isopo.tiny import build_tiny_causal_lm

    trainer = make_trainer(build_tiny_causal_lm(tiny_tokenizer, seed=0), tiny_tokenizer, tmp_path,
                           isopo_other_params="advantage_weighted")
    inputs = make_batch(tiny_tokenizer)
    isopo_grads(trainer, inputs)
    del trainer.model.model.norm.forward  # what kernelization does to a decorated layer
    with pytest.raises(RuntimeError, match="replaced after the trainer installed"):
        isopo_grads(trainer, inputs)
