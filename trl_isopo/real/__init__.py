"""Real-model RL on a Reasoning Gym arithmetic task: SmolLM2-135M-Instruct (Q4_1, dequantized), offline.

- `task`: the task (Reasoning Gym `chain_sum`), disjoint train / held-out splits, the last-number reward.
- `evaluate`: held-out accuracy (greedy and sampled) and the sequence KL(pi || pi_0) on fixed probe prompts.
- `run`: one training run of GRPO / REINFORCE / ISOPO / TPO through the real trainers, with evaluations along the way.

Behind `trl-isopo real` (the README's main job) and `benchmarks/real_model_learning.py`.
"""
