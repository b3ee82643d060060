"""Real-model RL on a numeric Reasoning Gym task: SmolLM2-135M-Instruct (Q4_1, dequantized), offline.

- `task`: the task (Reasoning Gym `chain_sum` by default, any task whose answer is a number), disjoint train /
  held-out splits, the last-number reward.
- `evaluate`: held-out accuracy (greedy and sampled) and the sequence KL(pi || pi_0) on fixed probe prompts.
- `schedule`: TRL's batch fields for M optimizer steps per rollout.
- `run`: one training run of GRPO / REINFORCE / ISOPO / TPO through the real trainers, with evaluations along the way.
- `protocol`, `analysis`, `figures`: the M-steps protocol, its paired bootstrap analysis and verdicts, its figures.

Behind `trl-isopo real` (the README's main job), `benchmarks/real_model_learning.py` and
`benchmarks/real_model_protocol.py`.
"""
