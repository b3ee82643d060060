"""The methods this package trains with: one table of named settings, each a trainer class, its config class and the
config fields that define it.

Every entry point reads its methods from here (`trl-isopo train|grpo|isopo|tpo|proma`, `trl-isopo real`,
`trl-isopo demo`, `trl-isopo compare` and the benchmarks), so a name means one setting everywhere.

Naming rule: a trainer's plain name is its config class's defaults (`grpo`: TRL 1.16's GRPOConfig, clip 0.2 and no KL
term; `isopo`: ISOPOConfig, Fisher normalization p = -1 without regularization, c = 0; `tpo`: TPOConfig, eta 1 with the
p_old anchor). A suffix names what differs: `-kl` adds TRL's k3 KL to the initial policy with beta 0.04, `-c1` /
`-c0.1` set ISOPO's regularization factor c, `-q` normalizes by the Euclidean instead of the Fisher norm (p = 0,
q = -1). ISOPO's knobs and their paper names: docs/isopo.md.

Each method also states its protocol's optimizer steps per rollout batch (`epochs`): ISOPO has no pi_old, so it and
the ISOPO paper's REINFORCE baseline take one step per batch; GRPO and TPO take the TPO paper's 4
(arXiv 2604.06159 §4.3). The toy lab trains each method in this regime unless told otherwise; the real-model job
takes one step for all.

Adding a method is one `Method(...)` entry in `METHODS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from trl import GRPOConfig, GRPOTrainer

from .isopo.config import ISOPOConfig
from .isopo.trainer import ISOPOTrainer
from .proma.config import PROMAConfig
from .proma.trainer import PROMATrainer
from .tpo.config import TPOConfig
from .tpo.trainer import TPOTrainer


@dataclass(frozen=True)
class Method:
    """A named trainer setting: `trainer_cls` trained with `config_cls(**fields, ...)`."""

    name: str
    label: str  # for tables and plots; stored with every result
    trainer_cls: type
    config_cls: type
    fields: Mapping = field(default_factory=dict)
    epochs: int | None = None  # optimizer steps per rollout batch in the method's protocol (None: the caller's)

    def __post_init__(self):
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))

    def config(self, **settings):
        """`config_cls` with this method's fields; `settings` (sizes, paths, and overrides of the fields) win."""
        return self.config_cls(**{**self.fields, **settings})


_NO_CLIP = {"epsilon": 1e9, "epsilon_high": 1e9}


def _grpo(name, label, epochs=4, **fields) -> Method:
    return Method(name, label, GRPOTrainer, GRPOConfig, fields, epochs)


def _isopo(name, label, **fields) -> Method:
    return Method(name, label, ISOPOTrainer, ISOPOConfig, {"beta": 0.0, **fields}, epochs=1)


def _proma(name, label, **fields) -> Method:
    # Accumulation PROMA projects across the micro-batches of an optimizer step: it needs gradient accumulation
    # (GA = 1 is refused by PROMAConfig), so its entries set 4 unless told otherwise.
    return Method(name, label, PROMATrainer, PROMAConfig, {"beta": 0.0, **fields}, epochs=1)


def _tpo(name, label, **fields) -> Method:
    return Method(name, label, TPOTrainer, TPOConfig, fields, epochs=4)


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        _grpo("grpo", "GRPO (clip 0.2, no KL)", beta=0.0, epsilon=0.2),
        _grpo("grpo-kl", "GRPO (clip 0.2, beta 0.04)", beta=0.04, epsilon=0.2),
        # the ISOPO paper's REINFORCE baseline: group-standardized advantages, importance ratio kept, never clipped
        _grpo("reinforce", "REINFORCE (no clip, no KL)", epochs=1, beta=0.0, **_NO_CLIP),
        _isopo("isopo", "ISOPO (p=-1, c=0)", isopo_p=-1.0, isopo_reg=0.0),
        _isopo("isopo-c1", "ISOPO (p=-1, c=1)", isopo_p=-1.0, isopo_reg=1.0),  # the reference implementation's rule
        _isopo("isopo-c0.1", "ISOPO (p=-1, c=0.1)", isopo_p=-1.0, isopo_reg=0.1),
        _isopo("isopo-c0.01", "ISOPO (p=-1, c=0.01)", isopo_p=-1.0, isopo_reg=0.01),
        _isopo("isopo-ema-median", "ISOPO (p=-1, c=1, EMA median)", isopo_p=-1.0, isopo_reg=1.0,
               isopo_reg_reference="ema_median"),
        _isopo("isopo-batch-median", "ISOPO (p=-1, c=1, batch median)", isopo_p=-1.0, isopo_reg=1.0,
               isopo_reg_reference="batch_median"),
        _isopo("isopo-q", "ISOPO (q=-1, c=0)", isopo_p=0.0, isopo_q=-1.0, isopo_reg=0.0),
        _isopo("isopo-q-c1", "ISOPO (q=-1, c=1)", isopo_p=0.0, isopo_q=-1.0, isopo_reg=1.0),
        # the ISOPO paper's Fig. 6 setting, also the Qwen3 recipes'
        _isopo("isopo-fig6", "ISOPO (p=0,q=-1,r=-2)", isopo_p=0.0, isopo_q=-1.0, isopo_r=-2.0, isopo_reg=0.0),
        # GRPO's KL term (beta 0.04, to the initial policy) added as an ordinary, not re-weighted, gradient
        _isopo("isopo-kl", "ISOPO (p=-1, c=0, beta 0.04)", isopo_p=-1.0, isopo_reg=0.0, beta=0.04),
        _isopo("isopo-interacting", "ISOPO (interacting)", isopo_p=0.0, isopo_interacting=True),
        # the LM head's gradient transformed too (as the reference implementation does); needs full weights
        _isopo("isopo-head", "ISOPO (p=-1, c=0, LM head)", isopo_p=-1.0, isopo_reg=0.0, isopo_lm_head=True),
        # PROMA (arXiv 2601.10498; docs/proma.md): no pi_old, one optimizer step per rollout batch like ISOPO
        _proma("proma", "PROMA (accumulation, s=1)", proma_mode="accumulation", gradient_accumulation_steps=4),
        _proma("proma-intra", "PROMA (intra, k=30)", proma_mode="intra"),
        _proma("proma-both", "PROMA (accumulation + intra on S, k=10)", proma_mode="both", proma_intra_dim=10,
               proma_intra_target="accumulated", gradient_accumulation_steps=4),  # the reference's proma_both script
        _tpo("tpo", "TPO (eta 1)", tpo_eta=1.0, tpo_anchor=True),
        _tpo("tpo-no-anchor", "TPO-no-anchor", tpo_eta=1.0, tpo_anchor=False),  # the TPO paper's ablation
    )
}

# Names whose setting changed when the entry points' method tables were merged into this one (2026-12-02). A result
# stored before carries its old name and the label of its setting; `current_name` reads it under today's name, so an
# old record is neither relabelled nor mistaken for today's setting of the same name.
RENAMED: dict[tuple[str, str], str] = {
    ("grpo", "GRPO (clip 0.2, beta 0.04)"): "grpo-kl",  # toy lab
    ("grpo", "GRPO (beta 0.04)"): "grpo-kl",  # real-model job (benchmarks/results/real-model/runs.jsonl)
    ("grpo-nokl", "GRPO (no KL)"): "grpo",
    ("isopo", "ISOPO (p=-1, c=1)"): "isopo-c1",  # toy lab; the real-model job's `isopo` was already c = 0
    ("isopo-q", "ISOPO (q=-1, c=1)"): "isopo-q-c1",
    ("isopo-reg0", "ISOPO (p=-1, c=0)"): "isopo",
    ("isopo-reg1", "ISOPO (p=-1, c=1)"): "isopo-c1",
    ("isopo-q0", "ISOPO (q=-1, c=0)"): "isopo-q",
    ("isopo-reg0-kl", "ISOPO (p=-1, c=0, beta 0.04)"): "isopo-kl",
}


def get_method(name: str) -> Method:
    """The method named `name` (a key of `METHODS`); a ValueError listing the names otherwise."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; choose from {sorted(METHODS)}") from None


def current_name(name: str, label: str | None) -> str:
    """Today's name of a stored result's method, from the name and label it was stored with (see `RENAMED`)."""
    return RENAMED.get((name, label), name)
