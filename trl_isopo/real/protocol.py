"""The M-steps protocol on the real model: every method on the same rollouts, M optimizer steps per rollout.

The papers' regime: several optimizer steps per rollout (ISOPO, arXiv 2512.23353 §4: GRPO with PPO clipping,
REINFORCE and ISOPO without a clip, in the same schedule; its reference implementation splits a rollout into two
mini-batches; TPO, arXiv 2604.06159 §2 and §4.3: q frozen per rollout, several epochs on it). A protocol run is one (method, learning rate, seed, M): `rollouts` rollouts of P prompts x K
completions, the same prompts in the same order for every method and M at a seed (the sampler is seeded and the
rollout size does not depend on M), M optimizer steps per rollout on mini-batches of P*K/M rows, micro-batches of
`micro_batch` rows (the same forward/backward work at every M), full weights unless `lora`. `epochs` > 1 passes
over each rollout that many times (TRL `num_iterations`), only for the methods with a pi_old; ISOPO and PROMA have none and keep
one pass, so that option breaks the equal-step budget on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl_isopo.methods import get_method

from .run import RealRun
from .task import ArithmeticTask

# GRPO with its clip (no KL, and beta 0.04), REINFORCE (no clip, no KL), ISOPO (ISOPOConfig's default, and the ISOPO
# paper's Fig. 6 setting p=0, q=-1, r=-2, c=0), TPO.
PROTOCOL_METHODS = ("grpo", "grpo-kl", "reinforce", "isopo", "isopo-fig6", "tpo")
REFERENCE_METHOD = "grpo"  # the analysis' differences are to GRPO with its clip


def has_pi_old(method: str) -> bool:
    """Whether the method's loss reads the rollout-time policy (GRPO's ratio, TPO's target); the advantage-free
    surrogate of ISOPO and PROMA does not."""
    from trl_isopo.layerwise.surrogate import SurrogateLossMixin

    return not issubclass(get_method(method).trainer_cls, SurrogateLossMixin)


@dataclass
class Protocol:
    """The protocol's fixed settings; `run` makes the RealRun of one (method, lr, seed, M)."""

    rollouts: int = 8
    prompts: int = 8
    generations: int = 8
    micro_batch: int = 16  # rows per forward/backward, at every M (M = 1: GA 4; M = 4: GA 1)
    epochs: int = 1  # TRL num_iterations for methods with a pi_old
    lora: bool = False
    eval_size: int = 128
    eval_every_rollouts: int = 2
    kl_prompts: int = 16
    kl_samples: int = 4
    max_completion_length: int = 24
    temperature: float = 0.7
    task: ArithmeticTask = field(default_factory=ArithmeticTask)

    def run(self, method: str, learning_rate: float, seed: int, steps_per_rollout: int) -> RealRun:
        iterations = self.epochs if has_pi_old(method) else 1
        per_rollout = steps_per_rollout * iterations
        return RealRun(
            method=method, lora=self.lora, learning_rate=learning_rate, steps=self.rollouts * per_rollout,
            prompts_per_rollout=self.prompts, num_generations=self.generations,
            max_completion_length=self.max_completion_length, temperature=self.temperature, seed=seed,
            eval_size=self.eval_size, eval_every=self.eval_every_rollouts * per_rollout, eval_sampled=True,
            kl_prompts=self.kl_prompts, kl_samples=self.kl_samples, steps_per_rollout=steps_per_rollout,
            num_iterations=iterations, micro_batch=self.micro_batch, task=self.task,
        )
