"""GSM8K for TRL: load from a local file/folder or the Hub, exact numeric-answer reward.

Data: rows with `question` and `answer` (the GSM8K solution ending in `#### <number>`). `load_gsm8k` returns the
columns `prompt` (conversational: system prompt + question, or chat-template text with a tokenizer), `answer` (the
gold number as a string, e.g. `"1200"`) and `solution` (the original answer text).

Reward (`gsm8k_answer_reward`; `gsm8k_last_number_reward` reads the completion's last number instead): 1.0 iff the
completion's last `<answer>...</answer>` block is a single number equal to the gold number, else 0.0. Before comparing,
`$`, thousands separators `,`, surrounding whitespace and one trailing `.` are removed; numbers compare as decimals
(`72` == `72.0` == `$72`, `1,200` == `1200`; `72 apples` scores 0).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from .loading import load_split
from .reasoning_gym_data import DEFAULT_SYSTEM_PROMPT, make_prompt_messages, render_prompt
from .rewards import completion_text, extract_last_number

_ANSWER_BLOCK = re.compile(r"<answer>\s?(.*?)\s?</answer>", flags=re.DOTALL)
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")


def extract_answer_block(text: str) -> str | None:
    """Same rule as `reasoning_gym.utils.extract_answer`: the last `<answer>` block, stripped; None if absent."""
    matches = _ANSWER_BLOCK.findall(text)
    return matches[-1].strip() if matches else None


def parse_number(text: str | None) -> Decimal | None:
    """`" $1,200. "` -> Decimal("1200"); anything that is not exactly one number -> None."""
    if text is None:
        return None
    s = text.strip().replace(",", "").replace("$", "").strip()
    if s.endswith("."):
        s = s[:-1]
    if not _NUMBER.fullmatch(s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:  # pragma: no cover - the regex already guards this
        return None


def extract_gsm8k_gold(answer: str) -> str:
    """The number after the last `####` of a GSM8K solution (`"... #### 1,200"` -> `"1200"`); a bare number passes."""
    gold = answer.rsplit("####", 1)[-1]
    number = parse_number(gold)
    if number is None:
        raise ValueError(f"GSM8K answer {answer[-80:]!r} does not end in '#### <number>'.")
    return gold.strip().replace(",", "").replace("$", "").rstrip(".")


def numeric_match_rewards(completions, answer, extract) -> list[float]:
    """1.0 where `extract(completion text)` parses to the gold number of the `answer` column (a gold number or a
    full GSM8K solution ending in `#### <number>`), else 0.0."""
    rewards = []
    for completion, gold in zip(completions, answer, strict=True):
        predicted = parse_number(extract(completion_text(completion)))
        expected = parse_number(extract_gsm8k_gold(gold)) if "####" in gold else parse_number(gold)
        rewards.append(1.0 if predicted is not None and expected is not None and predicted == expected else 0.0)
    return rewards


def gsm8k_answer_reward(completions, answer, **kwargs) -> list[float]:
    """Exact numeric match of the last `<answer>` block against the `answer` column (gold number or full solution)."""
    return numeric_match_rewards(completions, answer, extract_answer_block)


def gsm8k_last_number_reward(completions, answer, **kwargs) -> list[float]:
    """Exact numeric match of the completion's last number against the `answer` column (1.0 / 0.0)."""
    return numeric_match_rewards(completions, answer, extract_last_number)


def load_gsm8k(
    path_or_name: str = "openai/gsm8k",
    config: str | None = "main",
    split: str = "train",
    size: int | None = None,
    tokenizer=None,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    chat_template_kwargs=None,
):
    """GSM8K (or any `question`/`answer` dataset in its format) ready for `gsm8k_answer_reward`.

    `path_or_name`: a `.jsonl`/`.json`/`.parquet`/`.csv` file (its rows are the split), a `save_to_disk` folder, a
    local dataset folder, or a Hub id (`openai/gsm8k` with config `main`). `size`: first N rows (None = all).
    """
    raw = load_split(path_or_name, config, split)
    missing = {"question", "answer"} - set(raw.column_names)
    if missing:
        raise ValueError(f"GSM8K data {path_or_name!r} lacks column(s) {sorted(missing)}; found {raw.column_names}.")
    if size is not None:
        if size <= 0 or size > len(raw):
            raise ValueError(f"GSM8K size={size} but {path_or_name!r} split {split!r} has {len(raw)} rows.")
        raw = raw.select(range(size))

    def convert(row):
        messages = make_prompt_messages(row["question"], system_prompt)
        return {
            "prompt": render_prompt(messages, tokenizer, chat_template_kwargs),
            "answer": extract_gsm8k_gold(row["answer"]),
            "solution": row["answer"],
        }

    # `answer` is overwritten by the gold number; other columns (e.g. an id) are kept for reward functions.
    return raw.map(convert, remove_columns=["question"])
