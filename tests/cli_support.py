"""Shared by the command-line tests: a small prompt file, accelerate's state reset, a 2-step argument list."""

import json

import pytest
import torch

CPU = [] if torch.cuda.is_available() else ["--use_cpu", "true"]
ROWS = [
    {"prompt": [{"role": "user", "content": f"count : {' '.join('abcdefgh'[: n + 1])}"}], "solution": f"${n + 1}$"}
    for n in range(8)
]


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, PartialState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return str(path)


def small_run(model_dir, data, out, steps=2):
    return [
        "--model_name_or_path", model_dir, "--dataset_name", data, "--output_dir", str(out),
        "--max_steps", str(steps), "--per_device_train_batch_size", "4", "--num_generations", "2",
        "--max_completion_length", "8", "--report_to", "none", "--save_strategy", "no", "--logging_steps", "1",
        "--dtype", "float32", "--bf16", "false", "--disable_tqdm", "true", "--seed", "0",
    ]  # fmt: skip
