"""Every setting named once: the math settings have no defaults, one builder per method turns a config into them,
and the rules ISOPO and PROMA share are the same rules for both."""

import dataclasses

import pytest

from math_settings import ISOPO_BASE, PROMA_BASE, isopo_settings, proma_settings
from trl_isopo import ISOPOConfig, PROMAConfig
from trl_isopo.isopo.isopo_backward import ISOPOSettings
from trl_isopo.proma.projection import PROMASettings

COMMON = dict(use_cpu=True, report_to="none", gradient_accumulation_steps=2)

# A value other than the default for every config field a math setting comes from.
ISOPO_CHANGES = dict(isopo_p=0.0, isopo_q=-1.0, isopo_r=0.0, isopo_reg=2.0, isopo_reg_reference="ema_median",
                     isopo_reg_ema_decay=0.5, isopo_fisher_tokens=7, isopo_route="gram", isopo_chunk_mb=1.0, seed=3)
PROMA_CHANGES = dict(proma_mode="both", proma_shrinkage=0.5, proma_ridge=0.1, proma_relative_bound=0.2,
                     proma_intra_dim=4, proma_intra_power_iters=2, proma_intra_shrinkage=0.7,
                     proma_intra_target="accumulated", proma_route="mat", proma_chunk_mb=1.0)


@pytest.mark.parametrize("cls", [ISOPOSettings, PROMASettings])
def test_settings_have_no_defaults(cls):
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(cls))
    with pytest.raises(TypeError):
        cls()


def test_isopo_builder_reads_every_field(tmp_path):
    default = ISOPOConfig(output_dir=str(tmp_path), **COMMON).isopo_settings()
    # The tests' base differs from the config's defaults in reg alone (c = 1, see tests/math_settings.py).
    assert default == isopo_settings(reg=0.0, seed=42)  # 42: TrainingArguments' seed
    changed = ISOPOConfig(output_dir=str(tmp_path), **COMMON, **ISOPO_CHANGES).isopo_settings()
    assert changed == isopo_settings(p=0.0, q=-1.0, r=0.0, reg=2.0, reg_reference="ema_median", ema_decay=0.5,
                                     fisher_tokens=7, route="gram", budget_bytes=2**20, seed=3)
    interacting = ISOPOConfig(output_dir=str(tmp_path), **COMMON, isopo_interacting=True,
                              isopo_interacting_reg=2.5).isopo_settings()
    assert (interacting.interacting, interacting.interacting_reg) == (True, 2.5)
    assert set(ISOPO_BASE) == {f.name for f in dataclasses.fields(ISOPOSettings)}


def test_proma_builder_reads_every_field(tmp_path):
    assert PROMAConfig(output_dir=str(tmp_path), **COMMON).proma_settings() == proma_settings()
    changed = PROMAConfig(output_dir=str(tmp_path), **COMMON, **PROMA_CHANGES).proma_settings()
    assert changed == proma_settings(mode="both", shrinkage=0.5, ridge=0.1, relative_bound=0.2, intra_dim=4,
                                     intra_power_iters=2, intra_shrinkage=0.7, intra_target="accumulated",
                                     route="mat", budget_bytes=2**20)
    gs = PROMAConfig(output_dir=str(tmp_path), **COMMON, proma_solver="gram_schmidt", proma_gs_sweeps=3)
    assert (gs.proma_settings().solver, gs.proma_settings().sweeps) == ("gram_schmidt", 3)
    assert set(PROMA_BASE) == {f.name for f in dataclasses.fields(PROMASettings)}


@pytest.mark.parametrize("bad,message", [
    (dict(loss_type="cispo"), "loss_type='cispo' is a ratio transform {m} does not use"),
    (dict(epsilon=0.3), "epsilon=0.3 has no effect: {m} does not clip"),
    (dict(delta=2.0), "{m} has no importance ratio to clip: set delta=None"),
    (dict(importance_sampling_level="sequence"), "leave it at 'token'"),
    (dict(off_policy_mask_threshold=0.5), "{m} has no pi_old ratio to mask"),
    (dict(torch_compile=True), "{m}'s per-layer autograd Function does not compile"),
    (dict(beta=-1.0), "beta .* must be >= 0"),
])
@pytest.mark.parametrize("cls,method", [(ISOPOConfig, "ISOPO"), (PROMAConfig, "PROMA")])
def test_shared_rules_are_one_rule(tmp_path, cls, method, bad, message):
    with pytest.raises(ValueError, match=message.format(m=method)):
        cls(output_dir=str(tmp_path), **COMMON, **bad)


def test_the_entropy_bonus_is_the_one_difference(tmp_path):
    """ISOPO takes TRL's entropy bonus (and the high-entropy token mask); PROMA refuses both."""
    for bad in (dict(entropy_coef=0.01), dict(use_adaptive_entropy=True), dict(top_entropy_quantile=0.5)):
        ISOPOConfig(output_dir=str(tmp_path), **COMMON, **bad)
        with pytest.raises(ValueError, match="PROMA does not support"):
            PROMAConfig(output_dir=str(tmp_path), **COMMON, **bad)
