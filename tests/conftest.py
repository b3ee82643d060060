
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
