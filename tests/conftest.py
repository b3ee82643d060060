import os

# Offline everywhere: no Hub, no telemetry.
for _k, _v in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRL_EXPERIMENTAL_SILENCE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_DISABLED": "true",
}.items():
    os.environ.setdefault(_k, _v)

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
