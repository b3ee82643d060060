"""How the lab trains each method of `trl_isopo.methods`: optimizer steps per rollout batch, learning rate and
micro-batching, with the command line's overrides.

By default a method trains in its protocol's regime (`Method.epochs`: ISOPO and REINFORCE one optimizer step per
rollout batch, GRPO and TPO 4), all at the setting's learning rate. ISOPO's per-sequence statistics are per micro-batch
and cost about (sequences per micro-batch) x (tokens), so ISOPO trains in micro-batches of `ISOPO_MICRO_BATCH_PROMPTS`
whole groups (the reference implementation used micro-batches of 8 sequences); PROMA likewise, and in at least two
micro-batches (its accumulation variant projects a micro-batch's gradient against the earlier ones); the others take
an episode in one.
"""

from __future__ import annotations

from trl_isopo.isopo.trainer import ISOPOTrainer
from trl_isopo.methods import Method, get_method
from trl_isopo.proma.trainer import PROMATrainer

ISOPO_MICRO_BATCH_PROMPTS = 10  # 10 prompts x K = 80 sequences per micro-batch at K = 8


def micro_batch_prompts(method: Method, prompts_per_step: int | None = None) -> int | None:
    """Prompts per micro-batch the lab gives `method` by default (None: the whole episode in one)."""
    if issubclass(method.trainer_cls, PROMATrainer):
        return max(1, min(ISOPO_MICRO_BATCH_PROMPTS, (prompts_per_step or 2 * ISOPO_MICRO_BATCH_PROMPTS) // 2))
    return ISOPO_MICRO_BATCH_PROMPTS if issubclass(method.trainer_cls, ISOPOTrainer) else None


def parse_method_values(text: str | None, kind=float) -> dict[str, float]:
    """"isopo=1,grpo=4" -> {"isopo": 1, "grpo": 4} (names checked against the method table); "" or None -> {}."""
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
    override for every method (`epochs` / `lr`), then the method's protocol (`Method.epochs`), then the defaults."""
    m = get_method(name)
    e = (method_epochs or {}).get(name) or epochs or m.epochs or default_epochs
    r = (method_lr or {}).get(name) or lr or default_lr
    return int(e), float(r)
