"""ISOPO on a tiny offline model (CPU, ~10 s): `python examples/isopo_quickstart.py`."""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from trl_isopo import ISOPOConfig, ISOPOTrainer
from trl_isopo.tiny import load_tiny_tokenizer, make_tiny_model_dir, tiny_prompt_dataset, tiny_reward

model_dir = make_tiny_model_dir(os.path.join(tempfile.gettempdir(), "trl-isopo-tiny"))
args = ISOPOConfig(
    output_dir=os.path.join(tempfile.gettempdir(), "isopo-quickstart"),
    isopo_p=-1.0,  # Fisher normalization; isopo_q=-1.0 Euclidean; isopo_interacting=True for the MinSR variant
    num_generations=4, per_device_train_batch_size=8, max_completion_length=6, max_steps=20, learning_rate=1e-2,
    logging_steps=5, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
)
trainer = ISOPOTrainer(model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(64),
                       processing_class=load_tiny_tokenizer(model_dir))
trainer.train()
print({k: v for k, v in trainer.state.log_history[-2].items() if k.startswith(("reward", "isopo/", "loss"))})
