"""`trl-isopo demo --quick` and `trl-isopo compare`: real (tiny) training through the four trainers, offline."""

import csv
import json
import math

import pytest

from trl_isopo.methods import METHODS
from trl_isopo.scripts.demo import DEMO_METHODS

FOUR = ["grpo-kl", "reinforce", "isopo-kl", "tpo"]


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
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
    # Each method in its own regime (ISOPO and REINFORCE 1 step per rollout batch, GRPO and TPO 4 epochs), all with
    # the same rollouts per episode and episodes, i.e. the same number of generated completions.
    epochs = {r["method"]: r["setting"]["epochs"] for r in results}
    assert epochs == {"grpo-kl": 4, "reinforce": 1, "isopo-kl": 1, "tpo": 4}
    assert len({(r["setting"]["episodes"], r["setting"]["prompts_per_step"], r["setting"]["group_size"])
                for r in results}) == 1
    # Same seed -> same initial model, prompts and sampling RNG: the first rollouts are identical for every method.
    assert len({r["exact_error"][0] for r in results}) == 1
    # (1/2)^4 success at init, measured on 16 x 8 rollouts; far from 0 and 1.
    assert 0.8 < results[0]["exact_error"][0] < 1.0
    for label in ("GRPO", "REINFORCE", "ISOPO (p=-1, c=0, beta 0.04)", "TPO"):
        assert label in data["table"]
    rows = list(csv.DictReader((out / "demo_curves.csv").open()))
    assert len(rows) == 4 * episodes and {r["method"] for r in rows} == set(FOUR)
    assert math.isclose(float(rows[0]["exact_error"]), results[0]["exact_error"][0], abs_tol=1e-6)
    assert (out / "demo_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = (out / "demo_table.txt").read_text()
    assert "ep to <50%" in table and "final per seed" in table and "<=25%" in table
    assert len(data["findings"]) == 4 and all("per seed" in line for line in data["findings"])


def test_compare_resumes(tmp_path):
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


def test_regimes_and_overrides():
    from trl_isopo.lab.regime import parse_method_values, regime
    from trl_isopo.methods import get_method

    assert [get_method(m).epochs for m in FOUR] == [4, 1, 1, 4]
    assert get_method("isopo-c1").epochs == 1 and get_method("grpo").epochs == 4
    assert all(get_method(m).epochs == 1 for m in ("isopo", "isopo-q", "isopo-c0.1", "isopo-ema-median"))
    assert regime("isopo", 4, 1e-3) == (1, 1e-3)  # the method's own
    assert regime("isopo", 4, 1e-3, epochs=4) == (4, 1e-3)  # --epochs for every method
    assert regime("isopo", 4, 1e-3, epochs=4, method_epochs={"isopo": 2}, method_lr={"isopo": 3e-3}) == (2, 3e-3)
    assert regime("grpo", 4, 1e-3, method_epochs={"isopo": 2}) == (4, 1e-3)
    assert parse_method_values("isopo=1, grpo=4", int) == {"isopo": 1, "grpo": 4} and parse_method_values("") == {}
    with pytest.raises(ValueError, match="unknown method"):
        parse_method_values("ppo=1", int)
    with pytest.raises(ValueError, match="name=value"):
        parse_method_values("isopo", int)


def test_compare_plans_each_method_in_its_regime():
    from trl_isopo.scripts.compare import build_parser, planned_runs

    base = ["--methods", "grpo,isopo,reinforce", "--episodes", "3", "--seeds", "0-1"]
    runs = planned_runs(build_parser().parse_args(base))
    assert [(m, seed, s.epochs, s.lr) for m, seed, s in runs] == [
        ("grpo", 0, 4, 1e-3), ("grpo", 1, 4, 1e-3), ("isopo", 0, 1, 1e-3), ("isopo", 1, 1, 1e-3),
        ("reinforce", 0, 1, 1e-3), ("reinforce", 1, 1, 1e-3)]
    runs = planned_runs(build_parser().parse_args(base + ["--epochs", "2", "--method-lr", "isopo=3e-3"]))
    assert {(m, s.epochs, s.lr) for m, _, s in runs} == {("grpo", 2, 1e-3), ("isopo", 2, 3e-3),
                                                          ("reinforce", 2, 1e-3)}
    assert len({(s.episodes, s.prompts_per_step, s.group_size) for _, _, s in runs}) == 1


def test_results_table_shows_every_seed():
    from trl_isopo.lab.report import per_seed_table, results_table

    def fake(method, seed, errors, kl):
        return {"method": method, "label": method.upper(), "seed": seed, "exact_error": errors, "final_kl": kl,
                "kl": [0.0, kl], "kl_episodes": [0, len(errors)], "wall_s": 1.0, "s_per_episode": 0.5,
                "setting": {"epochs": 1, "lr": 1e-3}}

    results = [fake("a", 0, [0.9, 0.2], 2.0), fake("a", 1, [0.9, 0.8], 2.5), fake("b", 0, [0.9, 0.0], 1.0)]
    table = results_table(results, [1, 2], [0.5])
    row_a = next(line for line in table.splitlines() if line.startswith("A "))
    assert "50.0" in row_a and "20 80" in row_a and "1/2" in row_a and "2.25" in row_a
    row_b = next(line for line in table.splitlines() if line.startswith("B "))
    assert "1/1" in row_b
    assert len(per_seed_table(results).splitlines()) == 2 + 3


def test_fresh_process_runs_match_in_process(tmp_path):
    """--workers >= 1 trains each run in a fresh process; a first run there equals the same run in this process."""
    from trl_isopo.lab.cli_common import make_progress, run_jobs
    from trl_isopo.lab.runner import Setting, train_one

    s = Setting(episodes=2, prompts_per_step=2, epochs=1, optimizer="adamw", kl_prompts=4, kl_samples=2)
    here = train_one("reinforce", 0, s)
    bar = make_progress(4, False, "")
    out = dict(((m, seed), r) for (m, seed, _), r in run_jobs([("reinforce", 0, s), ("reinforce", 1, s)], 1, 2, bar))
    assert out[("reinforce", 0)]["exact_error"] == here["exact_error"] and out[("reinforce", 0)]["kl"] == here["kl"]
    assert set(out) == {("reinforce", 0), ("reinforce", 1)}


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
    """The TPO paper's cheap benchmark on the lab (terminal H=4, B=100, K=8, AdamW; docs/reproduction.md, section 1):
    TPO < 0.2 error by episode 50, < 0.1 by 100.

    "Beats GRPO" is not asserted: with TRL's GRPO and AdamW the ordering at H=4 depends on the seed
    (docs/reproduction.md, section 2).
    """
    from trl_isopo.lab.runner import Setting, train_one

    tpo = train_one("tpo", 0, Setting(episodes=100, prompts_per_step=100, optimizer="adamw"))
    assert min(tpo["exact_error"][:50]) < 0.2 and min(tpo["exact_error"][:100]) < 0.1


@pytest.mark.parametrize("method", sorted(set(METHODS) - set(FOUR)))
def test_every_registered_setting_trains(method):
    """Every other method of the table (ablations, ISOPO's named settings) constructs a valid config and runs through
    its trainer (the demo's four run in `quick_demo`)."""
    from trl_isopo.lab.runner import Setting, train_one

    r = train_one(method, 0, Setting(episodes=2, prompts_per_step=2, kl_prompts=4, kl_samples=2))
    assert len(r["exact_error"]) == 2 and r["final_kl"] > 0.0


def test_micro_batching():
    from trl_isopo.lab.regime import micro_batch_prompts
    from trl_isopo.lab.runner import micro_batching
    from trl_isopo.methods import get_method

    assert micro_batching(100, None) == (100, 1)
    assert micro_batching(100, 10) == (10, 10)
    assert micro_batching(50, 10) == (10, 5)
    assert micro_batching(16, 10) == (8, 2)
    assert micro_batching(7, 10) == (7, 1)
    assert micro_batching(7, 3) == (1, 7)
    assert micro_batch_prompts(get_method("isopo")) == 10 and micro_batch_prompts(get_method("tpo")) is None
    # PROMA: ISOPO-sized micro-batches, and at least two per step (accumulation projects against earlier ones)
    assert micro_batch_prompts(get_method("proma"), 50) == 10 and micro_batch_prompts(get_method("proma"), 2) == 1
