"""One real-model training run: SmolLM2 + a method's real trainer on the arithmetic task, evaluated along the way.

Each method trains with one optimizer step per generation batch (`num_iterations=1`, one micro-batch holding whole
groups), the same prompts per step, completions per prompt, seed and so the same number of generated samples.
Held-out accuracy (greedy, and sampled if asked) and KL(pi || pi_0) on probe prompts are measured before training,
every `eval_every` steps and at the end, outside the timed training steps.
"""

from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import asdict, dataclass, field

import torch

from .task import ArithmeticTask, make_reward, make_splits, score_text

_GRPO = ("trl", "GRPOTrainer", "GRPOConfig")
_ISOPO = ("trl_isopo", "ISOPOTrainer", "ISOPOConfig")
_TPO = ("trl_isopo", "TPOTrainer", "TPOConfig")
_NO_CLIP = {"epsilon": 1e9, "epsilon_high": 1e9}

# name -> (label, trainer spec, config fields). With one optimizer step per rollout the importance ratio is 1, so
# GRPO's clip never acts: GRPO differs from REINFORCE by its KL term (beta 0.04, TRL's k3 to the initial model).
REAL_METHODS: dict[str, tuple[str, tuple, dict]] = {
    "grpo": ("GRPO (beta 0.04)", _GRPO, {"beta": 0.04}),
    "reinforce": ("REINFORCE (no clip, no KL)", _GRPO, {"beta": 0.0, **_NO_CLIP}),
    "isopo": ("ISOPO (p=-1, c=0)", _ISOPO, {"isopo_p": -1.0, "isopo_reg": 0.0}),  # ISOPOConfig's default
    "isopo-kl": ("ISOPO (p=-1, c=0, beta 0.04)", _ISOPO, {"isopo_p": -1.0, "isopo_reg": 0.0, "beta": 0.04}),
    "isopo-reg1": ("ISOPO (p=-1, c=1)", _ISOPO, {"isopo_p": -1.0, "isopo_reg": 1.0}),  # the reference's rule
    "isopo-q0": ("ISOPO (q=-1, c=0)", _ISOPO, {"isopo_p": 0.0, "isopo_q": -1.0, "isopo_reg": 0.0}),
    "isopo-interacting": ("ISOPO (interacting)", _ISOPO, {"isopo_p": 0.0, "isopo_interacting": True}),
    "tpo": ("TPO (eta 1)", _TPO, {"tpo_eta": 1.0}),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class RealRun:
    """One run's settings (JSON-ready)."""

    method: str = "isopo"
    lora: bool = True
    learning_rate: float = 3e-4
    steps: int = 16
    prompts_per_step: int = 4
    num_generations: int = 8
    max_completion_length: int = 24
    temperature: float = 0.7
    seed: int = 0
    eval_size: int = 64
    eval_every: int = 8
    eval_sampled: bool = False
    kl_prompts: int = 0  # 0: no KL probe
    kl_samples: int = 4
    lora_r: int = 16
    model: str = "smollm2"
    task: ArithmeticTask = field(default_factory=ArithmeticTask)

    def label(self) -> str:
        return REAL_METHODS[self.method][0]

    def key(self) -> str:
        return f"{self.method}|{'lora' if self.lora else 'full'}|lr={self.learning_rate:g}|seed={self.seed}|steps={self.steps}"


def _classes(spec):
    from importlib import import_module

    mod = import_module(spec[0])
    return getattr(mod, spec[1]), getattr(mod, spec[2])


def rollout_config(config_cls, output_dir: str, *, prompts: int, generations: int, max_completion_length: int,
                   temperature: float, learning_rate: float, max_steps: int, seed: int, progress: bool = False,
                   **fields):
    """A CPU-sized `config_cls` (GRPOConfig or a subclass): one micro-batch of `prompts` whole groups per optimizer
    step and one optimizer step per generation batch (`num_iterations=1`), constant lr, float32, no checkpointing,
    no saving or reporting. `fields` are the method's own settings (and any override)."""
    base = dict(
        output_dir=output_dir,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        per_device_train_batch_size=prompts * generations,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=generations,
        max_completion_length=max_completion_length,
        temperature=temperature,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=max_steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=seed,
        data_seed=seed,
        gradient_checkpointing=False,
        disable_tqdm=not progress,
    )
    return config_cls(**{**base, **fields})


def _config(run: RealRun, output_dir: str, progress: bool):
    _, spec, fields = REAL_METHODS[run.method]
    _, config_cls = _classes(spec)
    return rollout_config(
        config_cls, output_dir, prompts=run.prompts_per_step, generations=run.num_generations,
        max_completion_length=run.max_completion_length, temperature=run.temperature,
        learning_rate=run.learning_rate, max_steps=run.steps, seed=run.seed, progress=progress,
        model_init_kwargs={"dtype": "float32"}, **fields,
    )


class _Evaluator:
    """Held-out accuracy and KL at a given step; remembers every evaluation."""

    def __init__(self, run: RealRun, tokenizer, held_out, probe_entries, train_proc, reference):
        from .evaluate import chat_prompts

        self.run, self.tokenizer, self.held_out, self.train_proc = run, tokenizer, held_out, train_proc
        self.reference = reference
        self.probe = chat_prompts(tokenizer, [e["question"] for e in probe_entries],
                                  run.task.system_prompt)
        self.points: list[dict] = []
        self.seconds = 0.0

    def __call__(self, step: int, model, reference=None) -> dict:
        from .evaluate import held_out_accuracy, sequence_kl

        t0 = time.perf_counter()
        run = self.run
        score = lambda text, entry: score_text(self.train_proc, text, entry)  # noqa: E731
        point = {"step": step}
        # "greedy" / "sampled": mean task score (chain_sum: 1 correct, 0.5 right number with the wrong sign);
        # "*_exact": the fraction answered exactly right.
        point["greedy_exact"], point["greedy"], greedy_texts = held_out_accuracy(
            model, self.tokenizer, self.held_out, score, run.task.system_prompt, run.max_completion_length, greedy=True
        )
        point["greedy_examples"] = greedy_texts[:3]
        if run.eval_sampled:
            point["sampled_exact"], point["sampled"], _ = held_out_accuracy(
                model, self.tokenizer, self.held_out, score, run.task.system_prompt, run.max_completion_length,
                greedy=False, temperature=run.temperature, seed=10_000 + step,
            )
        if run.kl_prompts:
            ref = reference if reference is not None else self.reference
            point["kl"] = 0.0 if step == 0 else sequence_kl(
                model, ref, self.tokenizer, self.probe, run.kl_samples, run.max_completion_length, seed=20_000
            )
        point["seconds"] = time.perf_counter() - t0
        self.seconds += point["seconds"]
        self.points.append(point)
        return point


def _callback(evaluator: _Evaluator, run: RealRun, step_times: list, rewards: list, on_event):
    from transformers import TrainerCallback

    class RealRunCallback(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step_times.append(time.perf_counter() - self._t0)
            step = state.global_step
            if run.eval_every and step % run.eval_every == 0 and step < run.steps:
                point = evaluator(step, model, reference=_reference_for(model, evaluator.reference))
                if on_event:
                    on_event("eval", point)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                rewards.append({"step": state.global_step, "reward": float(logs["reward"]),
                                "reward_std": float(logs.get("reward_std", 0.0))})
                if on_event:
                    on_event("log", rewards[-1])

    return RealRunCallback()


def _reference_for(model, reference):
    """The pi_0 for KL: the frozen copy (full weights), or the PEFT model with its adapter disabled (LoRA)."""
    if reference is not None:
        return reference
    return getattr(model, "disable_adapter", None)


def train_real(run: RealRun, output_dir: str, progress: bool = True, on_event=None, save_model: bool = True,
               command: str | None = None) -> dict:
    """Train one run; return a JSON-ready record (settings, eval points, per-step rewards and times).

    With `save_model`, the trained weights (adapter or full) go to `<output_dir>/model` with a model card carrying the
    method's tags and citation, the task, the held-out results and `command`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from trl_isopo.models import resolve_model_name_or_path
    from trl_isopo.tiny import set_offline_env

    set_offline_env()
    if run.method not in REAL_METHODS:
        raise ValueError(f"unknown method {run.method!r}; choose from {sorted(REAL_METHODS)}")
    path = resolve_model_name_or_path(run.model)
    set_seed(run.seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    n_train = run.steps * run.prompts_per_step
    train, held_out, train_proc = make_splits(run.task, n_train=max(n_train, 8), n_eval=max(run.eval_size, run.kl_prompts))
    held_eval = held_out[: run.eval_size]
    reference = None if run.lora else copy.deepcopy(model).eval().requires_grad_(False)
    # KL probe prompts: the first held-out questions (never trained on), possibly more than are scored
    evaluator = _Evaluator(run, tokenizer, held_eval, held_out[: run.kl_prompts], train_proc, reference)
    base = evaluator(0, model, reference=model)  # before training pi = pi_0
    if on_event:
        on_event("eval", base)

    trainer_cls, _ = _classes(REAL_METHODS[run.method][1])
    peft_config = None
    if run.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=run.lora_r, lora_alpha=2 * run.lora_r, lora_dropout=0.0,
                                 target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    step_times, rewards = [], []
    args = _config(run, output_dir, progress)
    trainer = trainer_cls(model=model, reward_funcs=make_reward(train_proc), args=args, train_dataset=train,
                          processing_class=tokenizer, peft_config=peft_config)
    trainer.add_callback(_callback(evaluator, run, step_times, rewards, on_event))
    if not progress:  # without the bar, transformers prints every step's log dict; the run reports its own lines
        from transformers.trainer_callback import PrinterCallback

        trainer.remove_callback(PrinterCallback)
    t0 = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - t0 - (evaluator.seconds - base["seconds"])
    final = evaluator(run.steps, trainer.model, reference=_reference_for(trainer.model, reference))
    if on_event:
        on_event("eval", final)
    record = {
        "key": run.key(),
        "label": run.label(),
        "settings": {**asdict(run), "task": asdict(run.task)},
        "task": run.task.describe(),
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)",
        "evals": evaluator.points,
        "rewards": rewards,
        "step_seconds": step_times,
        "train_seconds": train_seconds,
        "eval_seconds": evaluator.seconds,
        "params_finite": all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters()),
    }
    if save_model:
        from trl_isopo.model_card import attach_model_card

        model_dir = os.path.join(output_dir, "model")
        trainer.save_model(model_dir)
        tokenizer.save_pretrained(model_dir)
        family = {"GRPOTrainer": "grpo", "ISOPOTrainer": "isopo", "TPOTrainer": "tpo"}[REAL_METHODS[run.method][1][1]]
        base, final = evaluator.points[0], evaluator.points[-1]
        description = (
            f"{record['model']}, {'LoRA r=' + str(run.lora_r) if run.lora else 'full weights'}, trained with "
            f"{run.label()} on {run.task.describe()}; {run.steps} steps x {run.prompts_per_step} prompts x "
            f"{run.num_generations} completions, lr {run.learning_rate:g}, seed {run.seed}. Held-out accuracy "
            f"({len(held_eval)} questions never trained on, greedy): base {100 * base['greedy_exact']:.1f}% -> "
            f"trained {100 * final['greedy_exact']:.1f}%."
        )
        attach_model_card(trainer, family, command or f"trl-isopo real --method {run.method}", description=description)
        trainer.create_model_card(model_name=os.path.basename(os.path.abspath(output_dir)))
        src = os.path.join(output_dir, "README.md")
        if os.path.exists(src):
            os.replace(src, os.path.join(model_dir, "README.md"))
        record["model_dir"] = model_dir
    with open(os.path.join(output_dir, "run.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record
