"""The method table (`trl_isopo.methods`): one meaning per name in every entry point, and stored results read under
today's names."""

import importlib.util
import json
import os

import pytest
from trl import GRPOTrainer

from trl_isopo.methods import METHODS, RENAMED, current_name, get_method
from trl_isopo.tiny import tiny_training_args

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = {"use_cpu": True}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_builds_its_config_with_its_fields(name, tmp_path):
    method = get_method(name)
    config = method.config(**tiny_training_args(tmp_path, per_device_train_batch_size=4, num_generations=4, **CPU))
    assert type(config) is method.config_cls and issubclass(method.trainer_cls, GRPOTrainer)
    for field_name, value in method.fields.items():
        assert getattr(config, field_name) == value, field_name
    with pytest.raises(TypeError):
        method.fields["beta"] = 1.0  # a table entry cannot be changed by a caller


def test_plain_trainer_names_are_the_config_defaults():
    """`grpo`, `isopo`, `tpo` set nothing a default config does not have, so the CLI commands of those names and the
    table agree."""
    for name in ("grpo", "isopo", "tpo"):
        m = get_method(name)
        defaults = m.config_cls.__dataclass_fields__
        assert all(defaults[k].default == v for k, v in m.fields.items()), name


def test_one_meaning_in_every_entry_point(tmp_path):
    """The CLI parser, the lab, the real-model job and the model card take a name's settings from the table."""
    from trl_isopo.lab.regime import micro_batch_prompts, regime
    from trl_isopo.model_card import method_tags
    from trl_isopo.real.run import RealRun, _config
    from trl_isopo.scripts import train_args

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1", "answer": "2"}\n')
    argv = ["--dataset_name", str(data), "--reward_funcs", "answer", "--output_dir", str(tmp_path / "o"),
            "--bf16", "false", "--use_cpu", "true"]  # fmt: skip
    _, args, *_ = train_args.parse_args(["--method", "isopo-c1", *argv])
    assert (type(args), args.isopo_p, args.isopo_reg) == (get_method("isopo-c1").config_cls, -1.0, 1.0)
    _, args, *_ = train_args.parse_args(["--method", "isopo-c1", "--isopo_reg", "0.5", *argv])
    assert args.isopo_reg == 0.5  # a flag overrides the named setting
    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: grpo-kl\nbeta: 0.01\n")
    _, args, *_ = train_args.parse_args(["--config", str(recipe), *argv])
    assert (args.beta, args.epsilon) == (0.01, 0.2)  # the YAML overrides it too; what it leaves is the setting's
    real = _config(RealRun(method="isopo-c1"), str(tmp_path / "real"), progress=False)
    assert (real.isopo_p, real.isopo_reg, real.num_iterations) == (-1.0, 1.0, 1)
    assert RealRun(method="grpo-kl").label() == get_method("grpo-kl").label
    assert regime("isopo-c1", 4, 1e-3) == (1, 1e-3) and micro_batch_prompts(get_method("isopo-c1")) == 10
    assert "isopo" in method_tags("isopo-c1") and "grpo" in method_tags("reinforce")


def test_renamed_results_map_to_todays_settings():
    for (old, label), new in RENAMED.items():
        assert new in METHODS
        # an old record must never look like today's setting of its old name
        assert old not in METHODS or METHODS[old].label != label, (old, label)
    assert current_name("isopo", "ISOPO (p=-1, c=1)") == "isopo-c1"  # the lab's former `isopo`
    assert current_name("isopo", "ISOPO (p=-1, c=0)") == "isopo"  # the real-model job's `isopo`, unchanged
    assert current_name("isopo-c1", "ISOPO (p=-1, c=1)") == "isopo-c1"


def test_stored_real_model_runs_are_read_under_todays_names():
    spec = importlib.util.spec_from_file_location("rml", os.path.join(ROOT, "benchmarks", "real_model_learning.py"))
    rml = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rml)
    runs = rml.load_results(os.path.join(ROOT, rml.DEFAULT_RESULTS))
    assert {r["settings"]["method"] for r in runs} == {"grpo-kl", "reinforce", "isopo", "isopo-q", "isopo-c1", "tpo"}
    for r in runs:
        method = get_method(r["settings"]["method"])
        assert r["key"].startswith(method.name + "|")
        if "stored_method" in r:
            assert current_name(r["stored_method"], r["label"]) == method.name
    assert sum(r.get("stored_method") == "grpo" for r in runs) == 6  # the beta 0.04 runs, stored as `grpo`


def test_compare_reads_old_lab_records_under_todays_names(tmp_path):
    from trl_isopo.scripts.compare import load_results

    path = tmp_path / "old.jsonl"
    old = [{"method": "isopo", "label": "ISOPO (p=-1, c=1)"}, {"method": "isopo-reg0", "label": "ISOPO (p=-1, c=0)"},
           {"method": "grpo", "label": "GRPO (clip 0.2, beta 0.04)"}, {"method": "tpo", "label": "TPO (eta 1)"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    got = load_results(str(path))
    assert [r["method"] for r in got] == ["isopo-c1", "isopo", "grpo-kl", "tpo"]
    assert [r.get("stored_method") for r in got] == ["isopo", "isopo-reg0", "grpo", None]
