"""`trl-isopo train` and the shipped recipes: parsing, 2-step tiny runs, model card, resume, 2-process launch.

All offline: the model is the local tiny Qwen2 (trl_isopo.tiny), Reasoning Gym is procedural and GSM8K comes from
tests/fixtures/gsm8k_tiny.jsonl. Runs use the recipe unchanged except for the overrides in `tiny_overrides`. The
SmolLM2 recipes also train 2 steps on the real model (slow; `real_overrides`), converted offline by trl_isopo.models.
"""

import json
import os
import subprocess
import sys

import pytest
import yaml

pytest.importorskip("reasoning_gym")

from recipe_support import (  # noqa: E402
    CPU,
    FIXTURE,
    RECIPES,
    ROOT,
    check_two_steps,
    fresh_accelerate_state,  # noqa: F401  (autouse)
    load_recipe,
    run_recipe,
    steps_recorder,
    tiny_overrides,
)

from trl_isopo.scripts import train as train_script  # noqa: E402
from trl_isopo.scripts import train_args  # noqa: E402

def test_recipe_matrix_is_complete():
    expected = {
        f"recipes/{m}/{t}/{meth}{suffix}.yaml"
        for m in ("Qwen3-0.6B", "Qwen3-1.7B")
        for t in ("graph_color", "knights_knaves", "gsm8k")
        for meth in ("grpo", "isopo", "tpo")
        for suffix in ("", "_lora")
    }
    expected.add("recipes/Qwen3-0.6B/gsm8k/proma.yaml")  # the PROMA reference's run (arXiv 2601.10498)
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
    script_args, training_args, model_args, _ = train_args.parse_args(["--config", os.path.join(ROOT, recipe), *CPU])
    _, model, task, name = recipe.split("/")
    method, lora = name[: -len(".yaml")].removesuffix("_lora"), name.endswith("_lora.yaml")
    config_cls, _ = train_args.method_classes(method)
    assert type(training_args) is config_cls
    assert script_args.method == method and script_args.task == task
    assert model_args.model_name_or_path == f"Qwen/{model}"
    assert model_args.use_peft is lora
    if lora:
        assert model_args.lora_r == 32
    if model == "Qwen3-0.6B":  # the ISOPO run (docs/recipes.md): K=8, 1024 sequences per rollout, 2 optimizer steps of 512
        assert training_args.num_generations == 8
        assert training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps == 512
        assert training_args.generation_batch_size == 1024
    else:  # the TPO run (docs/recipes.md): K=16, 16 prompts x 16 = 256 sequences per step
        assert training_args.num_generations == 16
        assert training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps == 256
    expected_lr = {"isopo": 2e-6, "proma": 2e-6, "tpo": 1e-5, "grpo": 2e-6 if model == "Qwen3-0.6B" else 1e-5}[method]
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
        assert training_args.beta == 0.001  # the TPO run: KL 1e-3 on GSM8K for both methods


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_two_steps(recipe, tiny_model_dir, tmp_path):
    """Every recipe, unchanged but for `tiny_overrides`, trains 2 optimizer steps and saves (about 1 s each)."""
    out = tmp_path / "out"
    trainer = run_recipe(recipe, tiny_model_dir, out)
    check_two_steps(trainer, recipe, str(out))


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
        trainer = run_recipe(recipe, tiny_model_dir, tmp_path / reward, "--reward_funcs", reward, "--prompt_format", "text")
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
    trainer = run_recipe(recipe, tiny_model_dir, tmp_path / "ev", *evals)
    train_q = {json.loads(e)["question"] for e in trainer.train_dataset["entry"]}
    eval_entries = [json.loads(e) for e in trainer.eval_dataset["entry"]]
    assert len(eval_entries) == 4 and not train_q & {e["question"] for e in eval_entries}
    assert len([h for h in trainer.state.log_history if "eval_reward" in h]) == 2


def test_gsm8k_eval_from_a_separate_file(tiny_model_dir, tmp_path):
    import shutil

    held_out = tmp_path / "test.jsonl"
    shutil.copy(FIXTURE, held_out)
    evals = ["--eval_strategy", "steps", "--eval_steps", "2", "--eval_dataset_name", str(held_out), *_SMALL_EVAL]
    trainer = run_recipe("recipes/Qwen3-1.7B/gsm8k/grpo.yaml", tiny_model_dir, tmp_path / "ev", *evals)
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
    assert f"method: {load_recipe(recipe)['method']}" in text  # the recipe itself is embedded
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
    trainer = run_recipe(
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
    first = run_recipe(recipe, tiny_model_dir, out, *save)
    assert first.state.global_step == 2
    ckpt2 = out / "checkpoint-2"
    assert (ckpt2 / "trainer_state.json").exists() and (ckpt2 / "optimizer.pt").exists()
    state2 = json.loads((ckpt2 / "trainer_state.json").read_text())

    recorder = steps_recorder()
    argv_extra = ["--max_steps", "4", "--resume_from_checkpoint", "true", *save]
    second = run_recipe(recipe, tiny_model_dir, out, *argv_extra, callbacks=[recorder])
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
        train_args.parse_args(["--config", str(bad), *CPU])
    with pytest.raises(ValueError, match=r"beta \(the KL-to-reference coefficient\) must be >= 0"):
        train_args.parse_args(
            ["--config", os.path.join(ROOT, "recipes/Qwen3-0.6B/gsm8k/isopo.yaml"), "--beta", "-0.1", *CPU]
        )
    with pytest.raises(ValueError, match="multiple of"):
        train_args.parse_args(
            [
                "--config",
                os.path.join(ROOT, "recipes/Qwen3-1.7B/gsm8k/tpo.yaml"),
                "--per_device_train_batch_size",
                "24",
                "--steps_per_generation",
                "32",
                *CPU,
            ]
        )
    with pytest.raises(ValueError, match="has 2 prompts but one generation batch needs 4"):
        run_recipe("recipes/Qwen3-0.6B/gsm8k/grpo.yaml", tiny_model_dir, tmp_path / "o", "--dataset_size", "2")
    with pytest.raises(ValueError, match="single file, so it has no separate test split"):
        run_recipe("recipes/Qwen3-0.6B/gsm8k/grpo.yaml", tiny_model_dir, tmp_path / "o", "--eval_strategy", "steps")
    with pytest.raises(ValueError, match="eval_dataset_seed=1 overlaps"):
        run_recipe(
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


def test_qlora_recipe(tiny_model_dir, tmp_path):
    """`--load_in_4bit true` on a LoRA recipe: 2 steps over a 4-bit base (CPU or GPU) with bitsandbytes, else a clear
    error naming the extra (tests/test_qlora.py has the ISOPO oracle and the ISOPO / TPO runs)."""
    recipe = "recipes/Qwen3-0.6B/gsm8k/grpo_lora.yaml"
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"trl-isopo\[quantization\]"):
            run_recipe(recipe, tiny_model_dir, tmp_path / "q", "--load_in_4bit", "true")
        return
    trainer = run_recipe(recipe, tiny_model_dir, tmp_path / "q", "--load_in_4bit", "true")
    check_two_steps(trainer, recipe, str(tmp_path / "q"))
    assert getattr(trainer.model, "is_loaded_in_4bit", False)


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
    assert train_args.peek_method(["--config", os.path.join(ROOT, "recipes/Qwen3-1.7B/gsm8k/tpo.yaml")]) == "tpo"
    assert (
        train_args.peek_method(
            ["--config", os.path.join(ROOT, "recipes/Qwen3-1.7B/gsm8k/tpo.yaml"), "--method", "grpo"]
        )
        == "grpo"
    )
    assert train_args.peek_method(["--method=isopo"]) == "isopo"
    assert train_args.peek_method([]) == "grpo"
    with pytest.raises(ValueError, match="Unknown method 'ppo'"):
        train_args.method_classes("ppo")


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
