"""The CPU recipes of the real model (SmolLM2-135M-Instruct on Reasoning Gym chain_sum): parsing, 2 steps on the tiny
offline model, 2 steps on the real model (slow), and their last-number reward."""

import glob
import json
import os

import pytest
import torch

pytest.importorskip("reasoning_gym")

from recipe_support import (  # noqa: E402
    CPU,
    ROOT,
    check_two_steps,
    fresh_accelerate_state,  # noqa: F401  (autouse)
    real_overrides,
    run_recipe,
)

from trl_isopo.scripts import train as train_script  # noqa: E402
from trl_isopo.scripts import train_args  # noqa: E402

SMOLLM2_RECIPES = sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "recipes", "SmolLM2-135M-Instruct", "*", "*.yaml"))
)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_smollm2_recipe_matrix_is_complete():
    assert SMOLLM2_RECIPES == sorted(
        f"recipes/SmolLM2-135M-Instruct/chain_sum/{m}{s}.yaml" for m in ("grpo", "isopo", "proma", "tpo") for s in ("", "_lora")
    )


@pytest.mark.parametrize("recipe", SMOLLM2_RECIPES)
def test_smollm2_recipe_parses(recipe):
    """CPU-sized values on the real model alias; parsing does not touch the model (no conversion)."""
    script_args, training_args, model_args, _ = train_args.parse_args(["--config", os.path.join(ROOT, recipe), *CPU])
    method, lora = os.path.basename(recipe)[: -len(".yaml")].removesuffix("_lora"), recipe.endswith("_lora.yaml")
    assert type(training_args) is train_args.method_classes(method)[0]
    assert model_args.model_name_or_path == "smollm2" and script_args.tokenizer_name_or_path is None
    assert model_args.dtype == "float32" and not training_args.bf16 and not training_args.gradient_checkpointing
    assert script_args.task == "chain_sum" and script_args.reward_funcs == ["last_number"]
    assert script_args.task_config == {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    assert script_args.system_prompt == "Answer with the final number."
    assert training_args.num_generations == 8 and training_args.max_completion_length == 32
    assert training_args.temperature == 0.7 and not training_args.use_vllm
    assert training_args.per_device_train_batch_size % training_args.num_generations == 0  # whole groups
    assert model_args.use_peft is lora
    if lora:
        assert model_args.lora_r == 16 and sorted(model_args.lora_target_modules) == sorted(ALL_LINEAR)
    assert training_args.learning_rate == pytest.approx(1e-4 if lora else 1e-5)
    assert training_args.beta == 0.0
    if method == "isopo":
        knobs = (training_args.isopo_p, training_args.isopo_q, training_args.isopo_r, training_args.isopo_reg)
        assert knobs == (0.0, -1.0, -2.0, 0.0)
    if method == "tpo":
        assert training_args.tpo_eta == 1.0 and training_args.tpo_anchor is True
    if method == "proma":  # PROMA's schedule: 2 optimizer steps per rollout, each over 4 micro-batches
        assert training_args.proma_mode == "accumulation" and training_args.gradient_accumulation_steps == 4
        assert training_args.steps_per_generation == 2 * training_args.gradient_accumulation_steps
        assert (training_args.proma_shrinkage, training_args.proma_ridge) == (1.0, 0.01)


@pytest.mark.parametrize("recipe", SMOLLM2_RECIPES)
def test_smollm2_recipe_runs_two_steps_on_the_tiny_model(recipe, tiny_model_dir, tmp_path):
    """The recipe's data/reward/method settings, unchanged but for `tiny_overrides` (about 1 s each)."""
    out = tmp_path / "out"
    trainer = run_recipe(recipe, tiny_model_dir, out)
    check_two_steps(trainer, recipe, str(out))
    assert [f.__name__ for f in trainer.reward_funcs] == ["reasoning_gym_last_number"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", SMOLLM2_RECIPES)
def test_smollm2_recipe_runs_two_steps_on_the_real_model(recipe, smollm2_dir, tmp_path):
    """Each SmolLM2 recipe as shipped (`model_name_or_path: smollm2`, resolved to the cached conversion) trains 2
    steps with smaller batches; the saved model/adapter and card are written (about 30-60 s each on 2 cores)."""
    out = tmp_path / "out"
    method = os.path.basename(recipe)[: -len(".yaml")].removesuffix("_lora")
    trainer = train_script.run(["--config", os.path.join(ROOT, recipe), *real_overrides(str(out), method)])
    check_two_steps(trainer, recipe, str(out))
    assert trainer.model.config.num_hidden_layers == 30 and trainer.processing_class.name_or_path == smollm2_dir
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert "trl-isopo train --config" in (out / "README.md").read_text()


def test_last_number_reward():
    """The SmolLM2 recipes' reward: chain_sum's own score on the completion's last number (0.0 without one)."""
    from trl_isopo import gym

    assert [gym.extract_last_number(t) for t in ("23 + 45 = 68.", "is -1,200.5", "15-43", "= -28", "none")] == [
        "68", "-1200.5", "43", "-28", None,
    ]  # fmt: skip
    procedural = gym.make_procedural_dataset(
        "chain_sum", size=2, seed=0, task_config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    )
    rows = gym.build_reasoning_gym_dataset(procedural, system_prompt="none")
    entry = rows["entry"][0]
    gold = json.loads(entry)["answer"]
    reward = gym.ReasoningGymLastNumberReward(procedural)
    conversational = [{"role": "assistant", "content": gold}]
    completions = [f"The answer is {gold}.", f"{gold} or maybe 1000", "no idea", conversational]
    assert reward(completions, entry=[entry] * 4) == [1.0, 0.0, 0.0, 1.0]
    assert gym.gsm8k_last_number_reward(["so 1,200 total", "12"], answer=["#### 1200", "13"]) == [1.0, 0.0]
