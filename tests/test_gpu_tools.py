"""The GPU run's tools, offline: the wheelhouse's requirement walk (`gpu/wheelhouse.py`) on made-up wheels, the
runner's environment check (`gpu/run.py`) on made-up installed distributions, and the GPU check's time limit and
JUnit reading (`benchmarks/gpu_check.py`). The whole chain ran on CPU with `bash gpu/rehearse_cpu.sh` (docs/gpu.md)."""

import importlib.util
import os
import sys
import time
import zipfile

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(relpath, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relpath))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


wheelhouse = load("gpu/wheelhouse.py", "gpu_wheelhouse")
runner = load("gpu/run.py", "gpu_run")
gpu_check = load("benchmarks/gpu_check.py", "gpu_check")


def fake_wheel(folder, name, version, requires=()):
    path = os.path.join(folder, f"{name}-{version}-py3-none-any.whl")
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


INDEX = {  # name: [(version, requires)], newest last
    "alpha": [("1.0", ["beta<2", "gamma", "delta>=2; python_version < '3.11'", "eps[fast]"])],
    "beta": [("1.5", ["gamma>=3"]), ("2.5", [])],
    "eps": [("1.0", ["zeta; extra == 'fast'", "eta; extra == 'slow'"])],
    "zeta": [("0.3", [])],
}


def fake_fetch(folder, log):
    def fetch(spec):
        req = Requirement(spec)
        version, requires = [v for v in INDEX[req.name] if req.specifier.contains(v[0])][-1]
        log.append(spec)
        return fake_wheel(folder, req.name, version, requires)

    return fetch


def test_walk_carries_what_the_device_lacks(tmp_path):
    device = {"beta": Version("2.5"), "gamma": None, "torch": Version("2.11.0")}
    log = []
    carried, met = wheelhouse.resolve([Requirement("alpha>=1"), Requirement("torch>=2.6")], device, set(), "3.12",
                                      fake_fetch(str(tmp_path), log), prefer=lambda name: None)
    # beta 2.5 on the device misses alpha's beta<2: carried (1.5), and its gamma>=3 is trusted (gamma: no version)
    assert {n: str(c["version"]) for n, c in carried.items()} == {"alpha": "1.0", "beta": "1.5", "eps": "1.0",
                                                                  "zeta": "0.3"}
    assert carried["beta"]["why"] == "device has 2.5"
    assert set(met) == {"gamma", "torch"} and met["gamma"]["device_version"] is None
    assert met["gamma"]["required"] == ["alpha: gamma", "beta: gamma>=3"]
    assert "delta" not in carried and "eta" not in carried  # marker false on 3.12; extra not requested
    assert log == ["alpha>=1", "beta<2", "eps", "zeta"]


def test_walk_prefers_local_versions_carries_by_choice_and_finds_conflicts(tmp_path):
    device = {"beta": Version("2.5"), "gamma": Version("9")}
    carried, met = wheelhouse.resolve([Requirement("beta")], device, {"beta"}, "3.12", fake_fetch(str(tmp_path), []),
                                      prefer=lambda name: Version("1.5") if name == "beta" else None)
    assert str(carried["beta"]["version"]) == "1.5" and carried["beta"]["why"] == "carried by choice"
    assert met["gamma"]["required"] == ["beta: gamma>=3"]
    with pytest.raises(ValueError, match="beta 2.5 is carried"):  # a later requirement the carried version misses
        wheelhouse.resolve([Requirement("beta>=2"), Requirement("alpha")], {}, set(), "3.12",
                           fake_fetch(str(tmp_path), []), prefer=lambda name: None)


def test_runner_environment_check_reports_unmet(tmp_path, monkeypatch):
    """Made-up installed distributions on sys.path: a requirement missing, one at the wrong version, one met."""
    for name, version, requires in (("rootpkg", "1.0", ["midpkg>=2", "absentpkg", "pytest>=1"]), ("midpkg", "1.0", [])):
        info = tmp_path / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                       + "".join(f"Requires-Dist: {r}\n" for r in requires))
    monkeypatch.syspath_prepend(str(tmp_path))
    unmet, shown = runner.unmet_requirements("rootpkg")
    mine = [(u["requirement"], u["found"]) for u in unmet if u["by"] == "rootpkg 1.0"]  # pytest's own: not ours
    assert sorted(mine) == [("absentpkg", None), ("midpkg>=2", "1.0")]
    assert shown["torch"] is not None and os.path.isdir(shown["torch"][1])


def test_gpu_check_kills_a_part_at_its_limit():
    t0 = time.monotonic()
    rec, out, _ = gpu_check.run_limited([sys.executable, "-c", "print('started', flush=True); import time; "
                                         "time.sleep(60)"], dict(os.environ), 2.0)
    assert rec["status"] == "timeout" and rec["returncode"] == -9 and "started" in out
    assert time.monotonic() - t0 < 20
    rec, out, _ = gpu_check.run_limited([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), 30.0)
    assert rec["status"] == "failed" and rec["returncode"] == 3


def test_gpu_check_reads_junit(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="t" name="a" time="0.5"/>'
                   '<testcase classname="t" name="b" time="2"><failure message="assert 1 == 2">x</failure></testcase>'
                   '<testcase classname="t" name="c" time="0"><skipped/></testcase></testsuite></testsuites>')
    s = gpu_check.junit_summary(str(xml))
    assert (s["passed"], s["failed"], s["skipped"]) == (1, 1, 1)
    assert s["failures"] == [{"test": "t::b", "message": "assert 1 == 2"}] and s["slowest"][0] == {"test": "t::b",
                                                                                                  "s": 2.0}
    assert gpu_check.junit_summary(str(tmp_path / "missing.xml")) == {}


def test_gpu_check_plan_fits_the_device_budget():
    """The full plan's parts are those the docs list; the smoke plan keeps the keys its smoke test reads."""
    full = gpu_check.plan(False)
    assert [p[0] for p in full] == ["oracle", "bf16", "lm_head", "fused_head", "syncs", "head", "overhead"]
    assert all(os.path.exists(os.path.join(ROOT, p[2][0])) for p in full if p[1] == "pytest")
    assert [p[0] for p in gpu_check.plan(True)] == ["oracle", "head", "overhead"]
