"""The tiny ISOPOTrainer runs of the trainer tests (tests/test_isopo_trainer.py, tests/test_isopo_head.py): a config,
a training run with the parameters it changed, and a resume that must match a straight run bit for bit."""

import torch

from trl_isopo import ISOPOConfig, ISOPOTrainer
from trl_isopo.tiny import tiny_prompt_dataset, tiny_reward, tiny_training_args


def config(tmp_path, **kw):
    base = tiny_training_args(
        tmp_path / "out",
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=6,
        max_steps=3,
        logging_steps=1,
        learning_rate=1e-2,
        isopo_fisher_tokens=16,
        isopo_reg=1.0,  # c > 0 exercises the EMA statistics (the default c = 0 keeps none)
        seed=0,
    )
    base.update(kw)
    return ISOPOConfig(**base)


def run(tiny_model_dir, tiny_tokenizer, args, **kw):
    trainer = ISOPOTrainer(
        tiny_model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(32), processing_class=tiny_tokenizer, **kw
    )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if n in before and not torch.equal(before[n], p)}
    return trainer, before, changed


def resume_and_compare(model_dir, tokenizer, args, checkpoint, straight):
    """Resume a fresh trainer from `checkpoint`, train to the end; its parameters must equal `straight`'s bit for bit."""
    resumed = ISOPOTrainer(model_dir, tiny_reward, args=args, train_dataset=tiny_prompt_dataset(32),
                           processing_class=tokenizer)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for (n, p), (_, q) in zip(straight.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), n
    return resumed
