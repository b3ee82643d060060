"""The TPO paper's toy sequence tasks (arXiv 2604.06159 §3.4-3.7) run through the real TRL trainers.

- `tasks`: targets (copy / flip / reverse_copy / reverse_flip) and TRL-ready prompt datasets.
- `rewards`: bag-of-tokens, sequential and terminal exact-match rewards as TRL reward functions.
- `model`: the paper's tiny pre-norm transformer as a transformers model whose action space is the V task symbols.
- `optim`: the paper's optimizer routing (Muon on matrices, AdamW elsewhere) next to plain AdamW.
- `regime`: how each method of `trl_isopo.methods` trains here (optimizer steps per rollout batch, lr, micro-batches).
- `runner`: train one (method, seed, setting) and collect per-episode training error, KL drift and wall time.
"""
