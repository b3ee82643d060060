"""TPOConfig and TPOTrainer construction: option guards, whole-group batching and shuffling, names, tags, the TRL
hooks the trainer relies on."""

import warnings
from pathlib import Path

import pytest
import torch
from tpo_support import base_args

from trl_isopo import TPOConfig, TPOTrainer
from trl_isopo.tiny import tiny_prompt_dataset, tiny_reward
from trl_isopo.tpo.config import tpo_unsupported_options
from trl_isopo.tpo.grouping import check_whole_groups, shuffle_groups


# ================================================================================================ config guards
def test_config_fields_defaults_and_docs():
    fields = TPOConfig.__dataclass_fields__
    assert fields["tpo_eta"].default == 1.0
    assert fields["tpo_anchor"].default is True
    assert fields["tpo_length_normalize"].default is False
    for name in ("tpo_eta", "tpo_anchor", "tpo_length_normalize"):
        assert fields[name].metadata["help"]
        assert name in TPOConfig.__doc__.split("Parameters:")[1]


@pytest.mark.parametrize("eta", [0.0, -0.5, float("nan")])
def test_config_rejects_nonpositive_eta(tmp_path, eta):
    with pytest.raises(ValueError, match="tpo_eta"):
        base_args(tmp_path, tpo_eta=eta)


def test_config_rejects_fewer_than_two_generations(tmp_path):
    with pytest.raises(ValueError, match="num_generations >= 2"):
        base_args(tmp_path, num_generations=1, per_device_train_batch_size=8)


def test_config_accepts_split_groups_only_inside_one_optimizer_step(tmp_path):
    # Every use of a generation batch inside one optimizer step: accepted (tests/test_tpo_split_groups.py).
    base_args(tmp_path, per_device_train_batch_size=6, num_generations=4, gradient_accumulation_steps=2)
    base_args(tmp_path, per_device_train_batch_size=6, num_generations=4, gradient_accumulation_steps=2,
              num_iterations=2)
    with pytest.raises(ValueError) as err:
        base_args(tmp_path, per_device_train_batch_size=6, num_generations=4, gradient_accumulation_steps=2,
                  steps_per_generation=4)
    msg = str(err.value)
    assert "per_device_train_batch_size" in msg and "(4, 8, 12, ...)" in msg and "[2, 3, 6]" in msg


@pytest.mark.parametrize(
    "option",
    [
        {"off_policy_mask_threshold": 0.5},
        {"loss_type": "cispo"},
        {"epsilon": 0.3},
        {"epsilon_high": 0.28},
        {"delta": 2.0},
        {"importance_sampling_level": "sequence", "loss_type": "grpo"},
        {"use_vllm": True, "vllm_importance_sampling_correction": True},
    ],
)
def test_config_rejects_options_tpo_cannot_honour(tmp_path, option):
    """(Options TPO gives a meaning to, entropy bonus, top_entropy_quantile, scale_rewards, ...: test_tpo_options.py.)"""
    name = next(iter(option)) if "loss_type" not in option or len(option) == 1 else "importance_sampling_level"
    if "use_vllm" in option:
        name = "vllm_importance_sampling_correction"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # loss_type="grpo" alone is accepted with a warning
        with pytest.raises(ValueError, match=name):
            base_args(tmp_path, **option)


def test_vllm_allowed_without_is_correction(tmp_path):
    """vLLM generation is accepted (the config builds) once its importance-sampling correction is off, and that flag
    alone decides it."""
    args = base_args(tmp_path, use_vllm=True, vllm_importance_sampling_correction=False)
    assert tpo_unsupported_options(args) == []
    args.vllm_importance_sampling_correction = True
    (problem,) = tpo_unsupported_options(args)
    assert "vllm_importance_sampling_correction" in problem


# ================================================================================================ grouping helpers
def test_shuffle_groups_permutes_whole_blocks():
    K, G = 3, 5
    batch = {
        "ids": torch.arange(G * K)[:, None].repeat(1, 2),
        "names": [f"row{i}" for i in range(G * K)],
        "n": torch.tensor(7),
        "none": None,
    }
    seen = set()
    for seed in range(6):
        out = shuffle_groups(batch, K, generator=torch.Generator().manual_seed(seed))
        rows = out["ids"][:, 0]
        blocks = rows.view(G, K)
        assert torch.equal(blocks - blocks[:, :1], torch.arange(K).expand(G, K))  # consecutive rows of one group
        assert (blocks[:, 0] % K == 0).all()
        assert sorted(rows.tolist()) == list(range(G * K))
        assert out["names"] == [f"row{i}" for i in rows.tolist()]
        assert out["n"] is batch["n"] and out["none"] is None
        seen.add(tuple(blocks[:, 0].tolist()))
    assert len(seen) > 1  # it does shuffle
    with pytest.raises(ValueError, match="multiple"):
        shuffle_groups({"x": torch.zeros(7)}, 3)


def test_check_whole_groups_detects_a_split():
    ids = torch.tensor([[1, 2]] * 4 + [[3, 4]] * 4)
    check_whole_groups(ids, torch.ones_like(ids), 4)
    with pytest.raises(RuntimeError, match="split"):
        check_whole_groups(ids[[0, 1, 2, 4, 3, 5, 6, 7]], None, 4)
    with pytest.raises(RuntimeError, match="whole groups"):
        check_whole_groups(ids[:6], None, 4)


# ================================================================================================ construction
def test_default_config_names_tags_and_model_card(tiny_model_dir, tiny_tokenizer, tmp_path, monkeypatch):
    from dataclasses import dataclass

    @dataclass
    class CPUDefaults(TPOConfig):  # TRL's defaults ask for bf16 on an accelerator; this machine has none
        use_cpu: bool = True
        bf16: bool = False
        report_to: str = "none"

    monkeypatch.setattr(TPOTrainer, "config_class", CPUDefaults)  # the class of the default config
    monkeypatch.chdir(tmp_path)
    trainer = TPOTrainer(
        tiny_model_dir, tiny_reward, train_dataset=tiny_prompt_dataset(8), processing_class=tiny_tokenizer
    )
    assert isinstance(trainer.args, TPOConfig) and trainer.args.output_dir.endswith("-TPO")
    assert trainer.args.tpo_eta == 1.0 and trainer.args.tpo_anchor and not trainer.args.tpo_length_normalize
    assert TPOTrainer._tag_names == ["trl", "trl-isopo", "target-policy-optimization"]
    assert TPOTrainer._name == "Target Policy Optimization" and TPOTrainer._paper["id"] == "2604.06159"
    assert "trl.experimental.tpo" in TPOTrainer.__doc__ and "Triple" in TPOTrainer.__doc__
    trainer.create_model_card()
    card = (Path(trainer.args.output_dir) / "README.md").read_text()
    assert "Target Policy Optimization" in card and "2604.06159" in card and "target-policy-optimization" in card
    assert "- tpo\n" not in card and "DeepSeekMath" not in card


def test_trainer_rejects_bad_args(tiny_model_dir, tiny_tokenizer, tmp_path):
    from trl import GRPOConfig

    common = dict(train_dataset=tiny_prompt_dataset(8), processing_class=tiny_tokenizer)
    grpo_args = GRPOConfig(
        output_dir=str(tmp_path / "g"), report_to="none", use_cpu=True, per_device_train_batch_size=8,
        num_generations=4,
    )
    with pytest.raises(TypeError, match="TPOConfig"):
        TPOTrainer(tiny_model_dir, tiny_reward, args=grpo_args, **common)
    args = base_args(tmp_path, steps_per_generation=2)
    args.per_device_train_batch_size = 6  # changed after __post_init__
    with pytest.raises(ValueError, match="multiple of num_generations"):
        TPOTrainer(tiny_model_dir, tiny_reward, args=args, **common)
    args = base_args(tmp_path)
    args.epsilon = 0.5
    with pytest.raises(ValueError, match="epsilon"):
        TPOTrainer(tiny_model_dir, tiny_reward, args=args, **common)

