"""Held-out accuracy and KL drift of a causal LM on the arithmetic task (no trainer needed).

- `held_out_accuracy`: one completion per held-out question, greedy or sampled: the fraction answered exactly right,
  and the mean of the training reward (the task's own score).
- `sequence_kl`: E_{y ~ pi}[ sum_t KL(pi(. | x, y_<t) || pi_0(. | x, y_<t)) ] on fixed probe prompts, in nats per
  completion: the exact per-token KL (over the whole vocabulary) along sampled completions, which has far less
  variance than log pi(y) - log pi_0(y). Both distributions at temperature 1 (the models themselves).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch


def chat_prompts(tokenizer, questions: Sequence[str], system_prompt: str | None) -> list[str]:
    """The chat-template text (generation prompt appended) of each question, as TRL renders conversational prompts."""
    from trl_isopo.gym import make_prompt_messages

    return [
        tokenizer.apply_chat_template(make_prompt_messages(q, system_prompt), tokenize=False, add_generation_prompt=True)
        for q in questions
    ]


@contextlib.contextmanager
def _eval_mode(model):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def generate_completions(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int, greedy: bool, temperature: float = 0.7,
    seed: int = 0, batch_size: int = 64,
) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
    """(completion texts, prompt id rows, completion id rows): left-padded batches, `generate`, special tokens cut.

    Sampling uses its own seeded RNG stream (the global RNG, e.g. a trainer's, is restored afterwards).
    """
    pad_side, tokenizer.padding_side = tokenizer.padding_side, "left"
    texts, prompt_rows, completion_rows = [], [], []
    try:
        with _eval_mode(model), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            device = next(model.parameters()).device
            for start in range(0, len(prompts), batch_size):
                enc = tokenizer(list(prompts[start : start + batch_size]), return_tensors="pt", padding=True,
                                add_special_tokens=False).to(device)
                kwargs = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=1.0,
                                                                   top_k=0)
                out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                     **kwargs)
                new = out[:, enc["input_ids"].shape[1] :]
                texts += tokenizer.batch_decode(new, skip_special_tokens=True)
                for row, mask, comp in zip(enc["input_ids"], enc["attention_mask"], new):
                    prompt_rows.append(row[mask.bool()].cpu())
                    completion_rows.append(_until_eos(comp, tokenizer).cpu())
    finally:
        tokenizer.padding_side = pad_side
    return texts, prompt_rows, completion_rows


def _until_eos(ids: torch.Tensor, tokenizer) -> torch.Tensor:
    """Completion ids up to and including the first EOS (the rest is padding)."""
    eos = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    for i, t in enumerate(ids.tolist()):
        if t in eos:
            return ids[: i + 1]
    return ids


def held_out_accuracy(
    model, tokenizer, entries: Sequence[dict], score: Callable[[str, dict], float], system_prompt: str | None,
    max_new_tokens: int, greedy: bool, temperature: float = 0.7, seed: int = 0,
) -> tuple[float, float, list[str]]:
    """(accuracy, mean score, completions): one completion per question; `score(text, entry)` in [0, 1], and
    accuracy counts the completions that score 1 (chain_sum's own score also gives 0.5 for the right number with
    the wrong sign)."""
    prompts = chat_prompts(tokenizer, [e["question"] for e in entries], system_prompt)
    texts, _, _ = generate_completions(model, tokenizer, prompts, max_new_tokens, greedy, temperature, seed)
    scores = [score(t, e) for t, e in zip(texts, entries)]
    return sum(s >= 1.0 for s in scores) / len(scores), sum(scores) / len(scores), texts


def _completion_logprobs(model, prompt_rows, completion_rows, pad_id: int, device) -> list[torch.Tensor]:
    """Per-sequence (T_i, V) float32 log-softmax of the next-token distribution at each completion position."""
    seqs = [torch.cat([p, c]) for p, c in zip(prompt_rows, completion_rows)]
    width = max(s.numel() for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):  # left padding: completions end at the right edge
        ids[i, width - s.numel() :] = s
        mask[i, width - s.numel() :] = 1
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
    out = []
    for i, c in enumerate(completion_rows):
        t = c.numel()
        out.append(logits[i, width - t - 1 : width - 1].log_softmax(-1))  # positions predicting the completion
    return out


@torch.no_grad()
def sequence_kl(
    policy, reference, tokenizer, prompts: Sequence[str], samples: int, max_new_tokens: int, seed: int = 0,
    batch_size: int = 16,
) -> float:
    """Mean over prompts and `samples` completions y ~ policy (temperature 1) of sum_t KL(policy || reference) at
    each completion position, in nats. `reference` is a model, or a context-manager factory that turns `policy`
    into the reference (e.g. a PEFT model's `disable_adapter`)."""
    expanded = [p for p in prompts for _ in range(samples)]
    _, prompt_rows, completion_rows = generate_completions(
        policy, tokenizer, expanded, max_new_tokens, greedy=False, temperature=1.0, seed=seed
    )
    device = next(policy.parameters()).device
    pad_id = tokenizer.pad_token_id
    total = 0.0
    with _eval_mode(policy):
        for start in range(0, len(expanded), batch_size):
            p_rows, c_rows = prompt_rows[start : start + batch_size], completion_rows[start : start + batch_size]
            logp = _completion_logprobs(policy, p_rows, c_rows, pad_id, device)
            if callable(reference) and not isinstance(reference, torch.nn.Module):
                with reference():
                    logq = _completion_logprobs(policy, p_rows, c_rows, pad_id, device)
            else:
                with _eval_mode(reference):
                    logq = _completion_logprobs(reference, p_rows, c_rows, pad_id, device)
            for lp, lq in zip(logp, logq):
                total += float((lp.exp() * (lp - lq)).sum())
    return total / len(expanded)
