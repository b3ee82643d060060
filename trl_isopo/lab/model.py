"""The TPO paper's tiny transformer as a transformers causal LM whose action space is exactly the V task symbols.

Architecture (arXiv 2604.06159 §3; its reference code's `models.py::CausalTransformer`): pre-norm decoder, d_model 64,
2 layers, 2 heads, 4x MLP with (tanh-approximated, Flax's default) GELU, final LayerNorm, learned positional
embeddings, a linear head, no dropout. We build it on transformers' GPTBigCode with `multi_query=False` (= GPT-2 with
`nn.Linear` projections that keep the (batch, time, features) layout, so ISOPO's per-`nn.Linear` per-sequence
statistics cover every matrix but the head; OPT flattens rows and GPT-2 uses Conv1D), untied, in a registered subclass.
Positions are `arange(T)` (not mask-aware): fine here, every prompt has exactly H tokens, so nothing is ever padded.

Action space: a transformers vocabulary also holds <pad> <unk> <bos> <eos>. The paper's head covers only the V
symbols, so the LM head carries a *frozen* additive bias of `LOGIT_MASK` on every non-symbol id. The bias lives in the
model itself: generation (`lm_head.forward`) and TRL's fused log-prob head (which reads `lm_head.weight` and
`lm_head.bias` directly) both see it, so sampling, p_old, ratios, KL and TPO targets use one distribution, the
softmax over the V symbols. EOS can never be sampled, so every completion has exactly `max_completion_length` tokens.
The subclass is registered with the Auto classes, so TRL can rebuild a reference model (beta > 0) from a saved copy.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, GPTBigCodeConfig, GPTBigCodeForCausalLM

from ..tiny import SPECIAL_TOKENS, build_word_tokenizer

LOGIT_MASK = -1.0e6  # exp(-1e6) == 0 in fp32/bf16; finite, so 0 * mask stays 0 in entropies and KLs


class LabTransformerConfig(GPTBigCodeConfig):
    """GPTBigCode config plus the ids the head may emit (`allowed_token_ids`); all others get the frozen mask bias."""

    model_type = "trl_isopo_lab"

    allowed_token_ids: list[int] | None = None

    def __post_init__(self, **kwargs):
        self.allowed_token_ids = list(self.allowed_token_ids or [])
        # TRL's `create_model_from_path` reads `config.auto_map` for architectures outside `transformers`; an empty
        # map sends it to AutoModelForCausalLM, where this class is registered below.
        self.auto_map = {}
        super().__post_init__(**kwargs)


class LabTransformerForCausalLM(GPTBigCodeForCausalLM):
    """GPTBigCode causal LM with an untied head whose frozen bias forbids all ids outside `config.allowed_token_ids`."""

    config_class = LabTransformerConfig
    _tied_weights_keys = {}

    def __init__(self, config: LabTransformerConfig):
        super().__init__(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=True)
        nn.init.normal_(self.lm_head.weight, std=config.initializer_range)
        bias = action_mask_bias(config.vocab_size, config.allowed_token_ids)
        self.lm_head.bias = nn.Parameter(bias, requires_grad=False)


def action_mask_bias(vocab_size: int, allowed_token_ids) -> torch.Tensor:
    """Bias vector: 0 on the allowed ids, `LOGIT_MASK` everywhere else."""
    bias = torch.full((vocab_size,), LOGIT_MASK)
    bias[list(allowed_token_ids)] = 0.0
    return bias


AutoConfig.register(LabTransformerConfig.model_type, LabTransformerConfig, exist_ok=True)
AutoModelForCausalLM.register(LabTransformerConfig, LabTransformerForCausalLM, exist_ok=True)


def symbol_words(vocab_size: int) -> list[str]:
    """The V symbol words "0", "1", ..., "V-1"."""
    return [str(i) for i in range(vocab_size)]


def build_lab_tokenizer(vocab_size: int):
    """Word-level tokenizer over the specials plus the V symbol words (each symbol is one token, no BOS added)."""
    return build_word_tokenizer(symbol_words(vocab_size))


def symbol_token_ids(tokenizer, vocab_size: int) -> list[int]:
    """Token ids of the V symbols, in symbol order."""
    return tokenizer.convert_tokens_to_ids(symbol_words(vocab_size))


def build_lab_model(
    vocab_size: int,
    horizon: int,
    d_model: int = 64,
    num_layers: int = 2,
    num_heads: int = 2,
    mlp_ratio: int = 4,
    seed: int = 0,
):
    """(model, tokenizer) for the paper's transformer on prompts of `horizon` symbols over `vocab_size` symbols.

    Positions cover the 2H tokens the task uses (prompt + completion). Initialization is GPTBigCode's N(0, 0.02).
    """
    tokenizer = build_lab_tokenizer(vocab_size)
    assert len(tokenizer) == len(SPECIAL_TOKENS) + vocab_size
    config = LabTransformerConfig(
        allowed_token_ids=symbol_token_ids(tokenizer, vocab_size),
        vocab_size=len(tokenizer),
        n_embd=d_model,
        n_layer=num_layers,
        n_head=num_heads,
        n_inner=mlp_ratio * d_model,
        n_positions=2 * horizon,
        multi_query=False,
        activation_function="gelu_pytorch_tanh",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        scale_attn_weights=True,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config._attn_implementation = "eager"  # faster than sdpa at 2H <= 20 positions on CPU
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LabTransformerForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    return model, tokenizer
