"""The real-model M-steps protocol: TRL's schedule gives M optimizer steps per rollout for every method (counted on
the tiny model), any numeric Reasoning Gym task end to end, the task errors, and the analysis (bootstrap, seed counts,
verdicts, hull) against independent oracles."""

from __future__ import annotations

import itertools
import json
import math
import statistics
import warnings

import numpy as np
import pytest
from trl_isopo.compat import CHECKPOINTING_FIELD
from trl_isopo.methods import get_method
from trl_isopo.real.analysis import (Margins, bootstrap_means, final_points, paired_difference, runs_table,
                                     seeds_to_resolve, step_diagnostic, t_interval, t_quantile,
                                     sweep_table, verdicts)
from trl_isopo.real.figures import convex_hull, cpu_png, frontier_png
from trl_isopo.real.protocol import PROTOCOL_METHODS, Protocol, has_pi_old
from trl_isopo.real.run import RealRun, _config
from trl_isopo.real.schedule import rollout_config, rollout_schedule
from trl_isopo.real.task import ArithmeticTask, make_splits, task_from_cli
from trl_isopo.tiny import set_offline_env

set_offline_env()


# ------------------------------------------------------------------------------------------------ schedule
def test_rollout_schedule_fields():
    # 64 rows: M = 1 over 4 micro-batches of 16, M = 4 of one each: the same forward/backward work at every M
    assert rollout_schedule(64, 1, 16) == dict(per_device_train_batch_size=16, gradient_accumulation_steps=4,
                                               steps_per_generation=4)
    assert rollout_schedule(64, 4, 16) == dict(per_device_train_batch_size=16, gradient_accumulation_steps=1,
                                               steps_per_generation=4)
    assert rollout_schedule(64, 2, 0) == dict(per_device_train_batch_size=32, gradient_accumulation_steps=1,
                                              steps_per_generation=2)
    assert rollout_schedule(32) == dict(per_device_train_batch_size=32, gradient_accumulation_steps=1,
                                        steps_per_generation=1)  # `trl-isopo real`: one micro-batch, one step
    # a method's own GA (accumulation PROMA's) splits the mini-batch when no micro-batch is given
    assert rollout_schedule(32, 1, 0, 4) == dict(per_device_train_batch_size=8, gradient_accumulation_steps=4,
                                                 steps_per_generation=4)
    assert rollout_schedule(64, 2, 16, 4)["gradient_accumulation_steps"] == 2  # a given micro-batch decides
    for bad in ((64, 3, 0), (64, 4, 32), (64, 4, 12), (64, 0, 0), (32, 1, 0, 3)):
        with pytest.raises(ValueError):
            rollout_schedule(*bad)


def test_proma_real_job_keeps_one_rollout_per_optimizer_step(tmp_path):
    """PROMA's method entry asks for GA 4: the real job's 32-row rollout is split into 4 micro-batches of one step."""
    config = _config(RealRun(method="proma"), str(tmp_path), progress=False)
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps, config.steps_per_generation) == (
        8, 4, 4)


def test_configs_carry_no_deprecated_or_ignored_settings(tmp_path):
    """The main job's configuration: no FutureWarning (transformers 5 renamed gradient_checkpointing) and no
    model_init_kwargs (TRL prints that it ignores them for an instantiated model)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        config = _config(RealRun(method="tpo"), str(tmp_path), progress=False)
    assert config.model_init_kwargs is None and getattr(config, CHECKPOINTING_FIELD) is False


def test_protocol_runs_share_the_budget():
    p = Protocol()
    runs = {(m, k): p.run(m, 1e-5, 3, k) for m in PROTOCOL_METHODS for k in (1, 4)}
    for (m, k), run in runs.items():
        assert (run.rollouts(), run.steps, run.prompts_per_rollout * run.num_generations) == (8, 8 * k, 64)
        assert run.eval_every == 2 * k and not run.lora and run.eval_size >= 128
    assert len({r.key() for r in runs.values()}) == len(runs)
    assert [m for m in PROTOCOL_METHODS if not has_pi_old(m)] == ["isopo", "isopo-fig6"]
    assert not has_pi_old("proma") and not has_pi_old("proma-intra")
    epochs = Protocol(epochs=2)
    assert (epochs.run("grpo", 1e-5, 0, 4).steps, epochs.run("isopo", 1e-5, 0, 4).steps) == (64, 32)
    assert RealRun().key() == "isopo|lora|lr=0.0003|seed=0|steps=16|eval_sampled=False|kl_prompts=0"
    legacy = RealRun(eval_sampled=True, kl_prompts=8)  # the benchmark's first runs keep their stored keys
    assert legacy.key() == "isopo|lora|lr=0.0003|seed=0|steps=16"


def _count_schedule(method: str, m: int, model_dir, tokenizer, tmp_path, rollouts=2, prompts=4, k=4, micro=4,
                    iterations=1):
    """Train on the tiny model; per generation (rollout): the optimizer steps a callback counted before the next one,
    the rows generated and the distinct prompts."""
    from transformers import TrainerCallback

    from trl_isopo.tiny import tiny_prompt_dataset, tiny_reward

    spec = get_method(method)
    args = rollout_config(spec.config_cls, str(tmp_path / method), prompts=prompts, generations=k,
                          max_completion_length=4, temperature=1.0, learning_rate=1e-2,
                          max_steps=rollouts * m * iterations, seed=0, steps_per_rollout=m, micro_batch=micro,
                          **{**spec.fields, "num_iterations": iterations})
    # the model as a path: TRL builds grpo-kl's reference model from it
    trainer = spec.trainer_cls(model=model_dir, reward_funcs=tiny_reward, args=args,
                               train_dataset=tiny_prompt_dataset(64, seed=1), processing_class=tokenizer)
    counts, rows = [], []

    class CountSteps(TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            counts[-1] += 1

    generate = trainer._generate_and_score_completions

    def counted(inputs):
        counts.append(0)
        rows.append((len(inputs), len({json.dumps(x["prompt"]) for x in inputs})))
        return generate(inputs)

    trainer._generate_and_score_completions = counted
    trainer.add_callback(CountSteps())
    trainer.train()
    return counts, rows, trainer


@pytest.mark.parametrize("method", PROTOCOL_METHODS + ("proma",))
def test_m_optimizer_steps_per_rollout(method, tiny_model_dir, tiny_tokenizer, tmp_path):
    """M = 4 (GA 1) and M = 1 (GA 4, the same micro-batches): M optimizer steps between generations, each rollout
    P x K rows of P prompts; GRPO's clip and TPO's frozen target see a pi_old only when M > 1."""
    micro = 2 if method == "proma" else 4  # accumulation PROMA needs GA >= 2 at every M
    counts, rows, trainer = _count_schedule(method, 4, tiny_model_dir, tiny_tokenizer, tmp_path, micro=micro)
    assert counts == [4, 4] and rows == [(16, 4), (16, 4)] and trainer.state.global_step == 8
    assert trainer.args.gradient_accumulation_steps == 4 // micro
    assert ("old_per_token_logps" in trainer._buffered_inputs[0]) == has_pi_old(method)
    counts, rows, trainer = _count_schedule(method, 1, tiny_model_dir, tiny_tokenizer, tmp_path, micro=micro)
    assert counts == [1, 1] and rows == [(16, 4), (16, 4)]
    if method != "tpo":  # (TPO stores its loss forward's detached log-probs there as p_old)
        assert "old_per_token_logps" not in trainer._buffered_inputs[0]  # one step per rollout: TRL skips pi_old


def test_epochs_multiply_the_steps_of_a_method_with_pi_old(tiny_model_dir, tiny_tokenizer, tmp_path):
    counts, rows, _ = _count_schedule("grpo", 2, tiny_model_dir, tiny_tokenizer, tmp_path, iterations=2)
    assert counts == [4, 4] and rows == [(16, 4), (16, 4)]


# ------------------------------------------------------------------------------------------------ tasks
def test_task_from_cli_and_its_errors():
    assert task_from_cli(None, None) == ArithmeticTask()
    assert task_from_cli("gcd", None).config == {} and task_from_cli("gcd", '{"max_value": 9}').config == {
        "max_value": 9}
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(ValueError, match="--task-config"):
            task_from_cli("gcd", bad)


def test_a_second_numeric_task_has_disjoint_numeric_splits():
    train, held_out, proc = make_splits(task_from_cli("basic_arithmetic", None), n_train=64, n_eval=128)
    questions = {json.loads(e)["question"] for e in train["entry"]}
    assert len(held_out) == 128 and not questions & {e["question"] for e in held_out}
    assert all(proc.score_answer(str(e["answer"]), e) == 1.0 for e in held_out)


def test_task_errors():
    with pytest.raises(ValueError, match="not numeric"):
        make_splits(task_from_cli("letter_jumble", None), n_train=8, n_eval=8)
    with pytest.raises(ValueError, match="disjoint"):  # 3 x 3 pairs of values: no 16 new questions
        make_splits(task_from_cli("gcd", '{"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 3}'),
                    n_train=8, n_eval=16)
    with pytest.raises(ValueError, match="Unknown Reasoning Gym task"):
        make_splits(task_from_cli("no_such_task", None), n_train=8, n_eval=8)


def test_cli_reports_task_errors_before_loading_a_model(capsys):
    from trl_isopo.scripts.real import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--task", "letter_jumble", "--quick"])
    assert exit_info.value.code == 2 and "is not numeric" in capsys.readouterr().err


def test_any_numeric_task_end_to_end_on_the_tiny_model(tmp_path):
    """`--task basic_arithmetic` through `train_real` (M = 2, 2 rollouts): splits, evaluations, per-step log, the
    schedule's generation steps, CPU-seconds."""
    from trl_isopo.real.run import train_real
    from trl_isopo.tiny import load_tiny_tokenizer, make_tiny_model_dir

    path = make_tiny_model_dir(str(tmp_path / "tiny"))
    run = RealRun(method="grpo", lora=False, learning_rate=1e-3, steps=4, prompts_per_rollout=2, num_generations=4,
                  max_completion_length=4, eval_size=4, eval_every=2, eval_sampled=True, kl_prompts=2, kl_samples=1,
                  model=path, steps_per_rollout=2, task=task_from_cli("basic_arithmetic", None))
    record = train_real(run, str(tmp_path / "out"), progress=False, save_model=False,
                        tokenizer=load_tiny_tokenizer(path))
    assert record["generation_steps"] == [0, 2]
    assert [e["step"] for e in record["evals"]] == [0, 2, 4] and [e["rollout"] for e in record["evals"]] == [0, 1, 2]
    assert [row["step"] for row in record["step_log"]] == [1, 2, 3, 4]
    assert all("clip_ratio/region_mean" in row for row in record["step_log"])
    assert record["settings"]["task"]["name"] == "basic_arithmetic" and "task=basic_arithmetic{}" in record["key"]
    assert record["train_cpu_seconds"] > 0 and record["eval_cpu_seconds"] > 0
    assert record["evals"][-1]["train_cpu_seconds"] == pytest.approx(record["train_cpu_seconds"])
    assert record["params_finite"]


@pytest.mark.slow
def test_second_task_two_steps_on_the_real_model(tmp_path):
    """`trl-isopo real --task basic_arithmetic --quick`: the base model's accuracy first, 2 steps on the real model."""
    pytest.importorskip("gguf")
    from trl_isopo.cli import main

    rc = main(["real", "--task", "basic_arithmetic", "--task-config", '{"min_terms": 2, "max_terms": 2}', "--quick",
               "--output-dir", str(tmp_path), "--no-progress", "--threads", "2", "--malloc", "system"])
    record = json.loads((tmp_path / "run.json").read_text())
    assert rc == 0 and record["settings"]["task"]["name"] == "basic_arithmetic" and len(record["step_log"]) == 2


# ------------------------------------------------------------------------------------------------ analysis
def test_bootstrap_means_match_exhaustive_enumeration():
    """n = 3 seeds: the 27 equally likely resamples give the exact distribution of the bootstrap mean."""
    d = [0.1, -0.4, 0.9]
    exact = sorted(statistics.mean(c) for c in itertools.product(d, repeat=3))
    draws = bootstrap_means(d, 60_000, np.random.default_rng(1))
    for x in (-0.4, -0.1, 0.2, 0.5, 0.9):
        p = sum(v <= x + 1e-12 for v in exact) / len(exact)
        assert abs(np.mean(draws <= x + 1e-12) - p) < 4 * math.sqrt(p * (1 - p) / 60_000) + 1e-9
    assert np.all(bootstrap_means([0.3] * 5, 100, np.random.default_rng(0)) == 0.3)


def test_t_quantile_closed_forms_and_normal_limit():
    """df = 1 (Cauchy) and df = 2 have closed-form quantiles; large df tends to the normal."""
    for p in (0.9, 0.975, 0.995):
        assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-7)
        assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-7)
    assert t_quantile(0.975, 100_000) == pytest.approx(statistics.NormalDist().inv_cdf(0.975), rel=1e-4)


def test_verdict_needs_the_t_interval_too():
    """3 paired seeds whose differences are all < 0: the bootstrap interval (inside their range) clears 0, Student's
    t (df = 2, closed form half-width) does not, so the claim stays unresolved."""
    d = [-0.1, -0.5, -0.05]
    lo, hi = t_interval(d)
    half = (2 * 0.975 - 1) / math.sqrt(2 * 0.975 * 0.025) * statistics.stdev(d) / math.sqrt(3)
    assert (lo, hi) == pytest.approx((statistics.mean(d) - half, statistics.mean(d) + half))
    grpo = [_record("grpo", s, 0.5, 2.0) for s in range(3)]
    iso = [_record("isopo", s, 0.5, 2.0 + x) for s, x in enumerate(d)]
    diff = paired_difference(final_points(grpo + iso), "isopo", "grpo", 4, "kl", n_boot=2000)
    assert diff.hi < 0 < diff.t_hi and not diff.clears(0.0, below=True)
    assert "(t: [" in diff.text()


def test_unresolved_caps_the_seed_count_near_the_boundary():
    """A score difference of -0.049 against the -0.05 margin needs tens of thousands of seeds: said as 'more than'."""
    d = [-0.02, -0.09, -0.03, -0.056]  # mean -0.049, SD about 0.031
    grpo = [_record("grpo", s, 0.5, 1.0) for s in range(4)]
    tpo = [_record("tpo", s, 0.5 + x, 1.0 + 0.1 * (s % 2) - 0.2) for s, x in enumerate(d)]
    c = verdicts(final_points(grpo + tpo), n_boot=2000)[0]
    assert seeds_to_resolve(statistics.mean(d), statistics.stdev(d), -0.05) > 1000
    assert "more than 1000 paired seeds: the observed mean is 0.001 from the boundary -0.050" in c


def test_seeds_to_resolve_against_tables():
    """The one-sample t-test size. d = 0.5 SD: 34 (R's power.t.test(delta = 0.5, sd = 1, type = "one.sample",
    power = 0.8) gives n = 33.37). gap 0.15, SD 0.1: printed t tables give n = 5 -> (2.776 + 0.941)^2 / 1.5^2 = 6.14
    > 5 and n = 6 -> (2.571 + 0.920)^2 / 1.5^2 = 5.42 <= 6, so 6; the normal approximation would say 4."""
    assert seeds_to_resolve(0.5, 1.0) == 34
    assert seeds_to_resolve(0.1, 0.1, boundary=-0.05) == 6
    assert ((2.776 + 0.941) / 1.5) ** 2 > 5 and ((2.571 + 0.920) / 1.5) ** 2 <= 6
    assert seeds_to_resolve(1.0, 0.01) == 3  # never fewer than a difference needs
    assert seeds_to_resolve(0.0, 1.0) is None


def _record(method, seed, score, kl, m=4, lr=1e-5, cpu=100.0):
    return {"settings": {"method": method, "seed": seed, "learning_rate": lr, "steps_per_rollout": m, "lora": False,
                         "task": {"name": "chain_sum"}, "prompts_per_rollout": 8, "num_generations": 8,
                         "eval_size": 128},
            "evals": [{"step": 0, "greedy": 0.2, "kl": 0.0, "train_cpu_seconds": 0.0},
                      {"step": 32, "greedy": score, "kl": kl, "train_cpu_seconds": cpu}],
            "train_cpu_seconds": cpu}


def _synthetic():
    rng = np.random.default_rng(0)
    out = []
    for s in range(5):
        base = 0.4 + 0.1 * rng.standard_normal()
        out += [_record("grpo", s, base, 3.0 + 0.05 * s), _record("reinforce", s, base + 0.001, 5.0 + 0.05 * s),
                _record("isopo", s, base, 2.0 + 0.04 * s),  # clearly less KL, the same score
                _record("tpo", s, base - 0.3, 2.0 + (1.5 if s % 2 else -1.5))]  # lower score, KL unresolved
    return out


def test_verdicts_on_synthetic_runs(tmp_path):
    points = final_points(_synthetic())
    d = paired_difference(points, "isopo", "reinforce", 4, "kl", n_boot=2000)
    assert d.n == 5 and d.mean == pytest.approx(-3.0 - 0.01 * 2) and d.hi < 0
    lines = verdicts(points, Margins(), n_boot=2000)
    assert any(line.startswith("(a) M=4") and ": yes." in line for line in lines)
    assert any(line.startswith("(b) M=4") and ": yes," in line for line in lines)
    c = next(line for line in lines if line.startswith("(c) M=4"))
    assert ": no, TPO scores lower" in c
    two = final_points([r for r in _synthetic() if r["settings"]["seed"] < 2])  # too few seeds for any verdict
    assert paired_difference(two, "isopo", "reinforce", 4, "kl") is None
    assert all("no verdict" in line and "at least 3 paired seeds" in line for line in verdicts(two, n_boot=200))
    noisy = [r for r in _synthetic() if r["settings"]["method"] in ("grpo", "tpo")]
    for r in noisy:
        if r["settings"]["method"] == "tpo":
            r["evals"][-1]["greedy"] += 0.3
            r["evals"][-1]["kl"] = 3.0 + 0.05 * r["settings"]["seed"] + (2.0 if r["settings"]["seed"] % 2 else -2.0)
    c = verdicts(final_points(noisy), n_boot=2000)[0]
    assert "not resolved at this power (KL difference" in c and "paired seeds would resolve" in c
    frontier_png(_synthetic(), str(tmp_path / "f.png"))
    cpu_png(_synthetic(), str(tmp_path / "c.png"))
    assert (tmp_path / "f.png").stat().st_size > 0 and (tmp_path / "c.png").stat().st_size > 0


def test_final_points_pick_the_lr_with_most_seeds_and_sweep_picks():
    runs = [_record("grpo", s, 0.5, 1.0) for s in range(3)] + [_record("grpo", 100, 0.9, 1.0, lr=3e-5)]
    assert {v["lr"] for v in final_points(runs)[(4, "grpo")].values()} == {1e-5}
    assert set(final_points(runs, {"grpo": 3e-5})[(4, "grpo")]) == {100}
    with pytest.raises(ValueError, match="pick one"):
        final_points([_record("tpo", 0, 0.5, 1.0), _record("tpo", 0, 0.5, 1.0, lr=3e-5)])
    _, picks = sweep_table([_record("tpo", 100, 0.5, 1.0), _record("tpo", 100, 0.6, 2.0, lr=3e-5),
                            _record("tpo", 100, 0.6, 1.5, lr=1e-4)])
    assert picks == {(4, "tpo"): 1e-4}  # the best score; the tie goes to the smaller KL


def test_step_diagnostics_per_method():
    clip = [0.5, 0.1, 0.2, 0.3, 0.7, 0.4, 0.0, 0.6]  # steps 1-8, generations before steps 1 and 5
    rec = _record("grpo", 0, 0.5, 1.0)
    rec.update(step_log=[{"step": i + 1, "clip_ratio/region_mean": c} for i, c in enumerate(clip)],
               generation_steps=[0, 4])
    name, value = step_diagnostic(rec)
    assert name == "clip fraction" and value == pytest.approx((0.1 + 0.2 + 0.3 + 0.4 + 0.0 + 0.6) / 6)
    rec["step_log"] = [{"step": i + 1, "clip_ratio/region_mean": 0.0, "isopo/scale_spread": 0.5 * i} for i in range(4)]
    assert step_diagnostic(rec) == ("scale spread", pytest.approx(0.75))
    rec["step_log"] = [{"step": i + 1, "tpo/max_abs_p_minus_q": v} for i, v in enumerate([0.2, 0.4])]
    assert step_diagnostic(rec) == ("max \\|p−q\\|", pytest.approx(0.3))
    rec.update(step_log=[{"step": 1, "clip_ratio/region_mean": 0.9}], generation_steps=[0])
    assert math.isnan(step_diagnostic(rec)[1])  # only first steps: nothing could be clipped
    rec.update(cpu_seconds=1234.4, evals=[{"rollout": 0, "greedy": 0.2, "kl": 0.0},
                                          {"rollout": 8, "greedy": 0.51, "sampled": 0.4, "kl": 1.234}])
    table = runs_table([_record("tpo", 1, 0.3, 2.0), rec])
    assert "greedy score at rollouts 0 / 8 |" in table
    assert "| 0 | 4 | `grpo` | 1e-05 | 0.200 / 0.510 | 0.400 | 1.23 | clip fraction nan | 1234 |" in table
    assert table.index("`grpo`") < table.index("`tpo`")  # seed-major


def test_convex_hull_against_brute_force():
    rng = np.random.default_rng(3)
    pts = [tuple(p) for p in rng.random((25, 2)).round(6)]
    hull = convex_hull(pts)
    # oracle: a point is a hull vertex iff some direction makes it the unique maximum of <u, p>
    angles = np.linspace(0, 2 * np.pi, 20_000, endpoint=False)
    arr = np.array(pts)
    extreme = {tuple(arr[i]) for i in np.argmax(arr @ np.stack([np.cos(angles), np.sin(angles)]), axis=0)}
    assert set(hull) == extreme
    area = 0.5 * sum(a[0] * b[1] - b[0] * a[1] for a, b in zip(hull, hull[1:] + hull[:1]))
    assert area > 0  # counter-clockwise
    assert convex_hull([(0, 0), (1, 1)]) == [(0, 0), (1, 1)]


def test_protocol_script_pick_and_analyze(tmp_path, capsys):
    """`real_model_protocol.py pick` and `analyze` on stored records: the tables, the verdicts, the two PNGs."""
    import importlib.util
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("rmp", os.path.join(root, "benchmarks", "real_model_protocol.py"))
    rmp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rmp)
    results = tmp_path / "protocol.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in _synthetic()))
    assert rmp.main(["analyze", "--results", str(results), "--figures", str(tmp_path / "fig"), "--bootstrap",
                     "500", "--out", str(tmp_path / "analysis-out")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "analysis-out").read_text() in out and "per run:" in out
    assert "| 4 | ISOPO (p=-1, c=0) | 1e-05 | 5 |" in out and "(a) M=4" in out and "(c) M=4" in out
    assert rmp.main(["analyze", "--results", str(results), "--figures", str(tmp_path / "fig"), "--bootstrap",
                     "500", "--seeds", "0-2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("12 runs;") and "| 4 | ISOPO (p=-1, c=0) | 1e-05 | 3 |" in out
    assert rmp.main(["analyze", "--results", str(results), "--seeds", "7"]) == 1
    assert "no results in" in capsys.readouterr().out
    assert (tmp_path / "fig-frontier.png").exists() and (tmp_path / "fig-cpu.png").exists()
    assert rmp.main(["pick", "--results", str(results)]) == 0
    assert "M=4: --methods grpo=1e-05,isopo=1e-05,reinforce=1e-05,tpo=1e-05" in capsys.readouterr().out
    todo = rmp.protocol_runs(rmp.build_parser().parse_args(["run", "--methods", "grpo=1e-5,isopo", "--lrs", "3e-5",
                                                            "--seeds", "0-1"]))
    assert [(r.seed, r.steps_per_rollout, r.method) for r in todo][:3] == [(0, 1, "grpo"), (0, 1, "isopo"),
                                                                          (0, 4, "grpo")]
    assert len(todo) == 8 and {r.learning_rate for r in todo} == {1e-5, 3e-5}
