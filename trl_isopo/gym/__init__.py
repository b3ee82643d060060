"""Reasoning Gym and GSM8K data plus reward functions for `trl-isopo train` (and for any TRL `GRPOTrainer`).

- `build_reasoning_gym_dataset`: one Reasoning Gym task or a composite, procedural and offline; prompts in TRL's
  conversational format (or rendered with a tokenizer's chat template); the entry stored as a JSON string column
  `entry`, because Reasoning Gym entries are not Arrow-safe.
- `ReasoningGymAnswerReward`: the task's own `score_answer` on the last `<answer>...</answer>` block.
- `ReasoningGymLastNumberReward` / `gsm8k_last_number_reward`: the same scores on the completion's last number.
- `format_reward`: 1.0 when the completion ends with one `<answer>...</answer>` block (after an optional think block).
- `load_gsm8k` / `gsm8k_answer_reward`: GSM8K from a local file/folder or the Hub; exact numeric match.

Importing this package does not import `reasoning_gym`; the Reasoning Gym functions do, on first use.
"""

from .gsm8k import extract_gsm8k_gold, gsm8k_answer_reward, gsm8k_last_number_reward, load_gsm8k, parse_number
from .reasoning_gym_data import (
    build_reasoning_gym_dataset,
    make_procedural_dataset,
    make_prompt_messages,
    resolve_system_prompt,
)
from .rewards import (
    ReasoningGymAnswerReward,
    ReasoningGymLastNumberReward,
    completion_text,
    extract_last_number,
    format_reward,
)

__all__ = [
    "ReasoningGymAnswerReward",
    "ReasoningGymLastNumberReward",
    "build_reasoning_gym_dataset",
    "completion_text",
    "extract_gsm8k_gold",
    "extract_last_number",
    "format_reward",
    "gsm8k_answer_reward",
    "gsm8k_last_number_reward",
    "load_gsm8k",
    "make_procedural_dataset",
    "make_prompt_messages",
    "parse_number",
    "resolve_system_prompt",
]
