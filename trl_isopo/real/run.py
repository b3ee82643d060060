"""One real-model training run: SmolLM2 + a method's real trainer on a numeric Reasoning Gym task, evaluated along
the way.

Every method of `trl_isopo.methods` trains on the same rollouts budget: rollouts of the same prompts (per seed) x K
completions, and M = `steps_per_rollout` optimizer steps per rollout through TRL's mini-batch schedule
(`trl_isopo.real.schedule`). With M = 1 (the `trl-isopo real` default) the importance ratio is 1, so GRPO's clip never
acts: `grpo` is then REINFORCE, and `grpo-kl` differs from it by its KL term (beta 0.04, TRL's k3 to the initial
model). With M > 1 the policy moves within a rollout and the clip, the unclipped ratio and TPO's frozen target act.
Held-out accuracy (greedy, and sampled if asked) and KL(pi || pi_0) on probe prompts are measured before training,
every `eval_every` optimizer steps and at the end, outside the timed training steps; CPU-seconds (process CPU time,
all threads) are counted for training and evaluation apart.
"""

from __future__ import annotations

import copy
import json
import os
import time
import warnings
from dataclasses import asdict, dataclass, field, fields

import torch

from trl_isopo.methods import get_method

from .schedule import rollout_config, rollout_schedule  # noqa: F401  (rollout_config: the step-time benchmark's)
from .task import ArithmeticTask, make_reward, make_splits, score_text

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Per optimizer step from TRL's log history: GRPO's clip fractions, ISOPO's scale spread, TPO's max |p - q|, ...
STEP_LOG_KEYS = ("loss", "grad_norm", "kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean",
                 "clip_ratio/high_mean", "isopo/scale_spread", "tpo/max_abs_p_minus_q", "tpo/kl_q_p",
                 "proma/projected_fraction", "proma/reduction_pct", "proma/intra_fraction")
# The values the learning benchmark's first runs (2026-12-01/02) had: their keys name none of these settings, so a
# key names exactly the settings that differ from them.
_KEY_BASE = dict(prompts_per_rollout=4, num_generations=8, max_completion_length=24, temperature=0.7, eval_size=64,
                 eval_every=8, eval_sampled=True, kl_prompts=8, kl_samples=4, lora_r=16, model="smollm2",
                 steps_per_rollout=1, num_iterations=1, micro_batch=0, task=ArithmeticTask())
_KEY_NAMES = dict(prompts_per_rollout="P", num_generations="K", max_completion_length="len", temperature="T",
                  eval_size="eval", steps_per_rollout="M", num_iterations="iters", micro_batch="mb")


@dataclass
class RealRun:
    """One run's settings (JSON-ready)."""

    method: str = "isopo"
    lora: bool = True
    learning_rate: float = 3e-4
    steps: int = 16  # optimizer steps in all: rollouts x steps_per_rollout x num_iterations
    prompts_per_rollout: int = 4
    num_generations: int = 8
    max_completion_length: int = 24
    temperature: float = 0.7
    seed: int = 0
    eval_size: int = 64
    eval_every: int = 8  # optimizer steps
    eval_sampled: bool = False
    kl_prompts: int = 0  # 0: no KL probe
    kl_samples: int = 4
    lora_r: int = 16
    model: str = "smollm2"
    steps_per_rollout: int = 1  # M: optimizer steps per rollout, each on 1/M of it
    num_iterations: int = 1  # TRL's passes over each rollout (each M steps)
    micro_batch: int = 0  # rows per forward/backward; 0: one micro-batch per optimizer step
    # recompute each layer's activations in the backward instead of keeping them (memory for time; the same update)
    activation_checkpointing: bool = False
    task: ArithmeticTask = field(default_factory=ArithmeticTask)

    def __post_init__(self):
        if isinstance(self.task, dict):  # read back from JSON
            self.task = ArithmeticTask(**self.task)
        per_rollout = self.steps_per_update()
        if self.steps % per_rollout:
            raise ValueError(f"{self.steps} steps are not whole rollouts of {per_rollout} optimizer steps")
        rollout_schedule(self.prompts_per_rollout * self.num_generations, self.steps_per_rollout, self.micro_batch)

    def steps_per_update(self) -> int:
        """Optimizer steps per rollout: M x num_iterations."""
        return self.steps_per_rollout * self.num_iterations

    def rollouts(self) -> int:
        return self.steps // self.steps_per_update()

    def label(self) -> str:
        return get_method(self.method).label

    def key(self) -> str:
        """`method|lora|lr=..|seed=..|steps=..`, then `name=value` for each setting that differs from `_KEY_BASE`."""
        weights = "lora" if self.lora else "full"
        key = f"{self.method}|{weights}|lr={self.learning_rate:g}|seed={self.seed}|steps={self.steps}"
        for f in fields(self):
            value, base = getattr(self, f.name), _KEY_BASE.get(f.name)
            if f.name not in _KEY_BASE or value == base:
                continue
            if f.name == "task":
                value = f"{value.name}{json.dumps(value.config, sort_keys=True, separators=(',', ':'))}"
            key += f"|{_KEY_NAMES.get(f.name, f.name)}={value:g}" if isinstance(value, float) else \
                f"|{_KEY_NAMES.get(f.name, f.name)}={value}"
        return key


def _config(run: RealRun, output_dir: str, progress: bool, **extra):
    """The run's trainer config; `extra` fields (e.g. vLLM generation for a benchmark) are added on top."""
    method = get_method(run.method)
    # no model_init_kwargs: the model is passed instantiated (TRL would print that it ignores them)
    return rollout_config(
        method.config_cls, output_dir, prompts=run.prompts_per_rollout, generations=run.num_generations,
        max_completion_length=run.max_completion_length, temperature=run.temperature,
        learning_rate=run.learning_rate, max_steps=run.steps, seed=run.seed, progress=progress,
        steps_per_rollout=run.steps_per_rollout, micro_batch=run.micro_batch,
        activation_checkpointing=run.activation_checkpointing,
        **{**method.fields, "num_iterations": run.num_iterations, **extra},
    )


def lora_config(run: RealRun):
    """The run's LoRA adapter (None for full weights): rank `lora_r`, alpha 2 x rank, every linear of the blocks."""
    if not run.lora:
        return None
    from peft import LoraConfig

    return LoraConfig(r=run.lora_r, lora_alpha=2 * run.lora_r, lora_dropout=0.0, target_modules=LORA_TARGETS,
                      task_type="CAUSAL_LM")


class _Evaluator:
    """Held-out accuracy and KL at a given step; remembers every evaluation and its CPU and wall seconds."""

    def __init__(self, run: RealRun, tokenizer, held_out, probe_entries, train_proc, reference):
        from .evaluate import chat_prompts

        self.run, self.tokenizer, self.held_out, self.train_proc = run, tokenizer, held_out, train_proc
        self.reference = reference
        self.probe = chat_prompts(tokenizer, [e["question"] for e in probe_entries],
                                  run.task.system_prompt)
        self.points: list[dict] = []
        self.seconds = 0.0
        self.cpu_seconds = 0.0

    def __call__(self, step: int, model, reference=None, train_cpu_seconds: float = 0.0) -> dict:
        from .evaluate import held_out_accuracy, sequence_kl

        t0, c0 = time.perf_counter(), time.process_time()
        run = self.run
        rollout = step // run.steps_per_update()
        score = lambda text, entry: score_text(self.train_proc, text, entry)  # noqa: E731
        point = {"step": step, "rollout": rollout, "train_cpu_seconds": train_cpu_seconds}
        # "greedy" / "sampled": mean task score (chain_sum: 1 correct, 0.5 right number with the wrong sign);
        # "*_exact": the fraction answered exactly right.
        point["greedy_exact"], point["greedy"], greedy_texts = held_out_accuracy(
            model, self.tokenizer, self.held_out, score, run.task.system_prompt, run.max_completion_length, greedy=True
        )
        point["greedy_examples"] = greedy_texts[:3]
        if run.eval_sampled:  # seeded by the rollout, so runs with another M sample alike at the same rollout
            point["sampled_exact"], point["sampled"], _ = held_out_accuracy(
                model, self.tokenizer, self.held_out, score, run.task.system_prompt, run.max_completion_length,
                greedy=False, temperature=run.temperature, seed=10_000 + rollout,
            )
        if run.kl_prompts:
            ref = reference if reference is not None else self.reference
            point["kl"] = 0.0 if step == 0 else sequence_kl(
                model, ref, self.tokenizer, self.probe, run.kl_samples, run.max_completion_length, seed=20_000
            )
        point["seconds"] = time.perf_counter() - t0
        point["cpu_seconds"] = time.process_time() - c0
        self.seconds += point["seconds"]
        self.cpu_seconds += point["cpu_seconds"]
        self.points.append(point)
        return point


class _TrainClock:
    """Training CPU-seconds so far: process CPU time since `start` minus the evaluations' since then."""

    def __init__(self, evaluator: _Evaluator):
        self.evaluator = evaluator
        self.cpu0 = self.eval0 = 0.0

    def start(self):
        self.cpu0, self.eval0 = time.process_time(), self.evaluator.cpu_seconds

    def train_cpu_seconds(self) -> float:
        return time.process_time() - self.cpu0 - (self.evaluator.cpu_seconds - self.eval0)


def _callback(evaluator: _Evaluator, clock: _TrainClock, run: RealRun, step_times: list, rewards: list, on_event):
    from transformers import TrainerCallback

    class RealRunCallback(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            step_times.append(time.perf_counter() - self._t0)
            step = state.global_step
            if run.eval_every and step % run.eval_every == 0 and step < run.steps:
                point = evaluator(step, model, reference=_reference_for(model, evaluator.reference),
                                  train_cpu_seconds=clock.train_cpu_seconds())
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


def record_generations(trainer) -> list[int]:
    """The optimizer step (`state.global_step`) at each rollout the trainer generates from now on (a list that
    grows as it trains): the schedule's evidence, stored with every run."""
    steps: list[int] = []
    generate = trainer._generate_and_score_completions

    def counted(inputs):
        if trainer.model.training:
            steps.append(trainer.state.global_step)
        return generate(inputs)

    trainer._generate_and_score_completions = counted
    return steps


def step_log(log_history) -> list[dict]:
    """The `STEP_LOG_KEYS` of each optimizer step's entry of TRL's log history."""
    rows = []
    for entry in log_history:
        if "step" in entry and "loss" in entry:
            rows.append({"step": entry["step"], **{k: entry[k] for k in STEP_LOG_KEYS if entry.get(k) is not None}})
    return rows


def _ignore_library_warnings():
    """TRL 1.16 and PEFT read transformers 5's deprecated `is_gradient_checkpointing` and call its deprecated
    `gradient_checkpointing_enable` / `_disable` (FutureWarnings from inside the libraries, not from this
    configuration); only those messages are hidden, inside `warnings.catch_warnings`."""
    for name in ("is_gradient_checkpointing", "gradient_checkpointing_enable", "gradient_checkpointing_disable"):
        warnings.filterwarnings("ignore", message=f"`{name}` is deprecated", category=FutureWarning)


def train_real(run: RealRun, output_dir: str, progress: bool = True, on_event=None, save_model: bool = True,
               command: str | None = None, tokenizer=None) -> dict:
    """Train one run; return a JSON-ready record (settings, eval points, per-step rewards, logs and times).

    `tokenizer`: the model's, when `AutoTokenizer` cannot load it (the tiny test model). With `save_model`, the
    trained weights (adapter or full) go to `<output_dir>/model` with a model card carrying the method's tags and
    citation, the task, the held-out results and `command`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from trl_isopo.models import resolve_model_name_or_path
    from trl_isopo.tiny import set_offline_env

    set_offline_env()
    cpu_start = time.process_time()
    method = get_method(run.method)
    # the splits first: a task that is not numeric, or too small for a disjoint held-out set, fails before loading
    n_train = run.rollouts() * run.prompts_per_rollout
    train, held_out, train_proc = make_splits(run.task, n_train=max(n_train, 8),
                                              n_eval=max(run.eval_size, run.kl_prompts))
    path = resolve_model_name_or_path(run.model)
    set_seed(run.seed)
    tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    held_eval = held_out[: run.eval_size]
    reference = None if run.lora else copy.deepcopy(model).eval().requires_grad_(False)
    # KL probe prompts: the first held-out questions (never trained on), possibly more than are scored
    evaluator = _Evaluator(run, tokenizer, held_eval, held_out[: run.kl_prompts], train_proc, reference)
    base = evaluator(0, model, reference=model)  # before training pi = pi_0
    if on_event:
        on_event("eval", base)

    peft_config = lora_config(run)
    step_times, rewards = [], []
    clock = _TrainClock(evaluator)
    with warnings.catch_warnings():
        _ignore_library_warnings()
        clock.start()
        trainer = method.trainer_cls(model=model, reward_funcs=make_reward(train_proc),
                                     args=_config(run, output_dir, progress), train_dataset=train,
                                     processing_class=tokenizer, peft_config=peft_config)
        generations = record_generations(trainer)
        trainer.add_callback(_callback(evaluator, clock, run, step_times, rewards, on_event))
        if not progress:  # without the bar, transformers prints every step's log dict; the run reports its own lines
            from transformers.trainer_callback import PrinterCallback

            trainer.remove_callback(PrinterCallback)
        t0 = time.perf_counter()
        trainer.train()
        train_seconds = time.perf_counter() - t0 - (evaluator.seconds - base["seconds"])
        train_cpu = clock.train_cpu_seconds()
    final = evaluator(run.steps, trainer.model, reference=_reference_for(trainer.model, reference),
                      train_cpu_seconds=train_cpu)
    if on_event:
        on_event("eval", final)
    record = {
        "key": run.key(),
        "label": run.label(),
        "settings": {**asdict(run), "task": asdict(run.task)},
        "task": run.task.describe(),
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to float32)" if run.model == "smollm2" else run.model,
        "evals": evaluator.points,
        "rewards": rewards,
        "step_log": step_log(trainer.state.log_history),
        "generation_steps": generations,
        "step_seconds": step_times,
        "train_seconds": train_seconds,
        "eval_seconds": evaluator.seconds,
        "train_cpu_seconds": train_cpu,
        "eval_cpu_seconds": evaluator.cpu_seconds,
        "cpu_seconds": time.process_time() - cpu_start,
        "torch_threads": torch.get_num_threads(),
        "params_finite": all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters()),
    }
    if save_model:
        from trl_isopo.model_card import attach_model_card

        model_dir = os.path.join(output_dir, "model")
        trainer.save_model(model_dir)
        tokenizer.save_pretrained(model_dir)
        base, final = evaluator.points[0], evaluator.points[-1]
        description = (
            f"{record['model']}, {'LoRA r=' + str(run.lora_r) if run.lora else 'full weights'}, trained with "
            f"{run.label()} on {run.task.describe()}; {run.rollouts()} rollouts x {run.prompts_per_rollout} prompts x "
            f"{run.num_generations} completions, {run.steps_per_update()} optimizer step(s) per rollout, lr "
            f"{run.learning_rate:g}, seed {run.seed}. Held-out accuracy "
            f"({len(held_eval)} questions never trained on, greedy): base {100 * base['greedy_exact']:.1f}% -> "
            f"trained {100 * final['greedy_exact']:.1f}%."
        )
        attach_model_card(trainer, run.method, command or f"trl-isopo real --method {run.method}", description=description)
        trainer.create_model_card(model_name=os.path.basename(os.path.abspath(output_dir)))
        src = os.path.join(output_dir, "README.md")
        if os.path.exists(src):
            os.replace(src, os.path.join(model_dir, "README.md"))
        record["model_dir"] = model_dir
    with open(os.path.join(output_dir, "run.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record
