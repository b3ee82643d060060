"""Parsing of `trl-isopo train|grpo|isopo|tpo`: the script arguments, the method read before parsing, the parser built
for that method's config class, and the split of `accelerate launch` arguments (see `trl_isopo.scripts.train`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from trl import ScriptArguments

from trl_isopo.methods import METHODS
from trl_isopo.scripts import launch


@dataclass
class TrainScriptArguments(ScriptArguments):
    """Script arguments of `trl-isopo train` (plus TRL's `ScriptArguments`: `dataset_name`, `dataset_config`,
    `dataset_train_split`, `dataset_test_split`, ...).

    Args:
        method: a name in `trl_isopo.methods` (`grpo`, `isopo`, `tpo`, `isopo-c1`, ...); selects the config and
            trainer classes, and the named setting's config fields are defaults under the recipe and the flags.
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
        tokenizer_name_or_path: tokenizer to load (default: `model_name_or_path`); see `trl_isopo.scripts.train`
            for the rule.
            Like `model_name_or_path`, it accepts the alias `smollm2`.
    """

    method: str = field(
        default="grpo",
        metadata={
            "help": "Training method, a name in trl_isopo.methods: grpo, isopo, tpo (the config's defaults) or a named "
            "setting such as isopo-c1 (its fields are defaults under the recipe).",
            "choices": list(METHODS),
        },
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
    """(ConfigClass, TrainerClass) of a method of `trl_isopo.methods`."""
    if method not in METHODS:
        raise ValueError(f"Unknown method {method!r}; use one of {sorted(METHODS)}.")
    return METHODS[method].config_cls, METHODS[method].trainer_cls


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
    parser = TrlParser((TrainScriptArguments, config_cls, ModelConfig, DatasetMixtureConfig), prog=prog)
    parser.set_defaults(**METHODS[method].fields)  # the named setting; the YAML and the flags override it
    return parser


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
