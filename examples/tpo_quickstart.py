"""TPO (Target Policy Optimization, arXiv 2604.06159) quickstart: offline, CPU, tiny model, seconds.

    python examples/tpo_quickstart.py                     # tiny offline Qwen2 + word-level tokenizer
    python examples/tpo_quickstart.py --max_steps 40      # watch `reward` go up

Swap in a real model and reward function (and `use_cpu=False`, bf16, vLLM, ...) for actual training; every
`trl.GRPOConfig` option is available on `TPOConfig` except the GRPO loss knobs TPO rejects (see docs/tpo.md).
"""

import argparse
import os
import tempfile

for _k, _v in {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_k, _v)

from trl_isopo import TPOConfig, TPOTrainer  # noqa: E402
from trl_isopo.tiny import load_tiny_tokenizer, make_tiny_model_dir, tiny_prompt_dataset, tiny_reward  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default=os.path.join(tempfile.gettempdir(), "tpo-quickstart"))
    parser.add_argument("--max_steps", type=int, default=10)
    parser.add_argument("--tpo_eta", type=float, default=1.0)
    parser.add_argument("--tpo_length_normalize", action="store_true")
    args = parser.parse_args(argv)

    model_dir = make_tiny_model_dir(os.path.join(args.output_dir, "tiny-model"))
    tokenizer = load_tiny_tokenizer(model_dir)  # always pass the tokenizer explicitly (see trl_isopo.tiny)

    config = TPOConfig(
        output_dir=os.path.join(args.output_dir, "run"),
        tpo_eta=args.tpo_eta,                          # target temperature: q ~ p_old * exp(u / eta)
        tpo_length_normalize=args.tpo_length_normalize,  # False = paper (summed log-probs)
        num_generations=4,                             # K completions per prompt = one TPO group
        per_device_train_batch_size=8,                 # must be a multiple of num_generations (whole groups)
        gradient_accumulation_steps=2,
        num_iterations=2,                              # q frozen, log p recomputed for each reuse
        max_completion_length=8,
        learning_rate=3e-3,
        max_steps=args.max_steps,
        logging_steps=1,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = TPOTrainer(
        model_dir, tiny_reward, args=config, train_dataset=tiny_prompt_dataset(64), processing_class=tokenizer
    )
    trainer.train()
    for log in trainer.state.log_history:
        if "reward" in log:
            print(
                f"step {log['step']:3d}  reward {log['reward']:.3f}  loss {log['loss']:.4f}  "
                f"KL(q||p) {log['tpo/kl_q_p']:.4f}  max|p-q| {log['tpo/max_abs_p_minus_q']:.3f}"
            )
    return trainer


if __name__ == "__main__":
    main()
