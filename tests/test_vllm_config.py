"""`use_vllm=True` needs no extra flag: the three configs default TRL's vLLM importance-sampling correction to off
(TRL's own default is on) and refuse it when asked for, naming the field. None of the three methods has an
importance ratio for the correction's truncated pi_train / pi_vLLM weight to act on (docs/grpo-config.md)."""

import dataclasses

import pytest
from trl import GRPOConfig

from trl_isopo import ISOPOConfig, PROMAConfig, TPOConfig

CONFIGS = [ISOPOConfig, TPOConfig, PROMAConfig]


def build(cls, tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=4,
                num_generations=4, gradient_accumulation_steps=4)
    base.update(kw)
    return cls(**base)


def default_of(cls, name):
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def test_trl_default_is_on():
    """The override matters only while TRL's own default is True; if TRL flips it, this test says so."""
    assert default_of(GRPOConfig, "vllm_importance_sampling_correction") is True


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_use_vllm_constructs_without_extra_flags(cls, tmp_path):
    args = build(cls, tmp_path, use_vllm=True, vllm_mode="colocate")
    assert args.use_vllm and args.vllm_importance_sampling_correction is False
    assert default_of(cls, "vllm_importance_sampling_correction") is False


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_correction_requested_is_refused_with_the_fix(cls, tmp_path):
    with pytest.raises(ValueError, match=r"vllm_importance_sampling_correction=True`? is not supported"):
        build(cls, tmp_path, use_vllm=True, vllm_importance_sampling_correction=True)


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_correction_field_is_documented(cls):
    field = next(f for f in dataclasses.fields(cls) if f.name == "vllm_importance_sampling_correction")
    assert "True is refused" in field.metadata["help"]
