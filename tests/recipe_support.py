"""Shared by the recipe tests (tests/test_recipes.py, tests/test_recipes_smollm2.py, tests/test_qlora.py): the recipes,
the overrides that make one a 2-step CPU run on the tiny offline model (or on the real model), and the checks of such a
run."""

import glob
import os

import pytest
import torch
import yaml

from trl_isopo.scripts import train as train_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "gsm8k_tiny.jsonl")
RECIPES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "recipes", "Qwen3-*", "*", "*.yaml")))
CPU = [] if torch.cuda.is_available() else ["--use_cpu", "true"]


def load_recipe(path):
    with open(os.path.join(ROOT, path)) as f:
        return yaml.safe_load(f)


def tiny_overrides(recipe_path, model_dir, output_dir, max_steps=2, world_size=1):
    """Command-line overrides that make a recipe a 2-step CPU run on the tiny model (nothing else changes).

    The ratio steps_per_generation / gradient_accumulation_steps (optimizer steps per rollout batch) is kept; the
    per-device batch shrinks with the world size so a generation batch needs at most 4 prompts (the GSM8K fixture
    has 6).
    """
    recipe = load_recipe(recipe_path)
    ga = recipe.get("gradient_accumulation_steps", 1)
    spg = recipe.get("steps_per_generation") or ga
    overrides = {
        "model_name_or_path": model_dir,
        "output_dir": output_dir,
        "max_steps": max_steps,
        "per_device_train_batch_size": 4 // world_size,
        "num_generations": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_generation": max(1, spg // ga),
        "max_completion_length": 8,
        "use_vllm": "false",
        "bf16": "false",
        "dtype": "float32",
        "report_to": "none",
        "save_strategy": "no",
        "logging_steps": 1,
        "disable_tqdm": "true",
    }
    if recipe.get("method") == "proma":
        # Accumulation PROMA needs earlier micro-batches to project (GA >= 2): 2 micro-batches of 2 per step.
        overrides |= {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
                      "steps_per_generation": 2 * max(1, spg // ga)}
    args = [item for key, value in overrides.items() for item in (f"--{key}", str(value))]
    if recipe["task"] == "gsm8k":
        args += ["--dataset_name", FIXTURE, "--dataset_size", "6"]
    else:
        args += ["--dataset_size", "8"]
    return args


def real_overrides(output_dir, method=None):
    """Small sizes for 2 optimizer steps on the real model: 2 prompts x 4 completions of 8 tokens per step (for
    PROMA in 2 micro-batches of 4, so that accumulation has an earlier micro-batch to project)."""
    micro, ga = (4, 2) if method == "proma" else (8, 1)
    return [
        "--output_dir", output_dir, "--max_steps", "2", "--per_device_train_batch_size", str(micro),
        "--num_generations", "4", "--gradient_accumulation_steps", str(ga), "--steps_per_generation", str(ga),
        "--max_completion_length", "8", "--dataset_size", "8", "--save_strategy", "no", "--logging_steps", "1",
        "--report_to", "none", "--disable_tqdm", "true", *CPU,
    ]  # fmt: skip


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Trainers built in one process share accelerate's singletons; reset them around each run."""
    from accelerate.state import AcceleratorState, PartialState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def run_recipe(recipe, tiny_model_dir, out, *extra, callbacks=None):
    argv = ["--config", os.path.join(ROOT, recipe), *tiny_overrides(recipe, tiny_model_dir, str(out)), *extra]
    return train_script.run(argv, callbacks=callbacks)


def steps_recorder():
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    return Recorder()


def check_two_steps(trainer, recipe, out):
    method = load_recipe(recipe)["method"]
    assert trainer.state.global_step == 2
    assert type(trainer).__name__ == {"grpo": "GRPOTrainer", "isopo": "ISOPOTrainer", "proma": "PROMATrainer", "tpo": "TPOTrainer"}[method]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(v == v for v in losses)  # two logged optimizer steps, no NaN
    assert os.path.exists(
        os.path.join(out, "model.safetensors" if not load_recipe(recipe).get("use_peft") else "adapter_model.safetensors")
    )
