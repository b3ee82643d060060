"""Offline tiny causal LMs and word-level tokenizers for tests, examples and the demo.

Nothing here touches the Hugging Face Hub: the tokenizer is a `tokenizers` WordLevel model wrapped in
`PreTrainedTokenizerFast`, the model a randomly initialised `Qwen2ForCausalLM` built from a config.

Always pass the tokenizer to a trainer as `processing_class`: `AutoTokenizer.from_pretrained(dir)` maps
`model_type=qwen2` to `Qwen2Tokenizer`, which rebuilds a BPE tokenizer and ignores the WordLevel pipeline.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Sequence

import torch

# Offline everywhere (tests, examples, the lab): no Hub, no telemetry, no trackers.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRL_EXPERIMENTAL_SILENCE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_DISABLED": "true",
}


def set_offline_env() -> None:
    """Set `OFFLINE_ENV` (values already in the environment win)."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)


SPECIAL_TOKENS = ("<pad>", "<unk>", "<bos>", "<eos>")
DEFAULT_WORDS = ("count", ":") + tuple("abcdefghijklmnop")

# Plain "role: content" lines; enough for TRL's conversational prompt path.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def build_word_tokenizer(words: Sequence[str] = DEFAULT_WORDS, save_dir: str | None = None):
    """Word-level tokenizer over `SPECIAL_TOKENS + words` (whitespace split, left padding)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(list(SPECIAL_TOKENS) + [w for w in words if w not in SPECIAL_TOKENS])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins tokens with single spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<bos>",
        eos_token="<eos>",
        padding_side="left",
        truncation_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer


def build_tiny_causal_lm(
    tokenizer,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 256,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
):
    """A randomly initialised `Qwen2ForCausalLM` whose vocabulary is the tokenizer's."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return model.to(dtype)


def make_tiny_model_dir(path: str, words: Sequence[str] = DEFAULT_WORDS, **model_kwargs) -> str:
    """Build tokenizer + model once and save both to `path` (idempotent). Returns `path`.

    Passing the model to a trainer *as this path* lets TRL rebuild a reference model offline.
    """
    if os.path.exists(os.path.join(path, "model.safetensors")) and os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    # Write to a temporary sibling and rename, so concurrent processes never see a half-written directory.
    tmp = f"{path.rstrip(os.sep)}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    tokenizer = build_word_tokenizer(words, save_dir=tmp)
    model = build_tiny_causal_lm(tokenizer, **model_kwargs)
    model.save_pretrained(tmp)
    try:
        os.replace(tmp, path) if not os.path.exists(path) else shutil.rmtree(tmp)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_tiny_tokenizer(path: str):
    """Load the WordLevel tokenizer saved by `make_tiny_model_dir` (never via AutoTokenizer, see module doc)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    tokenizer.padding_side = "left"
    tokenizer.chat_template = tokenizer.chat_template or CHAT_TEMPLATE
    return tokenizer


def tiny_prompt_dataset(num_prompts: int = 64, seed: int = 0, words: Sequence[str] = DEFAULT_WORDS[2:6]):
    """`datasets.Dataset` with a `prompt` column of the form "count <1-3 random words> :"."""
    from datasets import Dataset

    rng = random.Random(seed)
    prompts = ["count " + " ".join(rng.choices(list(words), k=rng.randint(1, 3))) + " :" for _ in range(num_prompts)]
    return Dataset.from_dict({"prompt": prompts})


def tiny_reward(completions, **kwargs) -> list[float]:
    """Half the fraction of "a" tokens plus half the positional match with "a b c d" (a dense toy reward)."""
    rewards = []
    for text in completions:
        tokens = text.split()
        frac_a = sum(t == "a" for t in tokens) / max(len(tokens), 1)
        match = sum(t == g for t, g in zip(tokens, "a b c d".split())) / 4
        rewards.append(0.5 * frac_a + 0.5 * match)
    return rewards


# Trainer settings for offline CPU runs on the tiny model (tests, examples): no trackers, no checkpoints, fp32.
TINY_TRAINING_ARGS = dict(
    report_to="none",
    use_cpu=True,
    bf16=False,
    save_strategy="no",
    disable_tqdm=True,
    dataloader_num_workers=0,
)


def tiny_training_args(output_dir: str, **overrides) -> dict:
    """`TINY_TRAINING_ARGS` plus `output_dir` and overrides, as keyword arguments for a GRPOConfig subclass."""
    return {**TINY_TRAINING_ARGS, "output_dir": str(output_dir), **overrides}
