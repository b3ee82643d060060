"""ISOPO never pays for TRL's old-log-prob forward it would discard (a rollout feeding several optimizer steps).

With steps_per_generation = 2 x gradient_accumulation_steps (the shape of the Qwen3-0.6B ISOPO recipes) TRL runs a
no-grad forward over the whole generation batch for `old_per_token_logps`; ISOPO has no importance ratio, so its
policy forwards per optimizer step are GRPO's minus that one. The KL term's bias correction (beta > 0) reads them:
there they are kept. num_iterations > 1 (each rollout used for several passes, recomputed at the current policy)
likewise runs no such forward.
"""

import pytest
from trl import GRPOConfig, GRPOTrainer

from trl_isopo import ISOPOConfig, ISOPOTrainer
from trl_isopo.tiny import tiny_prompt_dataset, tiny_reward, tiny_training_args

B, GA = 4, 2


def count_forwards(trainer_cls, config_cls, model_dir, tokenizer, tmp_path, **overrides):
    """(policy forwards outside generation, of which without gradients, optimizer steps, non-null old log-probs)."""
    kwargs = dict(per_device_train_batch_size=B, num_generations=4, gradient_accumulation_steps=GA,
                  steps_per_generation=2 * GA, max_completion_length=4, max_steps=4, learning_rate=1e-3, seed=0)
    kwargs.update(overrides)
    args = config_cls(**tiny_training_args(tmp_path / trainer_cls.__name__, **kwargs))
    trainer = trainer_cls(model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(64),
                          processing_class=tokenizer)
    import torch

    state = {"generating": False, "forwards": 0, "no_grad": 0, "old": 0}
    generate = trainer._generate

    def counted_generate(*a, **kw):
        state["generating"] = True
        try:
            return generate(*a, **kw)
        finally:
            state["generating"] = False

    trainer._generate = counted_generate

    def hook(module, args, kwargs):
        if not state["generating"]:
            state["forwards"] += 1
            state["no_grad"] += not torch.is_grad_enabled()

    handle = trainer.model.register_forward_pre_hook(hook, with_kwargs=True)
    score = trainer._generate_and_score_completions

    def counted_score(*a, **kw):
        out = score(*a, **kw)
        state["old"] += out.get("old_per_token_logps") is not None
        return out

    trainer._generate_and_score_completions = counted_score
    try:
        trainer.train()
    finally:
        handle.remove()
    return state["forwards"], state["no_grad"], trainer.state.global_step, state["old"]


def test_isopo_skips_the_old_logprob_forward(tiny_model_dir, tiny_tokenizer, tmp_path):
    grpo = count_forwards(GRPOTrainer, GRPOConfig, tiny_model_dir, tiny_tokenizer, tmp_path)
    isopo = count_forwards(ISOPOTrainer, ISOPOConfig, tiny_model_dir, tiny_tokenizer, tmp_path)
    steps = 4
    # Per rollout (2 optimizer steps x GA micro-batches): GRPO adds one no-grad forward over the generation batch,
    # in steps_per_generation chunks of B sequences.
    assert grpo[2] == isopo[2] == steps
    assert isopo[0] == steps * GA and isopo[1] == 0 and isopo[3] == 0
    rollouts = steps // 2
    assert grpo[1] == rollouts * 2 * GA and grpo[3] == rollouts
    assert isopo[0] == grpo[0] - grpo[1]


def test_isopo_keeps_old_logprobs_for_the_bias_corrected_kl(tiny_model_dir, tiny_tokenizer, tmp_path):
    forwards, no_grad, steps, old = count_forwards(ISOPOTrainer, ISOPOConfig, tiny_model_dir, tiny_tokenizer, tmp_path,
                                                   beta=0.1, use_bias_correction_kl=True, max_steps=2)
    assert steps == 2 and old == 1 and no_grad >= 2 * GA  # old log-probs (and the reference's) per rollout


@pytest.mark.parametrize("num_iterations", [2])
def test_isopo_num_iterations_reuses_rollouts_without_old_logprobs(tiny_model_dir, tiny_tokenizer, tmp_path,
                                                                    num_iterations):
    forwards, no_grad, steps, old = count_forwards(ISOPOTrainer, ISOPOConfig, tiny_model_dir, tiny_tokenizer, tmp_path,
                                                   num_iterations=num_iterations)
    # 4 optimizer steps: one rollout of steps_per_generation = 4 micro-batches, passed over twice.
    assert steps == 4 and forwards == steps * GA and no_grad == 0 and old == 0
