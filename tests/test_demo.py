"""`trl-isopo demo --quick` and `trl-isopo compare`: real (tiny) training through the four trainers, offline."""

import csv
import json
import math

import pytest

from trl_isopo.lab.methods import DEMO_METHODS, available

FOUR = ["grpo", "reinforce", "isopo", "tpo"]


def _require_trainers():
    # Guard only for the period before ISOPO/TPO land; by the end all four must import (see the final assert below).
    missing = [m for m in FOUR if not available(m)]
    if missing:
        pytest.skip(f"trainers not importable yet: {missing}")


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    _require_trainers()
    from trl_isopo.cli import main

    out = tmp_path_factory.mktemp("demo")
    rc = main(["demo", "--quick", "--output-dir", str(out), "--no-progress", "--threads", "1"])
    return rc, out


def test_demo_methods_are_the_four():
    assert list(DEMO_METHODS) == FOUR


def test_quick_demo_outputs(quick_demo):
    rc, out = quick_demo
    assert rc == 0
    data = json.loads((out / "demo_results.json").read_text())
    results = data["results"]
    assert [r["method"] for r in results] == FOUR
    episodes = results[0]["setting"]["episodes"]
    for r in results:
        assert len(r["exact_error"]) == len(r["token_error"]) == episodes
        assert all(0.0 <= e <= 1.0 for e in r["exact_error"])
        assert r["kl"][0] == 0.0 and r["final_kl"] > 0.0  # real training moved every policy
        assert r["wall_s"] > 0
    # Same seed -> same initial model, prompts and sampling RNG: the first rollouts are identical for every method.
    assert len({r["exact_error"][0] for r in results}) == 1
    # (1/2)^4 success at init, measured on 16 x 8 rollouts; far from 0 and 1.
    assert 0.8 < results[0]["exact_error"][0] < 1.0
    for label in ("GRPO", "REINFORCE", "ISOPO (p=-1)", "TPO"):
        assert label in data["table"]
    rows = list(csv.DictReader((out / "demo_curves.csv").open()))
    assert len(rows) == 4 * episodes and {r["method"] for r in rows} == set(FOUR)
    assert math.isclose(float(rows[0]["exact_error"]), results[0]["exact_error"][0], abs_tol=1e-6)
    assert (out / "demo_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ep to <50%" in (out / "demo_table.txt").read_text()


def test_compare_resumes(tmp_path):
    _require_trainers()
    from trl_isopo.scripts.compare import load_results, main

    path = tmp_path / "r.jsonl"
    common = ["--methods", "reinforce,tpo", "--episodes", "2", "--prompts", "4", "--output", str(path),
              "--no-progress", "--threads", "1"]
    argv = common + ["--seeds", "0"]
    assert main(argv) == 0
    first = load_results(str(path))
    assert [r["method"] for r in first] == ["reinforce", "tpo"] and len(first[0]["exact_error"]) == 2
    with path.open("a") as f:
        f.write('{"torn": ')  # an interrupted write must not break the resume
    assert main(argv) == 0  # nothing retrained: still two results
    assert [r["method"] for r in load_results(str(path))] == ["reinforce", "tpo"]
    assert main(common + ["--seeds", "0-1"]) == 0  # widening the sweep trains only seed 1
    assert [(r["method"], r["seed"]) for r in load_results(str(path))] == [
        ("reinforce", 0), ("tpo", 0), ("reinforce", 1), ("tpo", 1)]


def test_interaction_matching_settings():
    from trl_isopo.lab.runner import Setting
    from trl_isopo.scripts.compare import parse_method, run_setting

    base = Setting(group_size=8, prompts_per_step=100, lr=1e-3)
    assert parse_method("grpo@2") == ("grpo", 2) and parse_method("tpo") == ("tpo", None)
    assert run_setting(base, None, "interaction") is base
    p = run_setting(base, 2, "prompt")
    assert (p.group_size, p.prompts_per_step, p.lr) == (2, 100, 1e-3)
    i = run_setting(base, 2, "interaction")
    assert (i.group_size, i.prompts_per_step) == (2, 400) and math.isclose(i.lr, 2e-3)
    with pytest.raises(ValueError, match="divisible"):
        run_setting(base, 3, "interaction")


def test_unknown_method_fails_before_training(tmp_path):
    from trl_isopo.scripts.demo import main

    with pytest.raises(ValueError, match="unknown method"):
        main(["--quick", "--methods", "grpo,ppo", "--output-dir", str(tmp_path), "--no-progress"])


@pytest.mark.slow
def test_h4_benchmark_tpo_learns(tmp_path):
    """tpo-spec §7.12 on the lab (terminal H=4, B=100, K=8, AdamW): TPO < 0.2 error by episode 50, < 0.1 by 100.

    The spec's "beats GRPO" clause is not asserted: with TRL's GRPO and AdamW the ordering at H=4 depends on the seed
    (docs/reproduction.md, section 2).
    """
    _require_trainers()
    from trl_isopo.lab.runner import Setting, train_one

    tpo = train_one("tpo", 0, Setting(episodes=100, prompts_per_step=100, optimizer="adamw"))
    assert min(tpo["exact_error"][:50]) < 0.2 and min(tpo["exact_error"][:100]) < 0.1


@pytest.mark.parametrize("method", ["grpo-nokl", "tpo-no-anchor", "isopo-q", "isopo-fig6", "isopo-interacting"])
def test_every_registered_setting_trains(method):
    """The ablations and ISOPO's named settings construct valid configs and run through their trainers."""
    if not available(method):
        pytest.skip(f"{method} not importable yet")
    from trl_isopo.lab.runner import Setting, train_one

    r = train_one(method, 0, Setting(episodes=2, prompts_per_step=2, kl_prompts=4, kl_samples=2))
    assert len(r["exact_error"]) == 2 and r["final_kl"] > 0.0


def test_micro_batching():
    from trl_isopo.lab.methods import get_method
    from trl_isopo.lab.runner import micro_batching

    assert micro_batching(100, None) == (100, 1)
    assert micro_batching(100, 10) == (10, 10)
    assert micro_batching(50, 10) == (10, 5)
    assert micro_batching(16, 10) == (8, 2)
    assert micro_batching(7, 10) == (7, 1)
    assert micro_batching(7, 3) == (1, 7)
    assert get_method("isopo").micro_batch_prompts == 10 and get_method("tpo").micro_batch_prompts is None
