"""The seam's assumptions about TRL (trl_isopo/compat.py), each checked against the installed TRL.

A failure here means a TRL release changed something the package relies on; its message names the TRL version and
the assumption (`compat.broken`). Behaviour is checked where it can be (the kernel TRL's forward calls, the buffering
of `_prepare_inputs`, the rollout's old-log-prob forward), names where only a name is relied on.
"""

import inspect
import types

import pytest
import torch
from trl import GRPOConfig, GRPOTrainer

from trl_isopo import compat
from trl_isopo.tiny import build_tiny_causal_lm, tiny_prompt_dataset, tiny_reward, tiny_training_args


def test_trl_kernel_forward_saves_what_the_row_scaled_kernel_reads():
    """`RowScaledChunkedLogProb` runs TRL's forward on a recording ctx and reads back six saved tensors and three
    ctx attributes."""

    class Ctx:
        needs_input_grad = (True,) * 9

        def save_for_backward(self, *t):
            self.saved = t

        def set_materialize_grads(self, value):
            pass

        def mark_non_differentiable(self, *t):
            pass

    g = torch.Generator().manual_seed(0)
    h, w, t = torch.randn(5, 8, generator=g), torch.randn(11, 8, generator=g), torch.randint(0, 11, (5,), generator=g)
    ctx = Ctx()
    compat.ChunkedLogProbFunction.forward(ctx, h, w, None, t, 1.0, 4, None, 1.0, ())
    assert len(getattr(ctx, "saved", ())) == 6, compat.broken("saves (hidden, weight, bias, targets, log_z, entropy) "
                                                              "in ChunkedLogProbFunction.forward")
    for name in ("compute_dtype", "chunk_size", "kernel_args"):
        assert hasattr(ctx, name), compat.broken(f"sets ctx.{name} in ChunkedLogProbFunction.forward")
    assert compat.triton_tile_fold(torch.device("cpu"), 4, 8) is None, compat.broken("folds CPU tiles in torch")


def test_trl_fused_forward_calls_the_installed_kernel(tiny_tokenizer):
    """TRL's fused head forward looks its kernel up at every call and passes the head's own weight: replacing it
    (`compat.set_logprob_kernel`) is how the head's weight gradient is reached."""
    from trl.trainer.utils import add_fused_lm_head

    model = build_tiny_causal_lm(tiny_tokenizer, seed=0)
    add_fused_lm_head(model)
    original, calls = compat.logprob_kernel(), []

    class Recorder:
        @staticmethod
        def apply(hidden, weight, *rest):
            calls.append(weight)
            return original.apply(hidden, weight, *rest)

    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    compat.set_logprob_kernel(Recorder)
    try:
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
    finally:
        compat.set_logprob_kernel(original)
    assert compat.logprob_kernel() is original
    assert len(calls) == 1 and calls[0] is model.get_output_embeddings().weight, compat.broken(
        "calls trl.trainer.utils._ChunkedLogProbFunction.apply(hidden, lm_head.weight, ...) in its fused LM-head forward")
    assert out.log_probs.shape == (2, 5)


class _FakeTrainer:
    """What `GRPOTrainer._prepare_inputs` reads, with a generation that numbers its batches."""

    def __init__(self, spg, num_iterations):
        self.model = types.SimpleNamespace(training=True)
        self.args = types.SimpleNamespace(steps_per_generation=spg)
        self.num_iterations, self._step, self._buffered_inputs, self.generated = num_iterations, 0, None, 0

    def _generate_and_score_completions(self, batch):
        self.generated += 1
        return {"x": torch.arange(8) + 100 * self.generated, "y": torch.arange(8).view(8, 1).float()}


@pytest.mark.parametrize("spg,num_iterations", [(2, 1), (4, 2)])
def test_buffered_inputs_is_grpo_prepare_inputs(spg, num_iterations):
    """`compat.buffered_inputs` with TRL's row shuffle returns what GRPOTrainer._prepare_inputs returns, step for step
    (same random stream), and fills the buffer at the same steps."""
    from trl.trainer.utils import shuffle_sequence_dict

    ours, theirs = _FakeTrainer(spg, num_iterations), _FakeTrainer(spg, num_iterations)
    fresh = []
    for step in range(3 * spg * num_iterations):
        torch.manual_seed(step)
        a = compat.buffered_inputs(ours, None, shuffle_sequence_dict, lambda buffer, new: fresh.append(new))
        torch.manual_seed(step)
        b = GRPOTrainer._prepare_inputs(theirs, None)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), compat.broken(
            f"buffers generation batches in GRPOTrainer._prepare_inputs as TRL {compat.TRL_SERIES} did (step {step})")
        ours._step += 1
        theirs._step += 1
    assert ours.generated == theirs.generated == 3
    assert fresh == [s % (spg * num_iterations) == 0 for s in range(3 * spg * num_iterations)]


def _tiny_grpo(tmp_path, tokenizer, model_dir, **overrides):
    kw = dict(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=1, steps_per_generation=1,
              max_completion_length=4, max_steps=1, learning_rate=0.0, seed=0)
    kw.update(overrides)
    args = GRPOConfig(**tiny_training_args(tmp_path / "out", **kw))
    return GRPOTrainer(model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(8), processing_class=tokenizer)


@pytest.mark.parametrize("spg", [1, 2])
def test_old_logps_forward_is_the_rollouts_first_no_grad_policy_forward(spg, tiny_model_dir, tiny_tokenizer, tmp_path):
    """`compat.runs_old_logps_forward` says whether the rollout runs that forward; when it does, it is the first
    no-grad `_get_per_token_logps_and_entropies` call on the policy after generation (the reference model's, here
    the policy with beta > 0, comes later), and its result is `old_per_token_logps` (what `OldLogpsSkip` relies on)."""
    trainer = _tiny_grpo(tmp_path, tiny_tokenizer, tiny_model_dir, steps_per_generation=spg, beta=0.1)
    calls, outputs = [], []
    forward, score = trainer._get_per_token_logps_and_entropies, trainer._generate_and_score_completions

    def recorded_forward(model, *a, **kw):
        out = forward(model, *a, **kw)
        calls.append((model is trainer.model, torch.is_grad_enabled(), out[0]))
        return out

    def recorded_score(*a, **kw):
        calls.clear()
        outputs.append(score(*a, **kw))
        return outputs[-1]

    trainer._get_per_token_logps_and_entropies, trainer._generate_and_score_completions = recorded_forward, recorded_score
    runs = compat.runs_old_logps_forward(trainer)
    trainer.train()
    old = outputs[0].get("old_per_token_logps")
    assert runs == (spg != 1)
    assert (old is not None) == runs, compat.broken(
        "runs the old-log-prob forward exactly when gradient_accumulation_steps % (steps_per_generation x "
        "num_iterations) != 0 (vLLM's importance-sampling correction off)")
    if runs:
        first = next(c for c in calls if c[0] and not c[1])
        assert first[2] is old, compat.broken("computes old_per_token_logps with the rollout's first no-grad policy "
                                              "forward through _get_per_token_logps_and_entropies")


def test_grpo_trainer_sets_the_state_the_package_reads(tiny_model_dir, tiny_tokenizer, tmp_path):
    """Every attribute in `compat.GRPO_STATE` is set by GRPOTrainer.__init__; the entropy controller's state is saved
    in TRL's checkpoints (so trainers that update it themselves resume exactly)."""
    trainer = _tiny_grpo(tmp_path, tiny_tokenizer, tiny_model_dir, use_adaptive_entropy=True)
    compat.check_grpo_state(trainer)
    assert compat.entropy_controller_state(trainer) == (float("inf"), None)
    compat.set_entropy_controller_state(trainer, 1.5, torch.ones(2))
    assert trainer._last_world_entropy == 1.5 and torch.equal(trainer._entropy_window_stats, torch.ones(2))
    saved = inspect.getsource(GRPOTrainer._save_checkpoint) + inspect.getsource(GRPOTrainer._load_optimizer_and_scheduler)
    assert saved.count("self._last_world_entropy") >= 2, compat.broken(
        "saves and restores _last_world_entropy in its checkpoints")
    del trainer._step
    with pytest.raises(RuntimeError, match=r"TRL .* no longer sets GRPOTrainer attributes \['_step'\]"):
        compat.check_grpo_state(trainer)


def test_vllm_generation_has_what_the_cpu_sync_uses():
    """The CPU weight sync (vllm_cpu.py) pushes what TRL's own sync pushes and clears TRL's sleeping-weights flag."""
    from trl.generation.vllm_generation import VLLMGeneration

    assert callable(getattr(VLLMGeneration, "_iter_named_params", None)), compat.broken(
        "has VLLMGeneration._iter_named_params (what sync_weights pushes)")
    source = inspect.getsource(VLLMGeneration)
    assert "self._iter_named_params()" in inspect.getsource(VLLMGeneration.sync_weights), compat.broken(
        "pushes VLLMGeneration._iter_named_params() in sync_weights")
    assert source.count("self._llm_weights_sleeping") >= 2, compat.broken(
        "tracks sleeping weights in VLLMGeneration._llm_weights_sleeping")


def test_grpo_hooks_check_names_what_changed(monkeypatch):
    compat.check_grpo_hooks("TPOTrainer")
    monkeypatch.delattr(GRPOTrainer, "_calculate_rewards")
    with pytest.raises(RuntimeError, match=r"TPOTrainer: TRL .* no longer has GRPOTrainer._calculate_rewards"):
        compat.check_grpo_hooks("TPOTrainer")
