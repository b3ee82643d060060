"""`trl-isopo train` and the shipped recipes: parsing, 2-step tiny runs, model card, resume, 2-process launch.

All offline: the model is the local tiny Qwen2 (trl_isopo.tiny), Reasoning Gym is procedural and GSM8K comes from
tests/fixtures/gsm8k_tiny.jsonl. Runs use the recipe unchanged except for the overrides in `tiny_overrides`. The
SmolLM2 recipes also train 2 steps on the real model (slow; `real_overrides`), converted offline by trl_isopo.models.
"""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

pytest.importorskip("reasoning_gym")

from trl_isopo.scripts import train as train_script  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "gsm8k_tiny.jsonl")
RECIPES = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "recipes", "Qwen3-*", "*", "*.yaml")))
CPU = [] if torch.cuda.is_available() else ["--use_cpu", "true"]


def _load(path):
    with open(os.path.join(ROOT, path)) as f:
        return yaml.safe_load(f)


def tiny_overrides(recipe_path, model_dir, output_dir, max_steps=2, world_size=1):
    """Command-line overrides that make a recipe a 2-step CPU run on the tiny model (nothing else changes).

    The ratio steps_per_generation / gradient_accumulation_steps (optimizer steps per rollout batch) is kept; the
    per-device batch shrinks with the world size so a generation batch needs at most 4 prompts (the GSM8K fixture
    has 6).
    """
    recipe = _load(recipe_path)
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
    args = [item for key, value in overrides.items() for item in (f"--{key}", str(value))]
    if recipe["task"] == "gsm8k":
        args += ["--dataset_name", FIXTURE, "--dataset_size", "6"]
    else:
        args += ["--dataset_size", "8"]
    return args


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    """Trainers built in one process share accelerate's singletons; reset them around each run."""
    from accelerate.state import AcceleratorState, PartialState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


def test_recipe_matrix_is_complete():
    expected = {
        f"recipes/{m}/{t}/{meth}{suffix}.yaml"
        for m in ("Qwen3-0.6B", "Qwen3-1.7B")
        for t in ("graph_color", "knights_knaves", "gsm8k")
        for meth in ("grpo", "isopo", "tpo")
        for suffix in ("", "_lora")
    }
    assert set(RECIPES) == expected
    for name in ("ddp", "zero2", "zero3", "fsdp2"):
        assert os.path.exists(os.path.join(ROOT, "recipes", "accelerate", f"{name}.yaml"))
    from accelerate.commands.config.config_args import load_config_from_file

    # accelerate's own loader (rejects unknown keys); what `accelerate launch --config_file` reads
    configs = {
        n: load_config_from_file(os.path.join(ROOT, "recipes", "accelerate", f"{n}.yaml"))
        for n in ("ddp", "zero2", "zero3", "fsdp2")
    }
    assert {n: c.distributed_type.value for n, c in configs.items()} == {
        "ddp": "MULTI_GPU",
        "zero2": "DEEPSPEED",
        "zero3": "DEEPSPEED",
        "fsdp2": "FSDP",
    }
    assert (
        configs["zero2"].deepspeed_config["zero_stage"] == 2 and configs["zero3"].deepspeed_config["zero_stage"] == 3
    )
    assert configs["fsdp2"].fsdp_config["fsdp_version"] == 2
    assert all(c.mixed_precision == "bf16" for c in configs.values())


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_parses(recipe):
    """Every recipe parses with its method's config class; names, tasks and the papers' values are as documented."""
    script_args, training_args, model_args, _ = train_script.parse_args(["--config", os.path.join(ROOT, recipe), *CPU])
    _, model, task, name = recipe.split("/")
    method, lora = name[: -len(".yaml")].removesuffix("_lora"), name.endswith("_lora.yaml")
    config_cls, _ = train_script.method_classes(method)
    assert type(training_args) is config_cls
    assert script_args.method == method and script_args.task == task
    assert model_args.model_name_or_path == f"Qwen/{model}"
    assert model_args.use_peft is lora
    if lora:
        assert model_args.lora_r == 32
    if model == "Qwen3-0.6B":  # isopo-spec §5: K=8, 1024 sequences per rollout, 2 optimizer steps of 512
        assert training_args.num_generations == 8
        assert training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps == 512
        assert training_args.generation_batch_size == 1024
    else:  # tpo-spec §4: K=16, 16 prompts x 16 = 256 sequences per step
        assert training_args.num_generations == 16
        assert training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps == 256
    expected_lr = {"isopo": 2e-6, "tpo": 1e-5, "grpo": 2e-6 if model == "Qwen3-0.6B" else 1e-5}[method]
    if lora and not (model == "Qwen3-1.7B" and task == "gsm8k" and method != "isopo"):
        expected_lr *= 10
    assert training_args.learning_rate == pytest.approx(expected_lr)
    if method == "isopo":
        assert training_args.beta == 0.0 and training_args.entropy_coef == 0.0 and not training_args.torch_compile
        assert (training_args.isopo_p, training_args.isopo_q, training_args.isopo_r, training_args.isopo_reg) == (
            0.0,
            -1.0,
            -2.0,
            0.0,
        )
    if method == "tpo":
        assert training_args.per_device_train_batch_size % training_args.num_generations == 0
        assert training_args.tpo_eta == 1.0 and training_args.tpo_anchor is True
    if model == "Qwen3-1.7B" and task == "gsm8k" and method in ("grpo", "tpo"):
        assert training_args.beta == 0.001  # tpo-spec §4: KL 1e-3 on GSM8K for both methods


def _run(recipe, tiny_model_dir, out, *extra, callbacks=None):
    argv = ["--config", os.path.join(ROOT, recipe), *tiny_overrides(recipe, tiny_model_dir, str(out)), *extra]
    return train_script.run(argv, callbacks=callbacks)


def _steps_recorder():
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.steps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

    return Recorder()


def _check_two_steps(trainer, recipe, out):
    method = _load(recipe)["method"]
    assert trainer.state.global_step == 2
    assert type(trainer).__name__ == {"grpo": "GRPOTrainer", "isopo": "ISOPOTrainer", "tpo": "TPOTrainer"}[method]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 2 and all(v == v for v in losses)  # two logged optimizer steps, no NaN
    assert os.path.exists(
        os.path.join(out, "model.safetensors" if not _load(recipe).get("use_peft") else "adapter_model.safetensors")
    )


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_two_steps(recipe, tiny_model_dir, tmp_path):
    """Every recipe, unchanged but for `tiny_overrides`, trains 2 optimizer steps and saves (about 1 s each)."""
    out = tmp_path / "out"
    trainer = _run(recipe, tiny_model_dir, out)
    _check_two_steps(trainer, recipe, str(out))


@pytest.mark.parametrize(
    "recipe",
    [
        "recipes/Qwen3-0.6B/gsm8k/grpo.yaml",
        "recipes/Qwen3-0.6B/gsm8k/isopo.yaml",
        "recipes/Qwen3-0.6B/gsm8k/tpo_lora.yaml",
    ],
)
def test_rewards_drive_the_update(recipe, tiny_model_dir, tmp_path):
    """The reward reaches the loss: a varied reward (dotted-path `tiny_reward`, rendered text prompts) gives a real
    first-step gradient; the all-zero GSM8K answer reward of the tiny model gives none (zero-variance groups)."""
    norms = {}
    for reward in ("answer", "trl_isopo.tiny.tiny_reward"):
        trainer = _run(recipe, tiny_model_dir, tmp_path / reward, "--reward_funcs", reward, "--prompt_format", "text")
        first = next(h for h in trainer.state.log_history if "loss" in h)
        norms[reward] = first["grad_norm"]
        if reward != "answer":
            assert first["reward_std"] > 0 and first["rewards/tiny_reward/mean"] > 0
        from accelerate.state import AcceleratorState, PartialState

        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()
    assert norms["answer"] < 1e-5
    assert norms["trl_isopo.tiny.tiny_reward"] > 0.1


_SMALL_EVAL = ["--eval_dataset_size", "4", "--per_device_eval_batch_size", "4", "--num_generations_eval", "2"]


def test_eval_set_is_disjoint_and_evaluated(tiny_model_dir, tmp_path):
    recipe = "recipes/Qwen3-0.6B/knights_knaves/tpo.yaml"
    evals = ["--eval_strategy", "steps", "--eval_steps", "1", *_SMALL_EVAL]
    trainer = _run(recipe, tiny_model_dir, tmp_path / "ev", *evals)
    train_q = {json.loads(e)["question"] for e in trainer.train_dataset["entry"]}
    eval_entries = [json.loads(e) for e in trainer.eval_dataset["entry"]]
    assert len(eval_entries) == 4 and not train_q & {e["question"] for e in eval_entries}
    assert len([h for h in trainer.state.log_history if "eval_reward" in h]) == 2


def test_gsm8k_eval_from_a_separate_file(tiny_model_dir, tmp_path):
    import shutil

    held_out = tmp_path / "test.jsonl"
    shutil.copy(FIXTURE, held_out)
    evals = ["--eval_strategy", "steps", "--eval_steps", "2", "--eval_dataset_name", str(held_out), *_SMALL_EVAL]
    trainer = _run("recipes/Qwen3-1.7B/gsm8k/grpo.yaml", tiny_model_dir, tmp_path / "ev", *evals)
    assert list(trainer.eval_dataset["answer"]) == ["12", "1500", "13", "2.25"]
    assert len([h for h in trainer.state.log_history if "eval_reward" in h]) == 1


# ----------------------------------------------------------------------------------------------- model card
@pytest.mark.parametrize(
    "recipe, tag, arxiv, bibkey",
    [
        ("recipes/Qwen3-0.6B/gsm8k/isopo.yaml", "isopo", "2512.23353", "abrahamsen"),
        ("recipes/Qwen3-1.7B/knights_knaves/tpo_lora.yaml", "target-policy-optimization", "2604.06159", "kaddour"),
    ],
)
def test_saved_model_card_has_tags_citation_and_command(recipe, tag, arxiv, bibkey, tiny_model_dir, tmp_path):
    from trl_isopo.cli import main as cli_main

    out = tmp_path / "card-run"
    argv = [
        "train",
        "--config",
        os.path.join(ROOT, recipe),
        *tiny_overrides(recipe, tiny_model_dir, str(out), max_steps=1),
    ]
    assert cli_main(argv) == 0
    text = (out / "README.md").read_text()
    front = yaml.safe_load(text.split("---")[1])
    assert {"trl", "trl-isopo", tag} <= set(front["tags"])
    assert "tpo" not in front["tags"]  # the Hub tag of TRL's unrelated Triple Preference Optimization
    assert f"arXiv:{arxiv}" in text and bibkey in text
    assert "## Training command" in text
    assert f"trl-isopo train --config {os.path.join(ROOT, recipe)}" in text
    assert "--max_completion_length 8" in text
    assert f"method: {_load(recipe)['method']}" in text  # the recipe itself is embedded
    assert text.count("## Training command") == 1


def test_push_to_hub_uploads_the_decorated_card(tiny_model_dir, tmp_path, monkeypatch):
    """`--push_to_hub true` end to end with transformers' Hub client replaced by a recorder (no network)."""
    import transformers.trainer

    calls = []

    class FakeHub:
        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id))
            return type("RepoUrl", (), {"repo_id": repo_id})()

        def upload_folder(self, repo_id, folder_path, **kwargs):
            calls.append(("upload_folder", repo_id, (tmp_path / "push" / "README.md").read_text()))

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: FakeHub())
    recipe = "recipes/Qwen3-1.7B/gsm8k/tpo_lora.yaml"
    trainer = _run(
        recipe, tiny_model_dir, tmp_path / "push", "--push_to_hub", "true", "--hub_model_id", "someone/tiny-tpo"
    )
    assert trainer.hub_model_id == "someone/tiny-tpo"
    # the repo is created at init; save_model (hub_strategy every_save) and the final push_to_hub both upload
    assert calls[0] == ("create_repo", "someone/tiny-tpo")
    uploads = calls[1:]
    assert len(uploads) == 2 and all(c[:2] == ("upload_folder", "someone/tiny-tpo") for c in uploads)
    for _, _, card in uploads:  # the README as it was when each upload started
        front = yaml.safe_load(card.split("---")[1])
        assert {"trl", "trl-isopo", "target-policy-optimization"} <= set(front["tags"])
        assert (
            "arXiv:2604.06159" in card and "## Training command" in card and "--hub_model_id someone/tiny-tpo" in card
        )
        assert front["model_name"] == "tiny-tpo"


def test_model_card_helpers_are_idempotent():
    from trl_isopo.model_card import decorate_card_text

    once = decorate_card_text("# card\n\nCite GRPO: 2402.03300\n", "tpo", "trl-isopo train --config x.yaml")
    twice = decorate_card_text(once, "tpo", "trl-isopo train --config y.yaml")
    assert once.count("arXiv:2604.06159") == 1 and twice.count("arXiv:2604.06159") == 1
    assert twice.count("## Training command") == 1 and "y.yaml" in twice and "x.yaml" not in twice


# ----------------------------------------------------------------------------------------------------- resume
def test_resume_from_checkpoint_continues(tiny_model_dir, tmp_path):
    recipe = "recipes/Qwen3-0.6B/gsm8k/grpo.yaml"
    out = tmp_path / "resume"
    save = ["--save_strategy", "steps", "--save_steps", "1", "--save_total_limit", "5"]
    first = _run(recipe, tiny_model_dir, out, *save)
    assert first.state.global_step == 2
    ckpt2 = out / "checkpoint-2"
    assert (ckpt2 / "trainer_state.json").exists() and (ckpt2 / "optimizer.pt").exists()
    state2 = json.loads((ckpt2 / "trainer_state.json").read_text())

    recorder = _steps_recorder()
    argv_extra = ["--max_steps", "4", "--resume_from_checkpoint", "true", *save]
    second = _run(recipe, tiny_model_dir, out, *argv_extra, callbacks=[recorder])
    assert recorder.steps == [3, 4]  # only the missing steps ran, starting after checkpoint-2
    assert second.state.global_step == 4
    state4 = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state4["log_history"][:2] == state2["log_history"][:2]  # steps 1-2 carried over from the checkpoint

    with pytest.raises(ValueError, match="is not a folder"):
        train_script.resolve_resume(str(tmp_path / "nope"))


# ------------------------------------------------------------------------------------------------ bad configs
def test_clear_errors(tiny_model_dir, tmp_path):
    recipe = os.path.join(ROOT, "recipes/Qwen3-0.6B/gsm8k/grpo.yaml")
    with pytest.raises(ValueError, match=r"Unknown argument\(s\) for `trl-isopo grpo`: \['--isopo_p'"):
        bad = tmp_path / "bad.yaml"
        bad.write_text(open(recipe).read() + "isopo_p: -1.0\n")
        train_script.parse_args(["--config", str(bad), *CPU])
    with pytest.raises(ValueError, match=r"beta \(the KL-to-reference coefficient\) must be >= 0"):
        train_script.parse_args(
            ["--config", os.path.join(ROOT, "recipes/Qwen3-0.6B/gsm8k/isopo.yaml"), "--beta", "-0.1", *CPU]
        )
    with pytest.raises(ValueError, match="multiple of"):
        train_script.parse_args(
            [
                "--config",
                os.path.join(ROOT, "recipes/Qwen3-1.7B/gsm8k/tpo.yaml"),
                "--per_device_train_batch_size",
                "24",
                *CPU,
            ]
        )
    with pytest.raises(ValueError, match="has 2 prompts but one generation batch needs 4"):
        _run("recipes/Qwen3-0.6B/gsm8k/grpo.yaml", tiny_model_dir, tmp_path / "o", "--dataset_size", "2")
    with pytest.raises(ValueError, match="single file, so it has no separate test split"):
        _run("recipes/Qwen3-0.6B/gsm8k/grpo.yaml", tiny_model_dir, tmp_path / "o", "--eval_strategy", "steps")
    with pytest.raises(ValueError, match="eval_dataset_seed=1 overlaps"):
        _run(
            "recipes/Qwen3-0.6B/graph_color/grpo.yaml",
            tiny_model_dir,
            tmp_path / "o",
            "--eval_strategy",
            "steps",
            "--eval_dataset_seed",
            "1",
            "--eval_dataset_size",
            "4",
        )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error path")
def test_qlora_on_cpu_raises_clear_error(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="needs a CUDA GPU and bitsandbytes"):
        _run("recipes/Qwen3-0.6B/gsm8k/grpo_lora.yaml", tiny_model_dir, tmp_path / "q", "--load_in_4bit", "true")


def test_tokenizer_rule(tiny_model_dir, tmp_path):
    assert train_script.is_wordlevel_tokenizer_dir(tiny_model_dir)
    tok = train_script.load_tokenizer(tiny_model_dir)
    ids = tok("count a b :")["input_ids"]
    assert len(ids) == 4 and tok.decode(ids) == "count a b :"  # AutoTokenizer would split it into characters
    bpe = tmp_path / "bpe"
    bpe.mkdir()
    (bpe / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    assert not train_script.is_wordlevel_tokenizer_dir(str(bpe))
    assert not train_script.is_wordlevel_tokenizer_dir("Qwen/Qwen3-0.6B")  # Hub ids go to AutoTokenizer


def test_method_is_read_before_parsing(tmp_path):
    assert train_script.peek_method(["--config", os.path.join(ROOT, "recipes/Qwen3-1.7B/gsm8k/tpo.yaml")]) == "tpo"
    assert (
        train_script.peek_method(
            ["--config", os.path.join(ROOT, "recipes/Qwen3-1.7B/gsm8k/tpo.yaml"), "--method", "grpo"]
        )
        == "grpo"
    )
    assert train_script.peek_method(["--method=isopo"]) == "isopo"
    assert train_script.peek_method([]) == "grpo"
    with pytest.raises(ValueError, match="Unknown method 'ppo'"):
        train_script.method_classes("ppo")


# ------------------------------------------------------------------------------------------- two processes
def _launch_module_two_processes(*args, timeout=900):
    """Like tests/_launch.py, but runs `-m trl_isopo.cli train ...` (the documented accelerate form)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_port",
        str(29600 + os.getpid() % 1000),
        "-m",
        "trl_isopo.cli",
        "train",
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if proc.returncode != 0:
        raise AssertionError(
            f"2-process run failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "recipe", ["recipes/Qwen3-0.6B/gsm8k/isopo.yaml", "recipes/Qwen3-1.7B/knights_knaves/tpo.yaml"]
)
def test_recipe_two_processes(recipe, tiny_model_dir, tmp_path):
    out = tmp_path / "ddp"
    args = [
        "--config",
        recipe,
        *tiny_overrides(recipe, tiny_model_dir, str(out), world_size=2),
        "--save_strategy",
        "steps",
        "--save_steps",
        "2",
        "--use_cpu",
        "true",  # without it, on a machine with no GPU, each process trains alone (world size 1)
    ]
    proc = _launch_module_two_processes(*args)
    assert "Training completed (2 process(es), 2 steps)." in proc.stdout
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    logged = [h for h in state["log_history"] if "loss" in h]
    assert len(logged) == 2
    card = (out / "README.md").read_text()
    assert "Launched on 2 processes (MULTI_CPU) with `accelerate launch`." in card


# ------------------------------------------------------------------------------------- SmolLM2 (real model) recipes
SMOLLM2_RECIPES = sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "recipes", "SmolLM2-135M-Instruct", "*", "*.yaml"))
)
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_smollm2_recipe_matrix_is_complete():
    assert SMOLLM2_RECIPES == sorted(
        f"recipes/SmolLM2-135M-Instruct/chain_sum/{m}{s}.yaml" for m in ("grpo", "isopo", "tpo") for s in ("", "_lora")
    )


@pytest.mark.parametrize("recipe", SMOLLM2_RECIPES)
def test_smollm2_recipe_parses(recipe):
    """CPU-sized values on the real model alias; parsing does not touch the model (no conversion)."""
    script_args, training_args, model_args, _ = train_script.parse_args(["--config", os.path.join(ROOT, recipe), *CPU])
    method, lora = os.path.basename(recipe)[: -len(".yaml")].removesuffix("_lora"), recipe.endswith("_lora.yaml")
    assert type(training_args) is train_script.method_classes(method)[0]
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


@pytest.mark.parametrize("recipe", SMOLLM2_RECIPES)
def test_smollm2_recipe_runs_two_steps_on_the_tiny_model(recipe, tiny_model_dir, tmp_path):
    """The recipe's data/reward/method settings, unchanged but for `tiny_overrides` (about 1 s each)."""
    out = tmp_path / "out"
    trainer = _run(recipe, tiny_model_dir, out)
    _check_two_steps(trainer, recipe, str(out))
    assert [f.__name__ for f in trainer.reward_funcs] == ["reasoning_gym_last_number"]


def real_overrides(output_dir):
    """Small sizes for 2 optimizer steps on the real model: 2 prompts x 4 completions of 8 tokens per step."""
    return [
        "--output_dir", output_dir, "--max_steps", "2", "--per_device_train_batch_size", "8",
        "--num_generations", "4", "--gradient_accumulation_steps", "1", "--steps_per_generation", "1",
        "--max_completion_length", "8", "--dataset_size", "8", "--save_strategy", "no", "--logging_steps", "1",
        "--report_to", "none", "--disable_tqdm", "true", *CPU,
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("recipe", SMOLLM2_RECIPES)
def test_smollm2_recipe_runs_two_steps_on_the_real_model(recipe, smollm2_dir, tmp_path):
    """Each SmolLM2 recipe as shipped (`model_name_or_path: smollm2`, resolved to the cached conversion) trains 2
    steps with smaller batches; the saved model/adapter and card are written (about 30-60 s each on 2 cores)."""
    out = tmp_path / "out"
    trainer = train_script.run(["--config", os.path.join(ROOT, recipe), *real_overrides(str(out))])
    _check_two_steps(trainer, recipe, str(out))
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
