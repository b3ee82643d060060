"""Which files of the package one optimizer step runs code in, per trainer (docs/design.md).

A tiny model trains 2 optimizer steps (gradient accumulation 2); from the start of the second step to its end every
Python frame is seen through `sys.setprofile`, and the `trl_isopo/` files those frames belong to are listed. Run it
against another checkout to compare (`PYTHONPATH=<checkout> python benchmarks/step_files.py`).

    python benchmarks/step_files.py [--method isopo|proma|tpo]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile


def step_files(method: str) -> list[str]:
    from transformers import TrainerCallback

    import trl_isopo
    from trl_isopo.tiny import (build_tiny_causal_lm, build_word_tokenizer, set_offline_env, tiny_prompt_dataset,
                                tiny_reward, tiny_training_args)

    set_offline_env()
    root = os.path.dirname(os.path.abspath(trl_isopo.__file__))
    config_cls = getattr(trl_isopo, f"{method.upper()}Config")
    trainer_cls = getattr(trl_isopo, f"{method.upper()}Trainer")
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen.add(os.path.relpath(frame.f_code.co_filename, os.path.dirname(root)))

    class Trace(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1:
                sys.setprofile(profile)

        def on_step_end(self, args, state, control, **kw):
            sys.setprofile(None)

    tokenizer = build_word_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        args = config_cls(**tiny_training_args(tmp, per_device_train_batch_size=4, num_generations=4,
                                               gradient_accumulation_steps=2, max_completion_length=4, max_steps=2,
                                               seed=0))
        trainer = trainer_cls(build_tiny_causal_lm(tokenizer, seed=0), tiny_reward, args=args,
                              train_dataset=tiny_prompt_dataset(16), processing_class=tokenizer, callbacks=[Trace()])
        trainer.train()
    return sorted(seen)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="isopo", choices=["isopo", "proma", "tpo"])
    files = step_files(ap.parse_args(argv).method)
    print(f"{len(files)} package files:")
    print("\n".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
