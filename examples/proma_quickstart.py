"""PROMA on a tiny offline model (CPU, ~10 s): `python examples/proma_quickstart.py`."""

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from trl_isopo import PROMAConfig, PROMATrainer
from trl_isopo.tiny import load_tiny_tokenizer, make_tiny_model_dir, tiny_prompt_dataset, tiny_reward

model_dir = make_tiny_model_dir(os.path.join(tempfile.gettempdir(), "trl-isopo-tiny"))
args = PROMAConfig(
    output_dir=os.path.join(tempfile.gettempdir(), "proma-quickstart"),
    proma_mode="accumulation",  # "intra": factored projection within each micro-batch; "both"
    gradient_accumulation_steps=2,  # accumulation projects each micro-batch against the earlier ones: GA >= 2
    num_generations=4, per_device_train_batch_size=4, max_completion_length=6, max_steps=20, learning_rate=1e-2,
    logging_steps=5, report_to="none", use_cpu=True, bf16=False, save_strategy="no",
)
trainer = PROMATrainer(model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(64),
                       processing_class=load_tiny_tokenizer(model_dir))
trainer.train()
print({k: v for k, v in trainer.state.log_history[-2].items() if k.startswith(("reward", "proma/", "loss"))})
