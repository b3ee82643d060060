"""A tiny random Mixture-of-Experts causal LM (Qwen3-MoE) on the tiny word tokenizer, for the router aux-loss tests."""

import torch


def build_tiny_moe(tokenizer, dtype=torch.float64, seed=0):
    """1 decoder layer with 4 experts (2 per token); eager experts (the grouped-mm kernel has no float64)."""
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=1, router_aux_loss_coef=0.01, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, max_position_embeddings=64, experts_implementation="eager",
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(dtype)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, do_sample=True
    )
    return model
