"""`trl-isopo isopo|tpo|grpo`: TRL's `trl grpo` arguments, any prompt dataset, TRL's reward names, self-launch.

Offline: the tiny model of trl_isopo.tiny and local data files written by the tests.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from cli_support import CPU, ROWS, fresh_accelerate_state, jsonl, small_run  # noqa: F401  (fixtures)

from trl_isopo import cli
from trl_isopo.scripts import launch
from trl_isopo.gym import build as gym_build
from trl_isopo.gym import reward_names
from trl_isopo.scripts import train as train_script
from trl_isopo.scripts import train_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ["isopo", "tpo", "grpo"]


# ------------------------------------------------------------------------------------------------ training runs
@pytest.mark.parametrize("method", METHODS)
def test_method_command_trains_from_a_jsonl_file_with_trl_accuracy_reward(method, tiny_model_dir, jsonl, tmp_path):
    pytest.importorskip("math_verify")
    from trl.rewards import accuracy_reward

    out = tmp_path / method
    trainer = train_script.run(
        [*small_run(tiny_model_dir, jsonl, out), "--reward_funcs", "accuracy_reward", *CPU], method=method
    )
    expected = {"isopo": "ISOPOTrainer", "tpo": "TPOTrainer", "grpo": "GRPOTrainer"}[method]
    assert type(trainer).__name__ == expected
    assert trainer.reward_funcs == [accuracy_reward]  # TRL's own function, by its registry name
    assert trainer.state.global_step == 2
    logged = [h for h in trainer.state.log_history if "rewards/accuracy_reward/mean" in h]
    assert len(logged) == 2  # the reward ran on every step's completions
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert (out / "model.safetensors").exists()
    card = (out / "README.md").read_text()
    assert f"trl-isopo {method} --model_name_or_path" in card  # the command that made it, with its real name


def test_cli_entry_point_runs_the_method_in_process(tiny_model_dir, jsonl, tmp_path, capsys):
    out = tmp_path / "cli"
    code = cli.main(
        ["tpo", *small_run(tiny_model_dir, jsonl, out, steps=1), "--reward_funcs", "trl_isopo.gym.format_reward",
         *CPU]
    )  # fmt: skip
    assert code == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    assert "Training completed (1 process(es), 1 steps)." in capsys.readouterr().out


@pytest.mark.multiprocess
def test_num_processes_2_starts_a_two_process_gloo_run(tiny_model_dir, jsonl, tmp_path):
    """`trl-isopo isopo ... --num_processes 2` re-runs itself under `accelerate launch` (CPU: gloo)."""
    out = tmp_path / "two"
    port = str(29700 + os.getpid() % 500)
    cmd = [
        sys.executable, "-m", "trl_isopo.cli", "isopo", *small_run(tiny_model_dir, jsonl, out),
        "--per_device_train_batch_size", "2", "--reward_funcs", "trl_isopo.gym.format_reward",
        "--num_processes", "2", "--main_process_port", port,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env.pop(launch.LAUNCHED_ENV, None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "Training completed (2 process(es), 2 steps)." in proc.stdout
    card = (out / "README.md").read_text()
    assert "Launched on 2 processes (MULTI_CPU) with `accelerate launch`." in card


# --------------------------------------------------------------------------------------------- argument handling
def test_launch_arguments_are_split_from_training_arguments(tiny_model_dir, jsonl, tmp_path):
    argv = [*small_run(tiny_model_dir, jsonl, tmp_path), *CPU, "--reward_funcs", "accuracy_reward",
            "--num_processes", "4", "--accelerate_config", "zero2", "--isopo_p", "-0.5"]  # fmt: skip
    (script_args, training_args, *_), launch_args, training_argv = train_args.parse_args(
        argv, "isopo", return_launch_args=True
    )
    assert launch_args == ["--num_processes", "4", "--accelerate_config", "zero2"]
    assert "--num_processes" not in training_argv and "--isopo_p" in training_argv
    assert training_argv[:2] == ["--method", "isopo"]
    assert training_args.isopo_p == -0.5 and script_args.method == "isopo"
    resolved = launch.accelerate_launch_args(launch_args)
    assert resolved[0] == "--config_file" and resolved[1].endswith("zero2.yaml") and os.path.isfile(resolved[1])
    assert "--multi_gpu" not in resolved  # the config file decides the distributed type
    # Without a config file, several processes get --multi_gpu (on CPU accelerate would otherwise start one).
    plain = launch.accelerate_launch_args(["--num_processes", "2"])
    assert "--multi_gpu" in plain and plain[plain.index("--num_machines") + 1] == "1"
    assert launch.resolve_accelerate_config("ddp").endswith("multi_gpu.yaml")
    with pytest.raises(ValueError, match="neither a file nor a shipped config"):
        launch.resolve_accelerate_config("zero9")


def test_yaml_launch_keys_are_launch_arguments(tiny_model_dir, jsonl, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset_name: {jsonl}\nreward_funcs: [accuracy_reward]\n"
                      "num_processes: 2\nbf16: false\n")  # fmt: skip
    _, launch_args, _ = train_args.parse_args(["--config", str(recipe), *CPU], "tpo", return_launch_args=True)
    assert launch_args == ["--num_processes", "2"]


def test_clear_errors(tiny_model_dir, jsonl, tmp_path):
    base = [*small_run(tiny_model_dir, jsonl, tmp_path), *CPU]
    with pytest.raises(ValueError, match=r"neither training arguments .* nor `accelerate launch`"):
        train_args.parse_args([*base, "--reward_funcs", "accuracy_reward", "--isopo_pp", "1"], "isopo")
    with pytest.raises(ValueError, match="drop it or run `trl-isopo tpo`"):
        train_args.parse_args([*base, "--method", "tpo"], "isopo")
    recipe = tmp_path / "grpo.yaml"
    recipe.write_text("method: grpo\n")
    with pytest.raises(ValueError, match="got method 'grpo'"):
        train_args.parse_args(["--config", str(recipe), *base], "isopo")
    no_data = [a for a in base if a != jsonl and a != "--dataset_name"]
    with pytest.raises(ValueError, match="No training data"):
        train_args.parse_args([*no_data, "--reward_funcs", "accuracy_reward"], "isopo")
    with pytest.raises(ValueError, match="No reward"):
        train_args.parse_args(base, "grpo")
    # A known knob of another method is not silently passed on.
    with pytest.raises(ValueError, match="Unknown argument"):
        train_args.parse_args([*base, "--reward_funcs", "accuracy_reward", "--tpo_eta", "1"], "isopo")


def test_dataset_without_prompt_or_answer_column_fails_before_the_model_loads(tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text('{"question": "1+1", "solution": "2"}\n')
    def argv(*rewards):
        return ["--model_name_or_path", "/nonexistent", "--dataset_name", str(data), "--reward_funcs", *rewards,
                "--output_dir", str(tmp_path / "o"), "--bf16", "false", *CPU]  # fmt: skip

    script_args, training_args, model_args, dataset_args = train_args.parse_args(argv("accuracy_reward"), "grpo")
    with pytest.raises(ValueError, match=r"no `prompt` column .*rename_column\('question', 'prompt'\)"):
        gym_build.build_generic_data(script_args, training_args, dataset_args)
    data.write_text('{"prompt": "1+1", "solution": "2"}\n')
    script_args, training_args, model_args, dataset_args = train_args.parse_args(
        argv("accuracy_reward", "last_number"), "grpo"
    )
    with pytest.raises(ValueError, match=r"\['last_number'\] compare .* `answer` column"):
        gym_build.build_generic_data(script_args, training_args, dataset_args)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "save_to_disk", "folder"])
def test_prompt_data_sources(fmt, tmp_path):
    from datasets import Dataset

    from trl_isopo.gym.loading import load_split

    rows = [{"prompt": f"question {i}", "solution": str(i)} for i in range(5)]
    ds = Dataset.from_list(rows)
    if fmt in ("jsonl", "json"):
        path = tmp_path / f"d.{fmt}"
        ds.to_json(str(path), lines=fmt == "jsonl")
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        ds.to_parquet(str(path))
    elif fmt == "csv":
        path = tmp_path / "d.csv"
        ds.to_csv(str(path), index=False)
    elif fmt == "save_to_disk":
        path = tmp_path / "saved"
        from datasets import DatasetDict

        DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(path))
    else:  # a folder of data files (a Hub-like layout)
        path = tmp_path / "folder"
        (path / "data").mkdir(parents=True)
        ds.to_json(str(path / "data" / "train.jsonl"))
    loaded = load_split(str(path), split="train")
    assert [r["prompt"] for r in loaded] == [r["prompt"] for r in rows]
    assert [str(r["solution"]) for r in loaded] == [r["solution"] for r in rows]
    if fmt == "save_to_disk":
        assert len(load_split(str(path), split="test")) == 2
        with pytest.raises(ValueError, match="has splits"):
            load_split(str(path), split="validation")


def test_trl_dataset_mixture_from_yaml(tiny_model_dir, jsonl, tmp_path):
    recipe = tmp_path / "mix.yaml"
    recipe.write_text(
        f"model_name_or_path: {tiny_model_dir}\nreward_funcs: [accuracy_reward]\n"
        f"datasets:\n  - path: json\n    data_files: {jsonl}\n  - path: json\n    data_files: {jsonl}\n"
        "test_split_size: 0.25\n"
    )
    script_args, training_args, _, dataset_args = train_args.parse_args(
        ["--config", str(recipe), "--output_dir", str(tmp_path / "o"), "--eval_strategy", "steps", "--bf16", "false",
         *CPU],
        "isopo",
    )
    train, evaluation, hub, description = gym_build.build_generic_data(script_args, training_args, dataset_args)
    assert len(train) + len(evaluation) == 2 * len(ROWS) and len(evaluation) == 4
    assert hub is None and "mixture" in description


def test_trl_reward_names_resolve_to_trl_functions(tiny_model_dir, jsonl, tmp_path):
    from trl import rewards

    argv = [*small_run(tiny_model_dir, jsonl, tmp_path), *CPU, "--reward_funcs", "think_format_reward",
            "get_soft_overlong_punishment", "trl_isopo.gym.format_reward"]  # fmt: skip
    script_args, training_args, *_ = train_args.parse_args(argv, "tpo")
    funcs = reward_names.resolve_reward_funcs(script_args, training_args, None)
    from trl_isopo.gym import format_reward

    assert funcs[0] is rewards.think_format_reward and funcs[2] is format_reward
    script_args.reward_funcs = ["last_number", "answer", "format"]
    from trl_isopo import gym

    assert reward_names.resolve_reward_funcs(script_args, training_args, None) == [
        gym.gsm8k_last_number_reward, gym.gsm8k_answer_reward, gym.format_reward]
    # The soft overlong punishment uses the run's length: 0 up to 80 % of it, -1 at the limit.
    assert funcs[1](completion_ids=[[0] * 6, [0] * 8]) == [0.0, -1.0]


def test_no_command_prints_help_and_lists_method_commands(capsys):
    assert cli.main([]) == 0
    text = capsys.readouterr().out
    for name in ("isopo", "tpo", "grpo", "real", "train"):
        assert f"\n  {name} " in text
