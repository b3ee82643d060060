"""`trl_isopo.vllm_cpu` without vLLM: when the CPU weight sync is installed, what it calls in which order, and the
refusal of a vLLM without the reload path. The sync itself against a real vLLM: tests/test_vllm_colocate.py."""

import sys
import types

import pytest

from trl_isopo import vllm_cpu


class FakeRunner:
    def __init__(self, calls):
        self.calls, self.model = calls, object()

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        self.calls.append(("reload", list(weights_iterator), is_checkpoint_format))

    def get_model(self):
        return self.model


class FakeGeneration:
    """The parts of TRL's VLLMGeneration the sync touches."""

    def __init__(self, calls, mode="colocate", sleep=False, runner=None):
        self.mode, self.enable_sleep_mode, self.calls = mode, sleep, calls
        self._llm_weights_sleeping = sleep
        runner = runner or FakeRunner(calls)
        worker = types.SimpleNamespace(model_runner=runner)
        self.llm = types.SimpleNamespace(
            llm_engine=types.SimpleNamespace(model_executor=types.SimpleNamespace(driver_worker=worker)),
            wake_up=lambda tags: calls.append(("wake_up", tags)),
            reset_prefix_cache=lambda: calls.append(("reset_prefix_cache",)),
        )

    def _iter_named_params(self):
        self.calls.append(("iterate",))
        yield from [("model.embed_tokens.weight", 1), ("model.layers.0.mlp.up_proj.weight", 2)]

    def sync_weights(self):
        self.calls.append(("trl_sync",))


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(vllm_cpu, "vllm_runs_on_cpu", lambda: True)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.31.0"))


def trainer_with(generation, use_vllm=True):
    return types.SimpleNamespace(use_vllm=use_vllm, vllm_generation=generation)


@pytest.mark.parametrize("sleep", [False, True])
def test_sync_reloads_repacks_then_resets_the_cache(on_cpu, monkeypatch, sleep):
    calls = []
    monkeypatch.setattr(vllm_cpu, "_repack_tied_heads", lambda model: calls.append(("repack", model)) or 1)
    generation = FakeGeneration(calls, sleep=sleep)
    assert vllm_cpu.apply_cpu_weight_sync(trainer_with(generation)) is True
    generation.sync_weights()
    model = generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    expected = [("iterate",), ("reload", [("model.embed_tokens.weight", 1), ("model.layers.0.mlp.up_proj.weight", 2)],
                                True), ("repack", model), ("reset_prefix_cache",)]
    assert calls == ([("wake_up", ["weights"])] if sleep else []) + expected
    assert generation._llm_weights_sleeping is False
    # idempotent: applying twice still syncs once per call
    calls.clear()
    vllm_cpu.apply_cpu_weight_sync(trainer_with(generation))
    generation.sync_weights()
    assert [c[0] for c in calls].count("reload") == 1


@pytest.mark.parametrize("case", ["no vLLM", "server mode", "vLLM on a GPU"])
def test_left_alone_where_trl_sync_works(case, monkeypatch):
    calls = []
    monkeypatch.setattr(vllm_cpu, "vllm_runs_on_cpu", lambda: case != "vLLM on a GPU")
    generation = FakeGeneration(calls, mode="server" if case == "server mode" else "colocate")
    trainer = trainer_with(generation, use_vllm=case != "no vLLM")
    assert vllm_cpu.apply_cpu_weight_sync(trainer) is False
    generation.sync_weights()
    assert calls == [("trl_sync",)]
    assert vllm_cpu.apply_cpu_weight_sync(types.SimpleNamespace()) is False  # a trainer without vLLM attributes


def test_vllm_without_the_reload_path_is_refused(on_cpu, monkeypatch):
    class OldRunner:
        def reload_weights(self, weights_path=None):  # no iterator: cannot take the trainer's tensors
            pass

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.20.0"))
    for runner in (OldRunner(), object()):
        generation = FakeGeneration([], runner=runner)
        with pytest.raises(RuntimeError, match=r"vLLM 0\.20\.0 on the CPU.*reload_weights.*0\.31\.0"):
            vllm_cpu.apply_cpu_weight_sync(trainer_with(generation))


def test_no_vllm_means_not_on_cpu():
    if "vllm" in sys.modules or __import__("importlib.util").util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    assert vllm_cpu.vllm_runs_on_cpu() is False


def test_public_export():
    import trl_isopo

    assert trl_isopo.apply_cpu_weight_sync is vllm_cpu.apply_cpu_weight_sync
    assert "apply_cpu_weight_sync" in trl_isopo.__all__
