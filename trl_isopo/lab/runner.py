"""Train one (method, seed, setting) through the real trainer and collect what the lab reports.

One *episode* (the paper's step) = one generation batch of B prompts x K completions followed by `epochs` optimizer
steps on it (TRL `num_iterations`; one process; each optimizer step sees all B*K rows, in one micro-batch or, for
methods with a micro-batch default such as ISOPO, `regime.micro_batch_prompts`, in GA micro-batches of whole groups).
Recorded per episode, from the rollouts sampled at that episode *before* its update (the paper's training error):
exact-match error, token error (fraction of wrong symbols), mean reward. KL drift: at checkpoints, on a fixed probe set
of prompts, KL(pi_theta || pi_0) of whole completions, estimated as the mean over completions y ~ pi_theta of
sum_t KL(pi_theta(.|x, y<t) || pi_0(.|x, y<t)) with the per-position KL computed exactly over the vocabulary (nats per
sequence; unbiased for the sequence-level KL). Wall time: `trainer.train()` minus the KL probes.
"""

from __future__ import annotations

import copy
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from trl_isopo.methods import get_method

from . import tasks
from .model import build_lab_model
from .optim import build_optimizer
from .regime import micro_batch_prompts
from .rewards import bag_of_tokens_score, exact_match_score, get_reward


@dataclass
class Setting:
    """Everything that defines a run except method and seed. Defaults: the paper's terminal-reward benchmark at H=4."""

    task: str = "reverse_copy"
    reward: str = "terminal"
    horizon: int = 4
    vocab_size: int = 2
    group_size: int = 8  # K completions per prompt
    prompts_per_step: int = 100  # B
    episodes: int = 100
    epochs: int = 4  # optimizer steps per rollout batch (TRL num_iterations)
    optimizer: str = "muon"
    lr: float = 1e-3
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 2
    kl_every: int = 0  # episodes between KL probes (0: only at the end)
    kl_prompts: int = 64
    kl_samples: int = 8
    micro_batch_prompts: int = 0  # prompts per micro-batch (0: the method's default, else the whole episode)

    def key(self) -> dict:
        """The fields that identify a result (all of them)."""
        return asdict(self)


class EpisodeRecorder:
    """A TRL reward function that scores with `reward_fn` and records the episode's training metrics.

    GRPOTrainer calls its reward functions exactly once per generation batch, i.e. once per episode.
    """

    def __init__(self, reward_fn, on_episode=None):
        self.reward_fn = reward_fn
        self.on_episode = on_episode
        self.exact_error: list[float] = []
        self.token_error: list[float] = []
        self.mean_reward: list[float] = []
        self.__name__ = getattr(reward_fn, "__name__", "reward")

    def __call__(self, completions, target, **kwargs):
        rewards = self.reward_fn(completions, target=target)
        words = [(str(c).split(), str(t).split()) for c, t in zip(completions, target)]
        self.exact_error.append(1.0 - float(np.mean([exact_match_score(c, t) for c, t in words])))
        self.token_error.append(1.0 - float(np.mean([bag_of_tokens_score(c, t) for c, t in words])))
        self.mean_reward.append(float(np.mean(rewards)))
        if self.on_episode is not None:
            self.on_episode(len(self.exact_error))
        return rewards


def probe_prompts(setting: Setting, seed: int = 12345) -> torch.Tensor:
    """Fixed probe prompts (symbol indices) for the KL measurement, the same for every method and seed."""
    return torch.as_tensor(tasks.random_prompts(setting.kl_prompts, setting.horizon, setting.vocab_size, seed))


@torch.no_grad()
def sequence_kl(policy, reference, prompt_ids: torch.Tensor, horizon: int, samples: int, generator) -> float:
    """Mean over y ~ policy of sum_t KL(policy(.|x,y<t) || reference(.|x,y<t)), x = each row of `prompt_ids`."""
    was_training = policy.training
    policy.eval()
    x = prompt_ids.repeat_interleave(samples, dim=0)
    seq = x
    for _ in range(horizon):  # ancestral sampling from the policy (the masked ids have probability exactly 0)
        probs = policy(seq).logits[:, -1].float().softmax(-1)
        seq = torch.cat([seq, torch.multinomial(probs, 1, generator=generator)], dim=1)
    start = x.shape[1] - 1  # logits at positions start..start+H-1 predict the H completion tokens
    logp = policy(seq).logits[:, start : start + horizon].float().log_softmax(-1)
    logq = reference(seq).logits[:, start : start + horizon].float().log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).sum(-1)
    policy.train(was_training)
    return float(kl.mean())


def first_below(errors, threshold: float):
    """1-based index of the first episode whose error is below `threshold` (the paper's "steps to"), or None."""
    for i, e in enumerate(errors):
        if e < threshold:
            return i + 1
    return None


def micro_batching(prompts_per_step: int, wanted: int | None) -> tuple[int, int]:
    """(prompts per micro-batch, gradient-accumulation steps): the largest divisor of B not above `wanted`."""
    if not wanted or wanted >= prompts_per_step:
        return prompts_per_step, 1
    mb = max(d for d in range(1, wanted + 1) if prompts_per_step % d == 0)
    return mb, prompts_per_step // mb


def _trainer_callback(run_kl, epochs: int, kl_every: int):
    from transformers import TrainerCallback

    class KLProbe(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if kl_every and state.global_step % (epochs * kl_every) == 0:
                run_kl(state.global_step // epochs, model)

    return KLProbe()


def train_one(method_name: str, seed: int, setting: Setting, on_episode=None, workdir: str | None = None) -> dict:
    """Train `method_name` with `seed` on `setting`; return a JSON-ready dict of per-episode metrics and summaries."""
    method = get_method(method_name)
    s = setting
    model, tokenizer = build_lab_model(s.vocab_size, s.horizon, s.d_model, s.num_layers, s.num_heads, seed=seed)
    initial = copy.deepcopy(model).eval()
    for p in initial.parameters():
        p.requires_grad_(False)

    recorder = EpisodeRecorder(get_reward(s.reward), on_episode)
    dataset = tasks.build_dataset(s.task, s.horizon, s.vocab_size, s.prompts_per_step * s.episodes, seed=seed)
    probe = torch.as_tensor(tokenizer(
        [tasks.symbols_to_text(p) for p in probe_prompts(s).tolist()], add_special_tokens=False
    )["input_ids"])
    kl_gen = torch.Generator().manual_seed(seed)
    kl_points: list[tuple[int, float]] = [(0, 0.0)]
    kl_time = [0.0]

    def run_kl(episode, policy):
        t0 = time.perf_counter()
        kl_points.append((episode, sequence_kl(policy, initial, probe, s.horizon, s.kl_samples, kl_gen)))
        kl_time[0] += time.perf_counter() - t0

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        model_dir = os.path.join(tmp, "init")  # TRL rebuilds its reference model (beta > 0) from this path
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        model.config._name_or_path = model_dir
        mb, ga = micro_batching(s.prompts_per_step,
                                s.micro_batch_prompts or micro_batch_prompts(method, s.prompts_per_step))
        config = method.config(
            output_dir=os.path.join(tmp, "out"),
            per_device_train_batch_size=mb * s.group_size,
            gradient_accumulation_steps=ga,  # TRL: steps_per_generation = GA, one generation batch of B*K rows
            num_generations=s.group_size,
            num_iterations=s.epochs,
            max_completion_length=s.horizon,
            max_steps=s.episodes * s.epochs,
            learning_rate=s.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_grad_norm=0.0,  # the paper clips nothing
            temperature=1.0,
            seed=seed,
            logging_steps=s.episodes * s.epochs,
            report_to="none",
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        optimizer = build_optimizer(model, s.optimizer, s.lr)
        trainer = method.trainer_cls(
            model=model,
            reward_funcs=[recorder],
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            optimizers=(optimizer, None),
            callbacks=[_trainer_callback(run_kl, s.epochs, s.kl_every)],
        )
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)  # the lab reports its own numbers; keep stdout for the table
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0 - kl_time[0]
    if kl_points[-1][0] != s.episodes:
        run_kl(s.episodes, model)
    assert len(recorder.exact_error) == s.episodes, (len(recorder.exact_error), s.episodes)
    return {
        "method": method_name,
        "label": method.label,
        "seed": seed,
        "setting": s.key(),
        "exact_error": recorder.exact_error,
        "token_error": recorder.token_error,
        "mean_reward": recorder.mean_reward,
        "kl_episodes": [e for e, _ in kl_points],
        "kl": [k for _, k in kl_points],
        "final_kl": kl_points[-1][1],
        "wall_s": wall,
        "s_per_episode": wall / s.episodes,
        "torch_threads": torch.get_num_threads(),
        "micro_batches": ga,
    }


def seed_mean(results: list[dict], key: str = "exact_error") -> list[float]:
    """Per-episode mean over the seeds of `results` (all with the same number of episodes)."""
    return np.mean(np.array([r[key] for r in results], dtype=float), axis=0).tolist()


def summarize(results: list[dict], checkpoints=(1, 25, 50, 100), thresholds=(0.1, 0.01), key="exact_error") -> dict:
    """Seed-mean summary of one method: error at checkpoint episodes, final error, episodes to thresholds, KL, time."""
    curve = seed_mean(results, key)
    return {
        "seeds": len(results),
        "at": {c: curve[c - 1] for c in checkpoints if c <= len(curve)},
        "final": curve[-1],
        "to": {t: first_below(curve, t) for t in thresholds},
        "final_kl": float(np.mean([r["final_kl"] for r in results])),
        "wall_s": float(np.mean([r["wall_s"] for r in results])),
        "s_per_episode": float(np.mean([r["s_per_episode"] for r in results])),
    }


def fmt_pct(x) -> str:
    """0.0731 -> '7.3'; None/NaN -> '-'."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"
