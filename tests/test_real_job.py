"""The real-model job (`trl-isopo real`) and its pieces: splits, evaluation, KL probe, the CLI end to end."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from trl_isopo.real.evaluate import _completion_logprobs, generate_completions, sequence_kl
from trl_isopo.real.task import ArithmeticTask, make_splits, score_text
from trl_isopo.tiny import build_tiny_causal_lm, build_word_tokenizer, set_offline_env

set_offline_env()


def test_held_out_questions_are_never_in_the_training_split():
    task = ArithmeticTask()
    train, held_out, proc = make_splits(task, n_train=400, n_eval=64)
    train_questions = {json.loads(e)["question"] for e in train["entry"]}
    assert len(held_out) == 64
    assert len({e["question"] for e in held_out}) == 64
    assert not train_questions & {e["question"] for e in held_out}
    # the last number of the completion is the answer
    entry = held_out[0]
    assert score_text(proc, f"The answer is {entry['answer']}.", entry) == 1.0
    assert score_text(proc, f"{entry['answer']} is not {int(entry['answer']) + 1}", entry) == 0.0
    assert score_text(proc, "no number", entry) == 0.0


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    tok = build_word_tokenizer()
    model = build_tiny_causal_lm(tok, seed=0).to(torch.float64).eval()
    return model, tok


def test_completion_logprobs_match_unpadded_forward(tiny):
    model, tok = tiny
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    completions = [torch.tensor([10, 11]), torch.tensor([12, 13, 14, 15])]
    got = _completion_logprobs(model, prompts, completions, tok.pad_token_id, "cpu")
    for p, c, lp in zip(prompts, completions, got):
        seq = torch.cat([p, c]).unsqueeze(0)
        ref = model(seq).logits[0, p.numel() - 1 : -1].float().log_softmax(-1)
        torch.testing.assert_close(lp, ref, atol=1e-5, rtol=1e-5)


def test_sequence_kl_zero_for_the_same_model_and_positive_after_a_change(tiny):
    model, tok = tiny
    prompts = tok.apply_chat_template([[{"role": "user", "content": "a b c"}]], tokenize=False,
                                      add_generation_prompt=True)
    assert sequence_kl(model, model, tok, prompts, samples=4, max_new_tokens=3) == 0.0
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.add_(0.5 * torch.randn_like(other.lm_head.weight))
    kl = sequence_kl(other, model, tok, prompts, samples=4, max_new_tokens=3)
    assert kl > 0.0
    # the same number through the context-manager form (how a PEFT model's disable_adapter is used)
    import contextlib

    @contextlib.contextmanager
    def swap_to_reference():
        saved = other.lm_head.weight.detach().clone()
        other.lm_head.weight.data.copy_(model.lm_head.weight.data)
        try:
            yield
        finally:
            other.lm_head.weight.data.copy_(saved)

    assert sequence_kl(other, swap_to_reference, tok, prompts, samples=4, max_new_tokens=3) == pytest.approx(kl)


def test_sequence_kl_matches_the_exact_kl_of_one_step(tiny):
    """With one new token the estimator is exact: KL of the next-token distributions, whatever was sampled."""
    model, tok = tiny
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.lm_head.weight.add_(0.3 * torch.randn_like(other.lm_head.weight))
    prompt = tok.apply_chat_template([[{"role": "user", "content": "a b"}]], tokenize=False,
                                     add_generation_prompt=True)[0]
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        lp = other(ids).logits[0, -1].double().log_softmax(-1)
        lq = model(ids).logits[0, -1].double().log_softmax(-1)
    exact = float((lp.exp() * (lp - lq)).sum())
    assert sequence_kl(other, model, tok, [prompt], samples=3, max_new_tokens=1) == pytest.approx(exact, rel=1e-4)


def test_sampling_does_not_touch_the_global_rng(tiny):
    model, tok = tiny
    prompts = tok.apply_chat_template([[{"role": "user", "content": "a"}]], tokenize=False, add_generation_prompt=True)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a, _, _ = generate_completions(model, tok, prompts, 3, greedy=False, seed=7)
    assert torch.equal(torch.rand(3), expected)
    b, _, _ = generate_completions(model, tok, prompts, 3, greedy=False, seed=7)
    assert a == b


@pytest.mark.slow
def test_real_quick_job_end_to_end(tmp_path, monkeypatch):
    """`trl-isopo real --quick`: base and trained held-out accuracy, weights, card, plot, raw numbers; by default it
    asks glibc to keep freed memory (recorded here rather than applied to the test process)."""
    pytest.importorskip("gguf")
    from trl_isopo import cpu_alloc
    from trl_isopo.cli import main

    calls = []
    monkeypatch.setattr(cpu_alloc, "keep_freed_memory", lambda *a, **k: calls.append((a, k)) or True)
    rc = main(["real", "--quick", "--output-dir", str(tmp_path), "--no-progress", "--threads", "2"])
    assert rc == 0 and len(calls) == 1
    record = json.loads((tmp_path / "run.json").read_text())
    assert [e["step"] for e in record["evals"]] == [0, 2]
    assert record["params_finite"]
    assert len(record["rewards"]) == 2
    assert (tmp_path / "real_curves.png").stat().st_size > 0
    assert (tmp_path / "model" / "adapter_model.safetensors").exists()
    card = (tmp_path / "model" / "README.md").read_text()
    assert "ISOPO" in card or "isopo" in card
    assert "held-out accuracy" in (tmp_path / "real_table.txt").read_text()


@pytest.mark.slow
def test_benchmark_run_records_accuracy_score_and_kl(tmp_path):
    """The learning benchmark's run: greedy and sampled accuracy and score, KL on probe prompts, per-step rewards and
    seconds, finite parameters; tiny sizes on the real model."""
    pytest.importorskip("gguf")
    from trl_isopo.real.run import RealRun, train_real

    run = RealRun(method="isopo", steps=2, prompts_per_rollout=2, num_generations=2, max_completion_length=6,
                  eval_size=4, eval_every=1, eval_sampled=True, kl_prompts=2, kl_samples=1, learning_rate=1e-3)
    record = train_real(run, str(tmp_path), progress=False, save_model=False)
    assert [e["step"] for e in record["evals"]] == [0, 1, 2]
    for e in record["evals"]:
        assert {"greedy", "greedy_exact", "sampled", "sampled_exact", "kl"} <= set(e)
        assert 0.0 <= e["greedy_exact"] <= e["greedy"] <= 1.0
    # 0 before training; after it >= 0 (with 4 short completions the rewards may all tie: no update, KL exactly 0)
    assert record["evals"][0]["kl"] == 0.0 and record["evals"][-1]["kl"] >= 0.0
    assert len(record["rewards"]) == len(record["step_seconds"]) == 2 and record["params_finite"]
