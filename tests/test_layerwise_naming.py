"""The per-layer engine names the method it runs: PROMA's errors, coverage and metric keys say PROMA, ISOPO's say
ISOPO, from the `MethodName` each method passes in (no message or key is rewritten afterwards)."""

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts"))
from proma_steps import make_trainer, micro_batches, run_step  # noqa: E402

from trl_isopo.layerwise.install import install_layerwise  # noqa: E402
from trl_isopo.isopo.isopo_backward import ISOPO  # noqa: E402
from trl_isopo.layerwise.other_params import check_leaf_module  # noqa: E402
from trl_isopo.layerwise.install import unsupported_sharding  # noqa: E402
from trl_isopo.layerwise import MethodName  # noqa: E402
from trl_isopo.proma.backward import PROMA, PROMABackward  # noqa: E402
from math_settings import proma_settings  # noqa: E402

PACKAGE = Path(__file__).resolve().parents[1] / "trl_isopo"


def test_method_name_forms_fields_and_metrics():
    name = MethodName(title="Clip", prefix="clip")
    assert name.field("lm_head") == "clip_lm_head" and name.metric("scale_mean") == "clip/scale_mean"
    assert (ISOPO.title, ISOPO.prefix, PROMA.title, PROMA.prefix) == ("ISOPO", "isopo", "PROMA", "proma")


@pytest.mark.parametrize("method", [ISOPO, PROMA])
def test_messages_name_the_method(method):
    other = "PROMA" if method is ISOPO else "ISOPO"
    for problem in (
        unsupported_sharding(method, True, False, 0, 0.0),  # FSDP1
        unsupported_sharding(method, True, True, 0, 0.04),  # FSDP2 with the KL pass
        unsupported_sharding(method, False, False, 2, 0.04),  # ZeRO-2 with the KL pass
    ):
        assert problem.startswith(method.title) and other not in problem

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(2, 3))
            self.child = nn.Linear(3, 3)

    with pytest.raises(ValueError, match=f"^{method.field('other_params')}='advantage_weighted'"):
        check_leaf_module("experts", Experts(), method)


def test_proma_coverage_metrics_and_errors_say_proma(tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_tokenizer, tmp_path, ga=2, proma_mode="both", proma_intra_dim=2)
    coverage = trainer.proma_coverage
    assert coverage["proma_layers"] > 0 and coverage["proma_params"] > 0
    assert not any("isopo" in str(k) or "isopo" in str(v) for k, v in coverage.items() if k != "covered")
    run_step(trainer, micro_batches(tiny_tokenizer, (3, 4)))
    trainer.log({})
    layer_keys = [k for k in trainer.state.log_history[-1] if "/" in k and not k.startswith(("rewards/", "clip_"))]
    assert layer_keys and all(k.startswith(("proma/", "entropy", "kl", "completions/", "sampling/")) for k in layer_keys)
    # A second install on an LM whose head is frozen, asking for the head: PROMA's own field in the error.
    backward = PROMABackward(proma_settings())
    trainer.model.lm_head.requires_grad_(False)
    with pytest.raises(ValueError, match=r"^proma_lm_head=True .* set proma_lm_head=False\.$"):
        install_layerwise(backward, trainer.model, other_params="surrogate", lm_head=True, gradient_checkpointing=False)


def test_no_message_or_key_is_rewritten_by_string():
    """The method's name is passed in, never substituted into another method's text."""
    rewrite = re.compile(r"\.replace\(\s*[\"'](?:ISOPO|PROMA|isopo|proma)")
    hits = [f"{p.relative_to(PACKAGE)}:{n}" for p in sorted(PACKAGE.rglob("*.py"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if rewrite.search(line)]
    assert not hits, hits
