"""The rollout schedule of the real-model runs: M optimizer steps per rollout through TRL's mini-batch schedule.

A rollout (TRL's generation batch) is P prompts x K completions. TRL generates once every
`steps_per_generation * num_iterations` micro-batches of `per_device_train_batch_size` rows and steps the optimizer
every `gradient_accumulation_steps` micro-batches (GA), so one rollout feeds `steps_per_generation / GA *
num_iterations` optimizer steps. Here `steps_per_generation = M * GA`: each of the M optimizer steps takes a
mini-batch of P*K/M rows (after TRL's shuffle of the rollout; TPO shuffles whole groups), accumulated over GA
micro-batches of `micro_batch` rows. With M > 1 the policy moves between the mini-batches of one rollout, so TRL
keeps the rollout-time log-probs (pi_old): GRPO's ratio and clip act, REINFORCE's ratio is unclipped, TPO's target
q is frozen per rollout, and ISOPO (no pi_old) recomputes its per-sequence gradients at the current policy.
"""

from __future__ import annotations

import torch

# The main job's memory settings (`trl-isopo real --micro-batch`, `--activation-checkpointing`): the activations saved
# for the backward grow with the micro-batch's rows, so the job splits each optimizer step into micro-batches of at
# most this many rows (the update of every method but accumulation PROMA does not depend on the split; PROMA's own
# split is 8 rows) and recomputes each layer's activations in the backward (the same update). Peaks and wall times
# of the alternatives: docs/real-model.md#memory.
JOB_MICRO_BATCH = 8
JOB_ACTIVATION_CHECKPOINTING = True


def rollout_schedule(rollout_rows: int, steps_per_rollout: int = 1, micro_batch: int = 0, accumulation: int = 1) -> dict:
    """TRL's batch fields for M = `steps_per_rollout` optimizer steps per rollout of `rollout_rows` rows:
    `per_device_train_batch_size` (the micro-batch), `gradient_accumulation_steps` (micro-batches per optimizer step)
    and `steps_per_generation` (= M * GA). `micro_batch` 0: `accumulation` micro-batches per optimizer step (a
    method's own GA, e.g. accumulation PROMA's); a given `micro_batch` decides GA instead."""
    if steps_per_rollout < 1 or rollout_rows % steps_per_rollout:
        raise ValueError(f"{steps_per_rollout} optimizer steps per rollout do not divide its {rollout_rows} rows")
    mini = rollout_rows // steps_per_rollout
    if not micro_batch and mini % accumulation:
        raise ValueError(f"{accumulation} micro-batches do not divide the mini-batch of {mini} rows "
                         f"({rollout_rows} rows / {steps_per_rollout} steps)")
    micro = micro_batch or mini // accumulation
    if micro > mini or mini % micro:
        raise ValueError(f"a micro-batch of {micro} rows does not divide the mini-batch of {mini} rows "
                         f"({rollout_rows} rows / {steps_per_rollout} steps)")
    accumulation = mini // micro
    return dict(per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation,
                steps_per_generation=steps_per_rollout * accumulation)


def job_micro_batch(method, rollout_rows: int, generations: int, steps_per_rollout: int = 1,
                    wanted: int | None = None) -> int:
    """Rows per micro-batch of a real-model job training `method` (a `trl_isopo.methods.Method`) on rollouts of
    `rollout_rows` rows in groups of `generations` completions.

    `wanted` None: the largest divisor of the optimizer step's rows (`rollout_rows / steps_per_rollout`) that is at
    most `JOB_MICRO_BATCH`; an int: exactly that many rows (0: the whole step at once), which must divide the step.
    A method whose fields set `gradient_accumulation_steps` (accumulation PROMA: its update depends on how the step
    is split) keeps its own split, `step rows / gradient_accumulation_steps`; another `wanted` is refused. TPO with
    several optimizer steps per rollout needs whole groups per micro-batch (TPOConfig refuses split groups there):
    by default the largest multiple of `generations` within the budget that divides the step, else one group."""
    from ..tpo.config import TPOConfig

    if steps_per_rollout < 1 or rollout_rows % steps_per_rollout:
        raise ValueError(f"{steps_per_rollout} optimizer steps per rollout do not divide its {rollout_rows} rows")
    mini = rollout_rows // steps_per_rollout
    accumulation = method.fields.get("gradient_accumulation_steps")
    if accumulation:
        own = mini // accumulation if mini % accumulation == 0 else None
        if own is None:
            raise ValueError(f"the method's {accumulation} micro-batches per optimizer step do not divide the step's "
                             f"{mini} rows: change --prompts, --generations or --steps-per-rollout")
        if wanted not in (None, own):
            raise ValueError(f"the method's update depends on its split of each optimizer step into {accumulation} "
                             f"micro-batches ({own} rows each): --micro-batch must be {own} or left out")
        return own
    whole_groups = issubclass(method.config_cls, TPOConfig) and steps_per_rollout > 1
    if wanted is not None:
        if wanted < 0 or (wanted and mini % wanted):
            raise ValueError(f"--micro-batch {wanted} does not divide the {mini} rows of an optimizer step "
                             f"({rollout_rows} rows / {steps_per_rollout} steps per rollout); 0 takes the whole step")
        if whole_groups and wanted % generations:
            raise ValueError(f"TPO with {steps_per_rollout} optimizer steps per rollout needs whole groups in a "
                             f"micro-batch: --micro-batch must be a multiple of --generations {generations}")
        return wanted
    divisors = [d for d in range(1, mini + 1) if mini % d == 0]
    if whole_groups:
        divisors = [d for d in divisors if d % generations == 0] or [mini]
    within = [d for d in divisors if d <= JOB_MICRO_BATCH]
    return max(within) if within else min(divisors)


def rollout_config(config_cls, output_dir: str, *, prompts: int, generations: int, max_completion_length: int,
                   temperature: float, learning_rate: float, max_steps: int, seed: int, progress: bool = False,
                   steps_per_rollout: int = 1, micro_batch: int = 0, activation_checkpointing: bool = False,
                   **fields):
    """A CPU-sized `config_cls` (GRPOConfig or a subclass): rollouts of `prompts` x `generations`,
    `steps_per_rollout` optimizer steps per rollout (`rollout_schedule`; the defaults give one micro-batch of the
    whole rollout and one step), `num_iterations=1` unless `fields` says otherwise, constant lr, float32, activation
    checkpointing only if asked (TRL's configs default it to on), no saving or reporting. `fields` are the method's
    own settings (and any override); a `gradient_accumulation_steps` among them splits the mini-batch unless
    `micro_batch` is given."""
    from ..compat import CHECKPOINTING_FIELD  # imports transformers: only when a config is built

    fields = dict(fields)
    accumulation = fields.pop("gradient_accumulation_steps", 1)
    base = dict(
        output_dir=output_dir,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        **rollout_schedule(prompts * generations, steps_per_rollout, micro_batch, accumulation),
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
        # under the installed transformers' name: the deprecated alias `gradient_checkpointing` makes every config
        # print a FutureWarning from 5.18 on
        **{CHECKPOINTING_FIELD: activation_checkpointing},
        disable_tqdm=not progress,
    )
    return config_cls(**{**base, **fields})
