"""Registry of the methods the lab compares, each a real trainer class plus the config fields that define it.

Every method trains through `trl.GRPOTrainer` or one of our subclasses; nothing here re-implements a loss.
- grpo: TRL's clipped surrogate (eps 0.2) with beta = 0.04. TRL's k3 KL is to the *initial* (reference) model, the
  paper's to the rollout snapshot (tpo-spec §2): documented in docs/reproduction.md.
- grpo-nokl: the same with beta = 0 (the paper's "GRPO (no KL)" ablation).
- reinforce: GRPOTrainer with epsilon = epsilon_high = 1e9 (no clipping) and beta = 0 (the ISOPO paper's "pure"
  REINFORCE baseline: group-standardized advantages, importance ratio kept, never clipped).
- isopo, isopo-q, isopo-fig6, isopo-interacting: ISOPO's named settings (isopo-spec §2.4-2.5), beta = 0, unclipped.
- tpo, tpo-no-anchor: Target Policy Optimization with eta = 1, with / without the p_old anchor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module

_GRPO = ("trl", "GRPOTrainer", "GRPOConfig")
_ISOPO = ("trl_isopo", "ISOPOTrainer", "ISOPOConfig")
_TPO = ("trl_isopo", "TPOTrainer", "TPOConfig")
_NO_CLIP = {"epsilon": 1e9, "epsilon_high": 1e9}
ISOPO_MICRO_BATCH_PROMPTS = 10  # 10 prompts x K = 80 sequences per micro-batch at K = 8


@dataclass(frozen=True)
class Method:
    """A named trainer setting: `module.trainer_name` trained with `module.config_name(**config_kwargs)`."""

    name: str
    label: str
    module: str
    trainer_name: str
    config_name: str
    config_kwargs: dict = field(default_factory=dict)
    # Prompts per micro-batch (None: the whole episode in one). ISOPO's per-sequence statistics are per micro-batch
    # and cost ~ (sequences per micro-batch) x (tokens); the reference used micro-batches of 8 sequences.
    micro_batch_prompts: int | None = None

    def classes(self):
        """(trainer class, config class); raises ImportError while the trainer has not landed."""
        mod = import_module(self.module)
        return getattr(mod, self.trainer_name), getattr(mod, self.config_name)


def _method(name, label, spec, **kwargs) -> Method:
    micro = ISOPO_MICRO_BATCH_PROMPTS if spec is _ISOPO else None
    return Method(name, label, *spec, config_kwargs=kwargs, micro_batch_prompts=micro)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        _method("grpo", "GRPO (clip 0.2, beta 0.04)", _GRPO, beta=0.04, epsilon=0.2),
        _method("grpo-nokl", "GRPO (no KL)", _GRPO, beta=0.0, epsilon=0.2),
        _method("reinforce", "REINFORCE (no clip)", _GRPO, beta=0.0, **_NO_CLIP),
        _method("isopo", "ISOPO (p=-1)", _ISOPO, beta=0.0, isopo_p=-1.0, **_NO_CLIP),
        _method("isopo-q", "ISOPO (q=-1)", _ISOPO, beta=0.0, isopo_p=0.0, isopo_q=-1.0, **_NO_CLIP),
        _method("isopo-fig6", "ISOPO (p=0,q=-1,r=-2)", _ISOPO, beta=0.0, isopo_p=0.0, isopo_q=-1.0, isopo_r=-2.0,
                isopo_reg=0.0, **_NO_CLIP),
        _method("isopo-interacting", "ISOPO (interacting)", _ISOPO, beta=0.0, isopo_p=0.0, isopo_interacting=True,
                **_NO_CLIP),
        _method("tpo", "TPO (eta 1)", _TPO, tpo_eta=1.0, tpo_anchor=True),
        _method("tpo-no-anchor", "TPO-no-anchor", _TPO, tpo_eta=1.0, tpo_anchor=False),
    )
}

DEMO_METHODS = ("grpo", "reinforce", "isopo", "tpo")


def get_method(name: str) -> Method:
    """Method by registry name (see `METHODS`)."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose from {sorted(METHODS)}") from None


def available(name: str) -> bool:
    """Whether the method's trainer can be imported now (ISOPO/TPO land separately)."""
    try:
        get_method(name).classes()
        return True
    except (ImportError, AttributeError):
        return False
