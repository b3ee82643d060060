"""`PROMAConfig`: defaults, documentation of every knob, and the refusals with their messages."""

import dataclasses

import pytest

from math_settings import proma_settings
from trl_isopo.proma.config import PROMAConfig


def make(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", gradient_accumulation_steps=4)
    base.update(kw)
    return PROMAConfig(**base)


def test_defaults_docs_and_settings(tmp_path):
    args = make(tmp_path)
    names = [f.name for f in dataclasses.fields(PROMAConfig) if f.name.startswith("proma_")]
    assert len(names) == 15
    for f in dataclasses.fields(PROMAConfig):
        if f.name.startswith("proma_"):
            assert f.metadata.get("help"), f.name
            assert f.name in PROMAConfig.__doc__, f.name
    assert args.loss_type == "bnpo"
    s = args.proma_settings()
    assert s == proma_settings(budget_bytes=256 * 2**20)
    assert (s.mode, s.shrinkage, s.ridge, s.solver, s.sweeps, s.relative_bound) == ("accumulation", 1.0, 1e-2,
                                                                                   "solve", 2, None)
    assert (s.intra_dim, s.intra_power_iters, s.intra_shrinkage, s.intra_target) == (30, 1, 1.0, "microbatch")
    both = make(tmp_path, proma_mode="both", proma_intra_dim=10, proma_intra_target="accumulated",
                proma_relative_bound=0.5, proma_skip_fraction=0.5).proma_settings()
    assert both.intra and both.accumulation and both.intra_dim == 10 and both.relative_bound == 0.5


@pytest.mark.parametrize("kw,message", [
    (dict(proma_mode="sideways"), "proma_mode must be one of"),
    (dict(proma_shrinkage=-0.1), "proma_shrinkage must be in \\[0, 2\\]"),
    (dict(proma_mode="both", proma_intra_shrinkage=2.5), "proma_intra_shrinkage must be in"),
    (dict(proma_ridge=0.0), "proma_ridge must be a finite number > 0"),
    (dict(proma_relative_bound=-1.0), "proma_relative_bound must be None"),
    (dict(proma_skip_fraction=1.0), "proma_skip_fraction must be in \\[0, 1\\)"),
    (dict(proma_skip_fraction=0.9), "skips all 4 micro-batches"),
    (dict(proma_mode="both", proma_intra_dim=0), "proma_intra_dim must be >= 1"),
    (dict(proma_mode="intra", proma_shrinkage=0.5), "only apply to the accumulation variant"),
    (dict(proma_intra_dim=10), "only apply to the intra variant"),
    (dict(proma_solver="gram_schmidt", proma_ridge=0.1), "proma_ridge applies to proma_solver='solve' only"),
    (dict(proma_gs_sweeps=3), "proma_gs_sweeps applies to proma_solver='gram_schmidt' only"),
    (dict(gradient_accumulation_steps=1), "raise gradient_accumulation_steps"),
    (dict(gradient_accumulation_steps=1, proma_mode="intra", proma_intra_target="accumulated"),
     "raise gradient_accumulation_steps"),
    (dict(loss_type="cispo"), "ratio transform PROMA does not use"),
    (dict(epsilon=0.3), "PROMA does not clip"),
    (dict(delta=2.0), "set delta=None"),
    (dict(importance_sampling_level="sequence"), "leave it at 'token'"),
    (dict(entropy_coef=0.01), "entropy bonus"),
    (dict(top_entropy_quantile=0.5), "top_entropy_quantile"),
    (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold=None"),
    (dict(use_liger_kernel=True), "use_liger_kernel=False"),
    (dict(proma_other_params="sometimes"), "proma_other_params must be one of"),
])
def test_refusals_say_what_to_change(tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        make(tmp_path, **kw)


def test_intra_on_the_micro_batch_needs_no_accumulation(tmp_path):
    args = make(tmp_path, gradient_accumulation_steps=1, proma_mode="intra", proma_intra_dim=10)
    assert args.proma_settings().intra and not args.proma_settings().accumulation
