"""`trl-isopo proma` and the PROMA method entries: 2-step runs on the tiny offline model (generation included)."""

import json

import cli_support
import pytest
import torch
from cli_support import CPU, fresh_accelerate_state, jsonl  # noqa: F401  (fixtures)

from trl_isopo import cli
from trl_isopo.methods import get_method
from trl_isopo.proma import PROMAConfig, PROMATrainer
from trl_isopo.scripts import train as train_script



def small_run(model_dir, data, out, steps=2):
    """The CLI tests' 2-step run with 2 accumulated micro-batches (accumulation PROMA needs GA >= 2)."""
    return [*cli_support.small_run(model_dir, data, out, steps), "--gradient_accumulation_steps", "2",
            "--reward_funcs", "trl_isopo.gym.format_reward", *CPU]


def test_method_entries():
    for name, mode in (("proma", "accumulation"), ("proma-intra", "intra"), ("proma-both", "both")):
        m = get_method(name)
        assert (m.trainer_cls, m.config_cls, m.fields["proma_mode"], m.epochs) == (PROMATrainer, PROMAConfig, mode, 1)
    assert PROMATrainer._tag_names == ["trl", "trl-isopo", "proma"] and PROMATrainer._paper["id"] == "2601.10498"


def test_proma_command_trains_two_steps_and_logs_its_metrics(tiny_model_dir, jsonl, tmp_path):
    out = tmp_path / "proma"
    trainer = train_script.run(small_run(tiny_model_dir, jsonl, out, steps=2), method="proma")
    assert type(trainer) is PROMATrainer and trainer.args.proma_mode == "accumulation"
    assert trainer.state.global_step == 2
    logged = [h for h in trainer.state.log_history if "proma/projected_fraction" in h]
    assert len(logged) == 2
    assert all(0 <= h["proma/projected_fraction"] <= 1 and 0 <= h["proma/reduction_pct"] <= 100 for h in logged)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    card = (out / "README.md").read_text()
    assert "trl-isopo proma --model_name_or_path" in card and "2601.10498" in card


def test_cli_entry_point_with_the_intra_variant(tiny_model_dir, jsonl, tmp_path, capsys):
    out = tmp_path / "intra"
    argv = ["proma", *small_run(tiny_model_dir, jsonl, out, steps=1), "--proma_mode", "intra", "--proma_intra_dim", "4"]
    assert cli.main(argv) == 0
    assert "Training completed (1 process(es), 1 steps)." in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"


def test_knobs_of_another_method_are_refused(tiny_model_dir, jsonl, tmp_path):
    with pytest.raises(ValueError, match=r"Unknown argument\(s\) for `trl-isopo proma`: \['--isopo_p'"):
        train_script.run([*small_run(tiny_model_dir, jsonl, tmp_path), "--isopo_p", "-1"], method="proma")


def test_quickstart_example_runs():
    """examples/proma_quickstart.py (the README's offline PROMA example) trains and logs PROMA's metrics."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "proma_quickstart.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "'proma/projected_fraction'" in out.stdout.splitlines()[-1]
