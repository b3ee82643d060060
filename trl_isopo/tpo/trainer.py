"""`TPOTrainer`: Target Policy Optimization (arXiv 2604.06159) as a thin `trl.GRPOTrainer` subclass.

Not TRL's `trl.experimental.tpo.TPOTrainer` (Triple Preference Optimization, an offline preference trainer).

What changes w.r.t. GRPOTrainer (everything else, generation, rewards, vLLM, PEFT, logging, is inherited):

- `_calculate_rewards` (via super): keeps the gathered raw rewards of the generation batch.
- `_generate_and_score_completions` (via super): adds the raw per-row score `tpo_scores` (B,) and, unless the policy
  cannot move before the loss sees the batch (below), `old_per_token_logps` when TRL skipped them (always the training
  model, never sampling log-probs) and the frozen per-row target `tpo_targets` (B,) and `tpo_valid_mask` (B,).
- `_prepare_inputs`: TRL's buffering (`compat.buffered_inputs`) with a whole-group shuffle instead of the row shuffle.
- `_compute_loss`: mean over groups of -sum_i q_i log softmax_K(l_theta)_i, divided by the gradient accumulation steps.

Split groups (`per_device_train_batch_size % K != 0`, allowed when every use of a generation batch lies inside one
optimizer step): p_old comes from a generation-time forward, q and each member's loss coefficient p_old_i - q_i from
the whole group gathered over processes (`tpo_row_coefficients`), and the loss is sum_i (p_old_i - q_i) l_theta_i,
whose gradient is the group loss's since p_theta == p_old at every loss forward of that use. A reuse
(`num_iterations > 1`) after the parameters moved recomputes the coefficients p_theta_i - q_i from one no-grad
forward of the generation batch (`_tpo_refresh_coefficients`).

p_old without an extra forward. When TRL skips `old_per_token_logps` (every use of a generation batch falls inside one
optimizer step: `gradient_accumulation_steps % (steps_per_generation * num_iterations) == 0`, no vLLM importance
sampling) and `num_iterations == 1` (or in evaluation), the parameters at every loss forward of that batch are the
rollout-time parameters, so p_old == p_theta. Then no log-prob forward runs at generation time: `_compute_loss` builds
q (and the generation-side `tpo/*` metrics) from the loss forward's own detached log-probs, as GRPOTrainer uses
`per_token_logps.detach()` for its old log-probs. Micro-batches hold whole groups, so the per-micro-batch q equals the
generation-batch q. Otherwise (`num_iterations > 1`, `steps_per_generation > gradient_accumulation_steps`, vLLM
importance sampling) q is built at generation time from a separate no-grad forward, as before.
"""

from __future__ import annotations

import textwrap

import torch
from trl.extras.profiling import profiling_decorator
from trl.models.utils import disable_gradient_checkpointing
from trl.trainer.utils import shuffle_sequence_dict

from ..base_trainer import PackageTrainer
from ..compat import buffered_inputs, policy_forward
from ..grpo_terms import aux_loss_term, entropy_bonus_enabled, entropy_bonus_term, k3_per_token
from .config import TPOConfig, tpo_unsupported_options
from .grouping import check_whole_groups, gather_prompts, shuffle_groups, validate_group_batching
from .metrics import TPOMetrics, target_sums
from .scores import batch_population_std, combine_rewards, scores_to_u
from .split import SplitGroupsMixin, member_loss
from .target import sequence_logps, tpo_group_stats, tpo_loss, tpo_target

__all__ = ["TPOTrainer"]

class TPOTrainer(SplitGroupsMixin, PackageTrainer):
    """
    Trainer for Target Policy Optimization (TPO, Kaddour 2026,
    [arXiv 2604.06159](https://huggingface.co/papers/2604.06159)).

    **Unrelated to `trl.experimental.tpo.TPOTrainer`** (TRL's *Triple* Preference Optimization); this class lives in
    `trl_isopo` and is tagged `target-policy-optimization` on the Hub.

    For each prompt, K = `num_generations` completions y_i are sampled and scored. With sequence log-probs
    l_i = log pi(y_i | x) (sum over tokens, or mean with `tpo_length_normalize=True`), standardized scores
    u = (s - mean) / std (population std within the group; std <= 1e-6 gives the centred scores, so a constant group
    gives u = 0 and q = p_old), and p_old the training model's log-probs at rollout time, the target is
    q = softmax(log_softmax(l_old) + u / eta) (frozen for all `num_iterations` reuses) and the loss is the mean over
    groups of -sum_i q_i log softmax(l_theta)_i (gradient p_theta - q on the group logits), plus optional GRPO-style
    `beta` KL to the reference model. Unscorable (reward None/NaN) and empty completions are excluded from both
    softmaxes (q = 0).

    With `per_device_train_batch_size` a multiple of `num_generations`, micro-batches are formed by shuffling whole
    groups; otherwise (allowed when every use of a generation batch lies inside one optimizer step) each member
    carries its loss coefficient, fixed from its whole group. Either way the update is the exact mean over the groups
    of the optimizer step regardless of gradient accumulation and world size.

    With one optimizer step per rollout and `num_iterations=1` (TRL then skips its old log-probs), p_old is taken from
    the loss forward's own detached log-probs, which equal the rollout-time ones exactly, so TPO runs no forward
    beyond GRPO's; otherwise p_old comes from one extra no-grad forward per generation batch.

    Args:
        model: model id/path or `PreTrainedModel`, as for [`trl.GRPOTrainer`].
        reward_funcs: reward function(s) or reward model(s), as for [`trl.GRPOTrainer`]; their weighted sum is the
            score s.
        args ([`TPOConfig`], *optional*): defaults to `TPOConfig("<model>-TPO")`.
        train_dataset, eval_dataset, processing_class, ...: the other [`trl.GRPOTrainer`] arguments, same names,
            order and defaults.

    Metrics (besides GRPO's generation metrics): `policy_loss` (the TPO cross-entropy), `entropy` (token entropy),
    `kl` (if `beta != 0`), `tpo/kl_q_p` (KL(q || p_theta), mean over groups), `tpo/max_abs_p_minus_q`,
    `tpo/target_entropy`, `tpo/frac_zero_variance_groups`, `tpo/frac_invalid_completions`.
    """

    # False forces the separate no-grad p_old forward at generation time even where the loss forward's detached
    # log-probs are exact (a check and debugging switch; read when each generation batch is scored).
    _tpo_reuse_loss_logps = True

    _tag_names = ["trl", "trl-isopo", "target-policy-optimization"]
    _name = "Target Policy Optimization"
    _short_name = "TPO"
    config_class = TPOConfig
    _paper = {
        "title": "Target Policy Optimization",
        "id": "2604.06159",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{kaddour2026target,
                title        = {{Target Policy Optimization}},
                author       = {Jean Kaddour},
                year         = 2026,
                eprint       = {arXiv:2604.06159},
            }"""),
    }

    def _check_args(self, args: TPOConfig) -> None:
        # Re-validate: fields may have been changed after TPOConfig.__post_init__ ran.
        if not args.tpo_eta > 0:
            raise ValueError(f"tpo_eta (the target temperature eta) must be > 0, got {args.tpo_eta}.")
        validate_group_batching(
            args.per_device_train_batch_size,
            args.num_generations,
            args.num_generations_eval,
            args.gradient_accumulation_steps,
            args.steps_per_generation,
        )
        problems = tpo_unsupported_options(args)
        if problems:
            raise ValueError("TPOTrainer: " + " ".join(problems))
        self._tpo_rewards_per_func = None
        self._tpo_metrics = TPOMetrics()
        self._tpo_coef_step = None  # global_step at which split groups' coefficients were last computed

    @staticmethod
    def _loss_mask(inputs) -> torch.Tensor:
        mask = inputs["completion_mask"]
        if inputs.get("tool_mask") is not None:
            mask = mask * inputs["tool_mask"]
        return mask

    # ------------------------------------------------------------------ generation-side hooks
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._tpo_rewards_per_func = rewards_per_func  # (N_global, num_reward_funcs), gathered over processes
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        self._tpo_rewards_per_func = None
        output = super()._generate_and_score_completions(inputs)
        rewards_per_func, self._tpo_rewards_per_func = self._tpo_rewards_per_func, None
        if rewards_per_func is None:
            raise RuntimeError("TPOTrainer: GRPOTrainer did not call _calculate_rewards; TRL internals changed.")

        mode = "train" if self.model.training else "eval"
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        device = output["completion_ids"].device
        num_rows = output["completion_ids"].shape[0]
        split = self._tpo_splits_groups(mode)
        # With split groups a group may straddle processes: check the generation batch of all of them.
        prompts = (output["prompt_ids"], output["prompt_mask"])
        prompts = gather_prompts(self.accelerator, *prompts) if split else prompts
        if getattr(self, "environment_factories", None) is None:  # env reset() may legitimately change prompts
            check_whole_groups(*prompts, group_size, where=f"{mode} batch")
        elif prompts[0].shape[0] % group_size:
            raise RuntimeError(f"TPO: {prompts[0].shape[0]} rows are not whole groups of {group_size}.")

        # Combined score s (trl_isopo.tpo.scores: sum_f w_f r_f, or of per-function standardized rewards; NaN for a
        # row where every function returned None), over the generation batch of every process; this process's rows
        # are the block at its rank.
        local = slice(self.accelerator.process_index * num_rows, (self.accelerator.process_index + 1) * num_rows)
        non_empty = self.accelerator.gather(self._loss_mask(output).sum(-1).long()) > 0
        scores = combine_rewards(
            rewards_per_func.to(device), self.reward_weights, group_size, self.args.multi_objective_aggregation,
            non_empty,
        )
        output["tpo_scores"] = scores[local]
        score_scale = None
        if self.args.scale_rewards == "batch":  # one std over the generation batch of every process, kept per row
            score_scale = batch_population_std(scores.masked_fill(~non_empty, float("nan"))).expand(scores.shape[0])
            output["tpo_score_scale"] = score_scale[local].clone()

        self._tpo_metrics.flush(self.accelerator, self._metrics[mode], mode)
        if not split and self._tpo_reuses_loss_logps(output, mode):
            # p_old == p_theta at every loss forward of this batch: q is built there (see the module docstring).
            self._tpo_metrics.defer(mode, self.args.steps_per_generation if mode == "train" else 1)
            return output

        # p_old: the training model's log-probs at rollout time (TRL computes them itself only when misaligned / vLLM).
        old_per_token_logps = output.get("old_per_token_logps")
        if old_per_token_logps is None:
            batch_size = (
                self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
            )
            with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                old_per_token_logps, _, _ = policy_forward(self, self.model, output, batch_size=batch_size)
            output["old_per_token_logps"] = old_per_token_logps
        mask = self._loss_mask(output)
        old_logps = sequence_logps(old_per_token_logps.detach(), mask, self.args.tpo_length_normalize)
        if split:
            q, valid = self._tpo_split_targets(output, old_logps, non_empty, scores, score_scale, group_size, mode)
        else:
            _, q, valid, sums = self._tpo_build_targets(
                old_logps, non_empty[local], scores[local], group_size, output.get("tpo_score_scale")
            )
            self._tpo_metrics.log_target(self.accelerator, self._metrics[mode], sums)
            q, valid = q.reshape(-1), valid.reshape(-1)
        output["tpo_targets"] = q
        output["tpo_valid_mask"] = valid
        return output

    # ------------------------------------------------------------------ target q and its metrics
    def _tpo_reuses_loss_logps(self, output, mode) -> bool:
        """Whether q is built from the loss forward's detached log-probs (no p_old forward at generation time)."""
        if not self._tpo_reuse_loss_logps or output.get("old_per_token_logps") is not None:
            return False  # forced off, or TRL computed p_old itself (misaligned steps, vLLM importance sampling)
        if mode == "eval":
            return True  # nothing updates the parameters between generation and the evaluation loss
        # One optimizer step spans whole generation batches and each batch is used once: the parameters are the
        # rollout-time ones at every loss forward of the batch. (TRL's own rule, gradient_accumulation_steps %
        # (steps_per_generation * num_iterations) == 0, held when it skipped p_old; num_iterations > 1 keeps q frozen
        # from a separate forward.)
        return self.num_iterations == 1 and self.args.gradient_accumulation_steps % self.args.steps_per_generation == 0

    def _tpo_build_targets(self, old_logps, non_empty, scores, group_size, score_scale=None):
        """(p_old, q, valid), each `(G, K)`, and the metric sums (`target_sums`), from p_old's sequence log-probs
        (B,), which rows have completion tokens (B,) and the raw scores (B,) of whole groups (`score_scale` (B,): the
        batch std for `scale_rewards="batch"`)."""
        scores = scores.to(old_logps.device)
        valid = non_empty.to(old_logps.device) & torch.isfinite(scores) & torch.isfinite(old_logps)
        valid = valid.view(-1, group_size)
        scale = None if score_scale is None else score_scale.to(scores.device).view(-1, group_size)
        u, std = scores_to_u(scores.view(-1, group_size), valid, self.args.scale_rewards, scale)
        old_g = old_logps.view(-1, group_size)
        q = tpo_target(old_g, u, valid, eta=self.args.tpo_eta, anchor=self.args.tpo_anchor)
        return old_g, q, valid, target_sums(old_g, q, valid, std)

    # ------------------------------------------------------------------ whole-group micro-batches
    @profiling_decorator
    def _prepare_inputs(self, generation_batch):
        # GRPOTrainer's buffering with the row shuffle replaced by a whole-group shuffle, so that each of the
        # `steps_per_generation` contiguous micro-batches (per_device_train_batch_size rows, a multiple of K) holds
        # whole groups; split groups' rows carry their own loss coefficients and keep TRL's row shuffle.
        return buffered_inputs(self, generation_batch, self._tpo_shuffle, self._tpo_on_buffer)

    def _tpo_shuffle(self, batch):
        if self._tpo_splits_groups("train"):
            return shuffle_sequence_dict(batch)
        return shuffle_groups(batch, self.num_generations)

    def _tpo_on_buffer(self, buffer, fresh):
        if fresh:
            self._tpo_coef_step = self.state.global_step
        elif self._tpo_splits_groups("train") and self._tpo_coef_step != self.state.global_step:
            # A reuse (num_iterations > 1) after the parameters moved: coefficients at the current parameters.
            self._tpo_refresh_coefficients(buffer)
            self._tpo_coef_step = self.state.global_step

    # ------------------------------------------------------------------ loss
    @profiling_decorator
    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        group_size = self.num_generations if mode == "train" else self.num_generations_eval
        mask = self._loss_mask(inputs)
        if inputs.get("tpo_targets") is None and inputs.get("tpo_scores") is None:
            raise RuntimeError(
                "TPOTrainer._compute_loss needs a batch from TPOTrainer._prepare_inputs: it carries `tpo_scores` and, "
                "unless p_old is taken from the loss forward itself, `tpo_targets` and `tpo_valid_mask`."
            )
        per_token_logps, entropies, aux_loss = policy_forward(self, model, inputs, compute_entropy=True,
                                                              compute_aux_loss=self.aux_loss_enabled)
        if inputs.get("tpo_targets") is None:
            # Reuse path: the parameters are the rollout-time ones, so p_old is this forward's own (detached) output.
            # Written back into the micro-batch so that callbacks see the same keys as on the recompute path.
            old_per_token_logps = per_token_logps.detach()
            old_logps = sequence_logps(old_per_token_logps, mask, self.args.tpo_length_normalize)
            _, q, valid_rows, sums = self._tpo_build_targets(
                old_logps, mask.sum(-1) > 0, inputs["tpo_scores"], group_size, inputs.get("tpo_score_scale")
            )
            inputs["old_per_token_logps"] = old_per_token_logps
            inputs["tpo_targets"] = q.reshape(-1)
            inputs["tpo_valid_mask"] = valid_rows.reshape(-1)
            self._tpo_metrics.add_deferred(self.accelerator, self._metrics[mode], mode, sums)
        # top_entropy_quantile < 1: the policy gradient flows only through the high-entropy tokens of each l_i (the
        # others are detached, so l_i, p_theta and the loss keep their values), as GRPO masks its per-token loss.
        entropy_mask = None
        policy_token_logps = per_token_logps
        if self.top_entropy_quantile < 1.0:
            entropy_mask = self.get_high_entropy_mask(entropies, mask, 1 - self.top_entropy_quantile)
            policy_token_logps = torch.where(entropy_mask, per_token_logps, per_token_logps.detach())
        logps = sequence_logps(policy_token_logps, mask, self.args.tpo_length_normalize)
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        split = inputs.get("tpo_coef") is not None
        if split:
            # Groups split over micro-batches: the members' constant coefficients give the group loss's gradient.
            policy_loss = member_loss(inputs["tpo_coef"], inputs["tpo_row_ce"], logps, group_size)
        else:
            # Mean over the groups of this micro-batch; all micro-batches on all ranks hold the same number of
            # groups, so dividing by GA (and DDP's mean over ranks) gives the mean over every group of the step.
            logps = logps.view(-1, group_size)
            targets = inputs["tpo_targets"].view(-1, group_size)
            valid = inputs["tpo_valid_mask"].view(-1, group_size)
            policy_loss = tpo_loss(logps, targets, valid, reduction="mean")
        loss = policy_loss / normalizer

        m = mask.bool()
        if self.beta != 0.0:  # GRPO's k3 KL, as its "grpo" loss_type normalizes it: per sequence, then the mean
            per_token_kl = k3_per_token(per_token_logps, inputs["ref_per_token_logps"],
                                        inputs.get("old_per_token_logps"), self.args.use_bias_correction_kl, mask=m)
            kl_per_seq = per_token_kl.sum(-1) / m.sum(-1).clamp(min=1)
            loss = loss + self.beta * kl_per_seq.mean() / normalizer

        if entropy_bonus_enabled(self.args):  # TRL's bonus, on the tokens the policy gradient acts on
            bonus_mask = mask if entropy_mask is None else mask * entropy_mask
            loss = loss + entropy_bonus_term(self, entropies, bonus_mask, mode)

        if self.aux_loss_enabled:
            loss = loss + aux_loss_term(self, aux_loss, mode)

        # Metrics. Every collective below runs on every rank, in the same order. Split groups logged the group
        # metrics once per generation batch, where every group is whole.
        ent = torch.where(m, entropies.detach().float(), torch.zeros((), device=m.device))
        local = [ent.sum(), m.sum().float()]
        if self.beta != 0.0:
            local += [per_token_kl.detach().float().sum(), m.sum().float()]
        totals = self.accelerator.reduce(torch.stack(local), reduction="sum")
        self._metrics[mode]["entropy"].append((totals[0] / totals[1].clamp(min=1)).item())
        if self.beta != 0.0:
            self._metrics[mode]["kl"].append((totals[2] / totals[3].clamp(min=1)).item())
        if not split:
            self._tpo_metrics.log_groups(
                self.accelerator, self._metrics[mode], tpo_group_stats(logps, targets, valid), logps.shape[0],
                reduce=True, step_end=mode == "eval" or self.accelerator.sync_gradients,
            )
        return loss
