"""TPO with `per_device_train_batch_size` not a multiple of `num_generations`: groups split over micro-batches and
processes, exact when every generation batch is used inside one optimizer step at its rollout parameters."""

import math

import pytest
import torch
from tpo_support import TWO_PROC_SCRIPT, base_args, two_proc

from trl_isopo import TPOTrainer
from trl_isopo.tiny import tiny_prompt_dataset, tiny_reward
from trl_isopo.tpo.target import tpo_row_coefficients, tpo_target

LOGGED = ("loss", "policy_loss", "tpo/kl_q_p", "tpo/max_abs_p_minus_q", "tpo/target_entropy", "grad_norm")


def _max_rel_diff(a, b):
    scale = max(d.abs().max().item() for d in a.values())
    return max((a[n] - b[n]).abs().max().item() for n in a) / scale


# ================================================================================================ the pure form
def test_row_coefficients_match_autograd_of_the_group_loss():
    """c = dL/dl at l_old (plain float64 autograd of -sum q log softmax over the valid members) and sum_i r_i = L_g."""
    gen = torch.Generator().manual_seed(0)
    G, K = 5, 4
    l_old = torch.randn(G, K, generator=gen, dtype=torch.float64) * 3
    valid = torch.rand(G, K, generator=gen) > 0.2
    valid[1] = False  # a group without a valid member
    valid[2] = torch.tensor([True, False, False, False])  # one valid member: q = p = 1 there, no gradient
    q = tpo_target(l_old, torch.randn(G, K, generator=gen, dtype=torch.float64), valid, eta=0.7)

    l = l_old.clone().requires_grad_(True)
    losses = []
    for g in range(G):
        idx = valid[g].nonzero().flatten()
        if idx.numel() == 0:
            losses.append(torch.zeros((), dtype=torch.float64))
            continue
        logp = l[g, idx] - torch.logsumexp(l[g, idx], 0)
        losses.append(-(q[g, idx] * logp).sum())
    torch.stack(losses).sum().backward()

    coef, row_ce = tpo_row_coefficients(l_old, q, valid)
    assert coef.dtype == torch.float64
    torch.testing.assert_close(coef, l.grad, rtol=0, atol=1e-14)
    torch.testing.assert_close(row_ce.sum(-1), torch.stack(losses).detach(), rtol=0, atol=1e-13)
    assert coef[~valid].abs().max() == 0 and row_ce[~valid].abs().max() == 0
    assert coef.abs().max() > 0.1  # not trivially zero


# ================================================================================================ in the trainer
@pytest.mark.parametrize(
    "whole_schedule,split_schedule",
    [
        # one use of each generation batch per optimizer step: coefficients from the generation-time forward
        (dict(per_device=8, ga=1, num_iterations=1), dict(per_device=2, ga=4, num_iterations=1)),
        # two uses, one step each: the second use recomputes p_theta - q after the first step moved theta
        (dict(per_device=8, ga=1, num_iterations=2), dict(per_device=2, ga=4, num_iterations=2)),
        # two uses inside one step: theta never moves, the generation-time coefficients serve both
        (dict(per_device=8, ga=2, num_iterations=2, steps_per_generation=1),
         dict(per_device=2, ga=8, num_iterations=2, steps_per_generation=4)),
    ],
)
def test_split_micro_batches_give_the_whole_group_update(tiny_model_dir, tmp_path, whole_schedule, split_schedule):
    """2 rows per micro-batch (half a group of 4) == whole groups of 4: parameters and logged metrics."""
    whole, logs_whole, checks_whole, _ = two_proc.run(tiny_model_dir, str(tmp_path / "a"), **whole_schedule)
    split, logs_split, checks_split, trainer = two_proc.run(tiny_model_dir, str(tmp_path / "b"), **split_schedule)
    assert all(c["whole_groups"] for c in checks_whole)
    assert {c["rows"] for c in checks_split} == {2} and not any(c["whole_groups"] for c in checks_split)
    assert max(d.abs().max().item() for d in whole.values()) > 1e-3
    assert _max_rel_diff(whole, split) < 1e-5
    for a, b in zip(logs_whole[:2], logs_split[:2]):
        for key in LOGGED:
            assert (key in a) == (key in b), key  # generation-side metrics only in steps that generate
            if key in a:
                assert math.isclose(a[key], b[key], rel_tol=1e-5), key
    # TPO's own p_old forward ran (the loss forward cannot see a whole group), so p_old is in every micro-batch.
    assert trainer._buffered_inputs[0]["old_per_token_logps"] is not None


@pytest.mark.multiprocess
@pytest.mark.parametrize("num_iterations", [1, 2])
def test_groups_split_over_two_processes(tiny_model_dir, tmp_path, num_iterations):
    """2 processes x 2 rows: each group of 4 straddles the processes, in training (with a reuse after a step moved
    the parameters: num_iterations=2) and in evaluation."""
    from _launch import launch_two_processes

    out = tmp_path / "two" / "out.pt"
    out.parent.mkdir()
    launch_two_processes(str(TWO_PROC_SCRIPT), tiny_model_dir, str(out), "2", "1", str(num_iterations), "2")
    res = torch.load(out)
    assert res["world_size"] == 2 and res["rank_param_diff"] == 0.0
    assert sorted({c["rank"] for c in res["checks"]}) == [0, 1]
    assert not any(c["whole_groups"] for c in res["checks"] if c["rows"] == 2)
    one, logs_one, _, _ = two_proc.run(
        tiny_model_dir, str(tmp_path / "a"), per_device=4, ga=1, num_iterations=num_iterations, eval_batch=4
    )
    assert _max_rel_diff(one, res["deltas"]) < 1e-5
    # One group per step at lr 0.05 nearly fits q in one step: the second step's p - q is ~1e-5, float32 noise there.
    for a, b in zip(logs_one[:2], res["logs"][:2]):
        for key in LOGGED:
            assert (key in a) == (key in b), key
            if key in a:
                assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-5), key
    eval_one, eval_two = logs_one[-1], res["logs"][-1]
    assert eval_one["eval_loss"] > 0
    for key in ("eval_loss", "eval_tpo/kl_q_p", "eval_tpo/target_entropy"):
        assert math.isclose(eval_one[key], eval_two[key], rel_tol=1e-5), key


# ================================================================================================ where it is refused
@pytest.mark.parametrize("ga,spg", [(1, 2), (2, 4), (4, 8)])
def test_split_groups_refused_over_several_optimizer_steps(tmp_path, ga, spg):
    with pytest.raises(ValueError) as err:
        base_args(
            tmp_path, per_device_train_batch_size=2, num_generations=4, gradient_accumulation_steps=ga,
            steps_per_generation=spg,
        )
    msg = str(err.value)
    assert "per_device_train_batch_size=2 is not a multiple of num_generations=4" in msg
    assert f"got steps_per_generation={spg}, gradient_accumulation_steps={ga}" in msg
    assert "(4, 8, 12, ...)" in msg and "[2]" in msg


def test_trainer_revalidates_split_groups(tiny_model_dir, tiny_tokenizer, tmp_path):
    args = base_args(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_iterations=2)
    args.steps_per_generation = 4  # changed after __post_init__
    with pytest.raises(ValueError, match="not a multiple of num_generations"):
        TPOTrainer(
            tiny_model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(8),
            processing_class=tiny_tokenizer,
        )
