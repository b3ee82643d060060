"""Registry of the methods the lab compares, each a real trainer class plus the config fields that define it.

Every method trains through `trl.GRPOTrainer` or one of our subclasses; nothing here re-implements a loss.
- grpo: TRL's clipped surrogate (eps 0.2) with beta = 0.04. TRL's k3 KL is to the *initial* (reference) model, the
  paper's to the rollout snapshot (tpo-spec §2): documented in docs/reproduction.md.
- grpo-nokl: the same with beta = 0 (the paper's "GRPO (no KL)" ablation).
- reinforce: GRPOTrainer with epsilon = epsilon_high = 1e9 (no clipping) and beta = 0 (the ISOPO paper's "pure"
  REINFORCE baseline: group-standardized advantages, importance ratio kept, never clipped).
- isopo, isopo-q, isopo-fig6, isopo-interacting: ISOPO's named settings (isopo-spec §2.4-2.5), beta = 0, unclipped.
- isopo-reg0, isopo-q0: p = -1 / q = -1 with c = 0 (pure per-sequence normalization); isopo-c0.1, isopo-c0.01: p = -1
  with a small regularization factor c; isopo-ema-median, isopo-batch-median: p = -1, c = 1 with the regularizer's
  reference point at the (EMA of the) median of f^2 instead of the mean; isopo-reg0-kl: isopo-reg0 plus TRL's k3 KL
  to the initial policy with GRPO's beta 0.04 as an ordinary (not re-weighted) gradient (docs/isopo-regularizer.md
  has the toy-task measurements behind these).
- tpo, tpo-no-anchor: Target Policy Optimization with eta = 1, with / without the p_old anchor.

Each method also carries its own training regime (`epochs`: optimizer steps per rollout batch, `lr`; None = the
setting's). ISOPO and its paper's REINFORCE baseline take one optimizer step per rollout batch (ISOPO has no pi_old,
so reusing a batch is not part of the method); GRPO and TPO take the TPO paper's 4 epochs. `regime()` resolves a
method's epochs and lr from these defaults and command-line overrides.
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
    epochs: int | None = None  # optimizer steps per rollout batch in the method's own regime (None: the setting's)
    lr: float | None = None  # learning rate in the method's own regime (None: the setting's)

    def classes(self):
        """(trainer class, config class); raises ImportError while the trainer has not landed."""
        mod = import_module(self.module)
        return getattr(mod, self.trainer_name), getattr(mod, self.config_name)


def _method(name, label, spec, epochs=None, lr=None, **kwargs) -> Method:
    micro = ISOPO_MICRO_BATCH_PROMPTS if spec is _ISOPO else None
    if spec is _ISOPO and epochs is None:
        epochs = 1  # ISOPO's protocol: one optimizer step per rollout batch
    return Method(name, label, *spec, config_kwargs=kwargs, micro_batch_prompts=micro, epochs=epochs, lr=lr)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        _method("grpo", "GRPO (clip 0.2, beta 0.04)", _GRPO, epochs=4, beta=0.04, epsilon=0.2),
        _method("grpo-nokl", "GRPO (no KL)", _GRPO, epochs=4, beta=0.0, epsilon=0.2),
        _method("reinforce", "REINFORCE (no clip)", _GRPO, epochs=1, beta=0.0, **_NO_CLIP),
        _method("isopo", "ISOPO (p=-1, c=1)", _ISOPO, beta=0.0, isopo_p=-1.0, isopo_reg=1.0),
        _method("isopo-q", "ISOPO (q=-1, c=1)", _ISOPO, beta=0.0, isopo_p=0.0, isopo_q=-1.0, isopo_reg=1.0),
        _method("isopo-fig6", "ISOPO (p=0,q=-1,r=-2)", _ISOPO, beta=0.0, isopo_p=0.0, isopo_q=-1.0, isopo_r=-2.0,
                isopo_reg=0.0),
        _method("isopo-reg0", "ISOPO (p=-1, c=0)", _ISOPO, beta=0.0, isopo_p=-1.0, isopo_reg=0.0),
        _method("isopo-q0", "ISOPO (q=-1, c=0)", _ISOPO, beta=0.0, isopo_p=0.0, isopo_q=-1.0, isopo_reg=0.0),
        _method("isopo-c0.1", "ISOPO (p=-1, c=0.1)", _ISOPO, beta=0.0, isopo_p=-1.0, isopo_reg=0.1),
        _method("isopo-c0.01", "ISOPO (p=-1, c=0.01)", _ISOPO, beta=0.0, isopo_p=-1.0, isopo_reg=0.01),
        _method("isopo-ema-median", "ISOPO (p=-1, c=1, EMA median)", _ISOPO, beta=0.0, isopo_p=-1.0, isopo_reg=1.0,
                isopo_reg_reference="ema_median"),
        _method("isopo-batch-median", "ISOPO (p=-1, c=1, batch median)", _ISOPO, beta=0.0, isopo_p=-1.0,
                isopo_reg=1.0, isopo_reg_reference="batch_median"),
        _method("isopo-reg0-kl", "ISOPO (p=-1, c=0, beta 0.04)", _ISOPO, beta=0.04, isopo_p=-1.0, isopo_reg=0.0),
        _method("isopo-interacting", "ISOPO (interacting)", _ISOPO, beta=0.0, isopo_p=0.0, isopo_interacting=True),
        _method("tpo", "TPO (eta 1)", _TPO, epochs=4, tpo_eta=1.0, tpo_anchor=True),
        _method("tpo-no-anchor", "TPO-no-anchor", _TPO, epochs=4, tpo_eta=1.0, tpo_anchor=False),
    )
}

# The demo's ISOPO is the setting that reached <= 25% final error in the most seeds of the toy sweep
# (docs/isopo-regularizer.md): p=-1 without regularization, plus GRPO's KL term to the initial policy.
DEMO_METHODS = ("grpo", "reinforce", "isopo-reg0-kl", "tpo")


def get_method(name: str) -> Method:
    """Method by registry name (see `METHODS`)."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose from {sorted(METHODS)}") from None


def parse_method_values(text: str | None, kind=float) -> dict[str, float]:
    """"isopo=1,grpo=4" -> {"isopo": 1, "grpo": 4} (names checked against the registry); "" or None -> {}."""
    out = {}
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"expected name=value, got {part!r}")
        get_method(name.strip())
        out[name.strip()] = kind(value)
    return out


def regime(name: str, default_epochs: int, default_lr: float, epochs: int | None = None, lr: float | None = None,
           method_epochs: dict | None = None, method_lr: dict | None = None) -> tuple[int, float]:
    """(epochs, lr) a method trains with. Precedence: per-method override (`method_epochs` / `method_lr`), then an
    override for every method (`epochs` / `lr`), then the method's own regime (registry), then the defaults."""
    m = get_method(name)
    e = (method_epochs or {}).get(name) or epochs or m.epochs or default_epochs
    r = (method_lr or {}).get(name) or lr or m.lr or default_lr
    return int(e), float(r)


def available(name: str) -> bool:
    """Whether the method's trainer can be imported now (ISOPO/TPO land separately)."""
    try:
        get_method(name).classes()
        return True
    except (ImportError, AttributeError):
        return False
