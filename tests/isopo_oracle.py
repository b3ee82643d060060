"""Brute-force float64 oracle for ISOPO: one forward/backward per sequence, then the dense formulas of docs/isopo.md.

Deliberately independent of `trl_isopo.isopo`'s math: per-sequence gradients come from plain autograd on a batch of
one row, statistics from explicit V_i, the solve from `torch.linalg.solve`.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch

from trl_isopo import ISOPOConfig, ISOPOTrainer

# The oracle tests run on the CPU; benchmarks/gpu_check.py sets TRL_ISOPO_TEST_DEVICE=cuda to run them on a GPU
# (the trainer then holds the model there, and the batches are moved to it).
DEVICE = os.environ.get("TRL_ISOPO_TEST_DEVICE", "cpu")


def make_trainer(model, tokenizer, tmp_path, peft_config=None, **overrides):
    from trl_isopo.tiny import tiny_prompt_dataset, tiny_reward, tiny_training_args

    kwargs = tiny_training_args(
        tmp_path / "isopo",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        gradient_checkpointing=False,
        use_cpu=DEVICE == "cpu",
    )
    kwargs.update(overrides)
    trainer = ISOPOTrainer(
        model,
        tiny_reward,
        args=ISOPOConfig(**kwargs),
        train_dataset=tiny_prompt_dataset(8),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


def make_batch(tokenizer, seed=0, B=4, P=5, C=4, prompt_lens=(3, 5, 2, 4), completion_lens=(4, 1, 3, 2)):
    """Left-padded prompts, right-padded completions, advantages including a zero."""
    g = torch.Generator().manual_seed(seed)
    words = [tokenizer.convert_tokens_to_ids(w) for w in "abcdefgh"]
    pad = tokenizer.pad_token_id
    prompt_ids = torch.full((B, P), pad)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    completion_ids = torch.full((B, C), pad)
    completion_mask = torch.zeros(B, C, dtype=torch.long)
    for b in range(B):
        lp, lc = prompt_lens[b % len(prompt_lens)], completion_lens[b % len(completion_lens)]
        prompt_ids[b, P - lp :] = torch.tensor(words)[torch.randint(len(words), (lp,), generator=g)]
        prompt_mask[b, P - lp :] = 1
        completion_ids[b, :lc] = torch.tensor(words)[torch.randint(len(words), (lc,), generator=g)]
        completion_mask[b, :lc] = 1
    advantages = torch.tensor([1.0, -0.5, 0.0, 2.0, -1.5, 0.7, 0.3, -0.2][:B], dtype=torch.float32)
    batch = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
    }
    return {k: v.to(DEVICE) for k, v in batch.items()}


def row(inputs, b):
    out = {}
    for k, v in inputs.items():
        out[k] = v[b : b + 1] if isinstance(v, torch.Tensor) and v.dim() > 0 else v
    return out


def covered_modules(trainer):
    return {name: m for name, m in trainer.model.named_modules() if name in set(trainer.isopo_coverage["covered"])}


def surrogate_logps(trainer, inputs):
    """Per-token log-probs through TRL's own forward (fused head), outside the ISOPO window (plain autograd)."""
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, inputs["completion_ids"].size(1)
    )
    return logps


@contextlib.contextmanager
def layer_io(layers):
    """Yields a dict that the forwards inside the block fill with name -> (input X detached, output) of each module in
    `layers` (name -> module); the output keeps its graph, for `autograd.grad` with respect to it."""
    store = {}

    def hook(name):
        def fn(module, args, out):
            store[name] = (args[0].detach(), out)

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in layers.items()]
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def per_sequence_data(trainer, inputs):
    """For every sequence i: V_i (weight grads) and bias grads of each covered layer, grads of all other trainable
    parameters, and each covered layer's input a_t and output gradient delta_t (rows of the full micro-batch).

    The loss of row i is its share of the bnpo surrogate: -sum_t m_it log pi_it / (all completion tokens).
    """
    layers = covered_modules(trainer)
    params = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    n_tok = inputs["completion_mask"].sum().double()
    B = inputs["prompt_ids"].shape[0]
    data = {"V": {n: [] for n in layers}, "b": {n: [] for n in layers}, "grads": [], "X": {n: [] for n in layers}, "G": {n: [] for n in layers}}
    for b in range(B):
        r = row(inputs, b)
        with layer_io(layers) as store:
            logps = surrogate_logps(trainer, r)
        loss = -(logps * r["completion_mask"]).sum() / n_tok
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True, retain_graph=True)
        gouts = torch.autograd.grad(loss, [store[n][1] for n in layers], allow_unused=True)
        g = {n: (torch.zeros_like(p) if gr is None else gr) for (n, p), gr in zip(params.items(), grads)}
        data["grads"].append(g)
        for (n, m), go in zip(layers.items(), gouts):
            data["V"][n].append(g[f"{n}.weight"])
            data["b"][n].append(g.get(f"{n}.bias"))
            data["X"][n].append(store[n][0][0])
            data["G"][n].append(torch.zeros_like(store[n][1][0]) if go is None else go[0])
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1).bool()
    for n in layers:
        data["V"][n] = torch.stack(data["V"][n])
        data["X"][n] = torch.stack(data["X"][n])
        data["G"][n] = torch.stack(data["G"][n])
    data["mask"] = mask
    return data


def R(x, mu, c):
    """The regularized magnitude without the reference's absolute "+ 1e-8" (docs/isopo.md, scale-free coefficients):
    x = 0 gives R = 1 (c > 0)."""
    if c == 0:
        return x.abs()
    return torch.sqrt(torch.where(x > 0, x**2 / (c * mu), 0.0) + 1)


def dense_weights(V, X, G, sample, A, p, q, r, c, mu=None, n_step=None):
    """w_i = A_i / (R(e)^-q R(f)^-p R(rho)^-r) from explicit V (B, d_out, d_in) and flat token sample J, times
    n_step^(p+q) for c = 0 (the step normalization, docs/isopo.md "Batch semantics"): n_step = the sequences of the
    trainer's optimizer step (B for one micro-batch per step); None for the layer function alone (no normalization).

    No absolute guards (the reference adds 1e-8 to the denominator and 1e-12 inside the Fisher denominator and to e):
    with c = 0 an exact zero statistic gives w_i = 0. mu (c > 0) is in the units of the statistics of V as given."""
    B = V.shape[0]
    Xf, Gf = X.reshape(-1, X.shape[-1]), G.reshape(-1, G.shape[-1])
    e = torch.stack([V[i].norm() for i in range(B)])
    u = torch.stack([torch.stack([Gf[j] @ V[i] @ Xf[j] for j in sample.tolist()]) for i in range(B)])
    den = math.sqrt(sum((Gf[j].norm() * Xf[j].norm()).item() ** 2 for j in sample.tolist()))
    f = u.norm(dim=1) / den if den > 0 else torch.zeros_like(e)
    rho = torch.where(e > 0, f / e, 0.0)
    stats = {"e": e, "f": f, "rho": rho}
    mu = mu or {k: v**2 for k, v in stats.items()}  # first step: each sequence by its own x^2
    denom = R(e, mu["e"], c) ** (-q) * R(f, mu["f"], c) ** (-p) * R(rho, mu["rho"], c) ** (-r)
    zero = torch.zeros_like(e, dtype=torch.bool)
    if c == 0:
        for x, ex in ((e, q), (f, p), (rho, r)):
            if ex != 0:
                zero |= x == 0
    norm = float(n_step) ** (p + q) if c == 0 and n_step is not None else 1.0
    return torch.where(zero | (denom == 0), 0.0, A.double() * norm / denom), stats


def rel_err(got, expected):
    return ((got - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def head_data(trainer, inputs):
    """The LM head as a plain linear layer, densely in float64: its inputs x_t (B, C, H) at the positions that score
    the completion tokens, the gradients g_t (B, C, V) of the whole micro-batch's surrogate w.r.t. the (temperature-
    scaled) logits there, and the completion mask (B, C). Independent of TRL's fused kernel: full logits, autograd."""
    model = trainer.model
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    C = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids, attention_mask=attention_mask).last_hidden_state[:, -C - 1 : -1]
    head = model.get_output_embeddings()
    logits = (hidden @ head.weight.detach().T).requires_grad_()
    logp = torch.log_softmax(logits / trainer.temperature, -1).gather(-1, inputs["completion_ids"].unsqueeze(-1))
    mask = inputs["completion_mask"].bool()
    loss = -(logp.squeeze(-1) * mask).sum() / mask.sum()
    (G,) = torch.autograd.grad(loss, logits)
    return hidden, G, mask


def logps_grad(trainer, loss_fn, inputs):
    """d loss_fn(inputs) / d (the per-token log-probs of the policy forward it runs)."""
    captured, forward = [], trainer._get_per_token_logps_and_entropies

    def capture(*args, **kwargs):
        out = forward(*args, **kwargs)
        captured.append(out[0])
        return out

    trainer._get_per_token_logps_and_entropies = capture
    try:
        loss = loss_fn(inputs)
    finally:
        del trainer._get_per_token_logps_and_entropies
    (grad,) = torch.autograd.grad(loss, captured[-1])
    return grad
