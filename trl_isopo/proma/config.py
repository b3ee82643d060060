"""`PROMAConfig`: GRPOConfig plus the PROMA knobs (arXiv 2601.10498; `docs/proma.md`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import GRPOConfig

from ..layerwise.costs import ROUTES
from ..layerwise.other_params import OTHER_PARAMS_MODES
from ..layerwise.rules import SURROGATE_LOSS_TYPES, surrogate_config_errors
from .accumulation import SOLVERS
from .intra import INTRA_TARGETS
from .projection import MODES, PROMASettings

_ACCUMULATION_KNOBS = ("proma_shrinkage", "proma_ridge", "proma_solver", "proma_gs_sweeps", "proma_relative_bound")
_INTRA_KNOBS = ("proma_intra_dim", "proma_intra_power_iters", "proma_intra_shrinkage", "proma_intra_target")


@dataclass
class PROMAConfig(GRPOConfig):
    r"""
    Configuration class for the PROMA trainer (Projected Microbatch Accumulation, arXiv 2601.10498).

    Inherits every [`~trl.GRPOConfig`] field. PROMA is reference-free and unclipped: the proximal control is a
    projection of each covered linear layer's gradient inside the backward pass, per micro-batch. With V_i the layer
    gradient of sequence i's advantage-free surrogate, G_m = sum_i A_i V_i the micro-batch's policy gradient and S the
    gradient accumulated over the earlier micro-batches of the optimizer step:

    - accumulation variant (arXiv 2601.10498 v4 §2): S <- S - s * P + G_m, P the ridge fit of S by the micro-batch's
      unit gradients V_i / ||V_i|| (the components of S along the current micro-batch's sequence gradients are removed);
    - intra variant: G_m <- G_m - s_i * Pi(G_m), Pi the orthogonal projector onto the outer products of the
      approximate top-k right-singular directions of the micro-batch's layer inputs and output gradients.

    Accumulation PROMA depends on the micro-batch order and grouping and needs gradient_accumulation_steps > 1; it runs
    one chain per process (docs/proma.md). The defaults are those of the reference implementation (nilin/proma);
    each help text says which revision's default it is.

    Parameters:
        proma_mode (`str`, *optional*, defaults to `"accumulation"`):
            `"accumulation"`, `"intra"` or `"both"` (the reference's `proma_both` script).
        proma_shrinkage (`float`, *optional*, defaults to `1.0`):
            s, the fraction of the fit P removed from S.
        proma_ridge (`float`, *optional*, defaults to `1e-2`):
            lambda of the exact solve (K^ + lambda I) w = b, relative (K^ has unit diagonal).
        proma_solver (`str`, *optional*, defaults to `"solve"`):
            `"solve"` (exact ridge solve) or `"gram_schmidt"` (sequential sweeps over the sequences, no ridge).
        proma_gs_sweeps (`int`, *optional*, defaults to `2`):
            Sweeps of the Gram-Schmidt solver.
        proma_relative_bound (`float` or `None`, *optional*, defaults to `None`):
            beta: P is scaled down to beta * ||G_m|| when longer. None = off.
        proma_skip_fraction (`float`, *optional*, defaults to `0.0`):
            f: micro-batches j < f * M of each optimizer step (M = gradient_accumulation_steps) are not projected.
        proma_intra_dim (`int`, *optional*, defaults to `30`):
            k, the sketch size of the intra variant (clamped to the valid tokens and the layer's dimensions).
        proma_intra_power_iters (`int`, *optional*, defaults to `1`):
            q, power iterations of the range finder.
        proma_intra_shrinkage (`float`, *optional*, defaults to `1.0`):
            s_i, the fraction of Pi(.) removed.
        proma_intra_target (`str`, *optional*, defaults to `"microbatch"`):
            What the intra projection acts on: the micro-batch gradient (order-independent), the accumulated
            gradient before (`"accumulated"`) or after (`"accumulated_after"`) adding the micro-batch.
        proma_route (`str`, *optional*, defaults to `"auto"`), proma_chunk_mb (`float`, *optional*, defaults to `256`):
            How the per-sequence kernel <V_i, V_j> is computed, and the memory budget of chunked intermediates (as
            ISOPO's `isopo_route` / `isopo_chunk_mb`).
        proma_other_params (`str`, *optional*, defaults to `"advantage_weighted"`):
            What trainable parameters outside the covered linear layers receive (as `isopo_other_params`).
        proma_lm_head (`bool`, *optional*, defaults to `False`):
            Also project the LM head's weight gradient.
        loss_type (`str`, *optional*, defaults to `"bnpo"`):
            Only the normalization of the surrogate: "bnpo" (token mean over the micro-batch, the reference's),
            "grpo", "dr_grpo" or "dapo".
    """

    proma_mode: str = field(
        default="accumulation",
        metadata={"help": "Which PROMA variant: accumulation (arXiv 2601.10498 v4 §2), intra (the factored "
                          "intra-micro-batch projection) or both (the reference's proma_both script).",
                  "choices": list(MODES)},
    )
    proma_shrinkage: float = field(
        default=1.0,
        metadata={"help": "s: fraction of the fit P removed from the running gradient, in [0, 2]. 1.0 is the default "
                          "of reference revision 0f7ee8b9 and the value of every accumulation run; later revisions "
                          "default to 0.0 because s = 0 switched accumulation off there (here: proma_mode)."},
    )
    proma_ridge: float = field(
        default=1e-2,
        metadata={"help": "lambda of the exact solve (K^ + lambda I) w = b on unit-normalized sequence gradients "
                          "(relative: K^ has unit diagonal). 1e-2 is hard-coded in every reference revision since "
                          "0ca24457. Must be > 0; only for proma_solver='solve'."},
    )
    proma_solver: str = field(
        default="solve",
        metadata={"help": "solve: exact ridge solve in float64 (all reference revisions' default, quick_ntk=False). "
                          "gram_schmidt: sequential Gram-Schmidt sweeps over the sequences, no ridge (the January "
                          "runs' quick_ntk=True; the later vectorized quick form is not a projection and is not "
                          "offered).", "choices": list(SOLVERS)},
    )
    proma_gs_sweeps: int = field(
        default=2, metadata={"help": "Sweeps of the gram_schmidt solver (hard-coded 2 in the reference)."}
    )
    proma_relative_bound: float | None = field(
        default=None,
        metadata={"help": "beta: scale P down to beta * ||G_m|| when it is longer; None = off (latest reference "
                          "revision 9165d359 removed it; 0.5 in bc160d82..e7b27d39, 1.0 in 0f7ee8b9)."},
    )
    proma_skip_fraction: float = field(
        default=0.0,
        metadata={"help": "f in [0, 1): micro-batches j < f * gradient_accumulation_steps of each optimizer step are "
                          "summed without projection (neither variant). 0.0 is the default of e7b27d39 and later; "
                          "the reference's best accumulation run used 0.5."},
    )
    proma_intra_dim: int = field(
        default=30,
        metadata={"help": "k: sketch size of the intra variant, clamped to min(k, valid tokens, d_in, d_out). 30 is "
                          "the reference default (bc160d82 and later); its scripts use 100, its best run 10."},
    )
    proma_intra_power_iters: int = field(
        default=1, metadata={"help": "q: power iterations of the intra range finder (reference default 1)."}
    )
    proma_intra_shrinkage: float = field(
        default=1.0,
        metadata={"help": "s_i: fraction of the intra projection removed, in [0, 2] (reference default 1.0)."},
    )
    proma_intra_target: str = field(
        default="microbatch",
        metadata={"help": "What the intra projection acts on: microbatch (the micro-batch's own gradient; reference "
                          "default, order-independent), accumulated (the running gradient before the micro-batch, "
                          "the reference's proma_intra_to_accumulated, used by proma_both) or accumulated_after "
                          "(after adding it).", "choices": list(INTRA_TARGETS)},
    )
    proma_route: str = field(
        default="auto",
        metadata={"help": "How the kernel <V_i, V_j> of the accumulation variant is computed: gram, mat or auto (as "
                          "isopo_route).", "choices": list(ROUTES)},
    )
    proma_chunk_mb: float = field(
        default=256.0, metadata={"help": "Memory budget (MiB) of any chunked intermediate (as isopo_chunk_mb)."}
    )
    proma_other_params: str = field(
        default="advantage_weighted",
        metadata={"help": "Gradient of trainable parameters outside the covered linear layers: advantage_weighted "
                          "(REINFORCE), surrogate (the reference's advantage-free gradient) or frozen.",
                  "choices": list(OTHER_PARAMS_MODES)},
    )
    proma_lm_head: bool = field(
        default=False,
        metadata={"help": "Also project the LM head's weight gradient (the reference covers every nn.Linear, head "
                          "included; accumulation on a large-vocabulary head costs about one more head GEMM)."},
    )
    vllm_importance_sampling_correction: bool = field(
        default=False,
        metadata={"help": "Off for PROMA (TRL's default is True): PROMA applies no importance-sampling weight; "
                          "log-probs are recomputed by the training model. True is refused."},
    )
    loss_type: str = field(
        default="bnpo",
        metadata={"help": "Normalization of the advantage-free surrogate (PROMA has no clipping).",
                  "choices": list(SURROGATE_LOSS_TYPES)},
    )

    def __post_init__(self):
        super().__post_init__()
        errors = self._proma_errors() + surrogate_config_errors(self, "PROMA", entropy_bonus=False)
        if errors:
            raise ValueError("Invalid PROMAConfig:\n- " + "\n- ".join(errors))

    def proma_settings(self) -> PROMASettings:
        """The math knobs as the per-layer functions take them."""
        return PROMASettings(
            mode=self.proma_mode, shrinkage=self.proma_shrinkage, ridge=self.proma_ridge, solver=self.proma_solver,
            sweeps=self.proma_gs_sweeps, relative_bound=self.proma_relative_bound, intra_dim=self.proma_intra_dim,
            intra_power_iters=self.proma_intra_power_iters, intra_shrinkage=self.proma_intra_shrinkage,
            intra_target=self.proma_intra_target, route=self.proma_route,
            budget_bytes=int(self.proma_chunk_mb * 2**20),
        )

    def _non_default(self, names) -> list[str]:
        fields = type(self).__dataclass_fields__
        return [n for n in names if getattr(self, n) != fields[n].default]

    def _proma_errors(self) -> list[str]:
        errors = []
        for name, value, choices in (
            ("proma_mode", self.proma_mode, MODES), ("proma_solver", self.proma_solver, SOLVERS),
            ("proma_intra_target", self.proma_intra_target, INTRA_TARGETS), ("proma_route", self.proma_route, ROUTES),
            ("proma_other_params", self.proma_other_params, OTHER_PARAMS_MODES),
        ):
            if value not in choices:
                errors.append(f"{name} must be one of {choices} (got {value!r}).")
        for name in ("proma_shrinkage", "proma_intra_shrinkage"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0.0 <= value <= 2.0):
                errors.append(f"{name} must be in [0, 2] (got {value!r}): beyond 2 the step amplifies the component "
                              "it is meant to remove.")
        ridge = self.proma_ridge
        if not (isinstance(ridge, (int, float)) and math.isfinite(ridge) and ridge > 0):
            errors.append(f"proma_ridge must be a finite number > 0 (got {self.proma_ridge!r}); for the unregularized "
                          "projection use proma_solver='gram_schmidt' with more proma_gs_sweeps.")
        if self.proma_gs_sweeps < 1:
            errors.append(f"proma_gs_sweeps must be >= 1 (got {self.proma_gs_sweeps}).")
        if self.proma_relative_bound is not None and not self.proma_relative_bound >= 0:
            errors.append(f"proma_relative_bound must be None (off) or >= 0 (got {self.proma_relative_bound!r}).")
        if not 0.0 <= self.proma_skip_fraction < 1.0:
            errors.append(f"proma_skip_fraction must be in [0, 1) (got {self.proma_skip_fraction}); 1 would never "
                          "project.")
        if self.proma_intra_dim < 1:
            errors.append(f"proma_intra_dim must be >= 1 (got {self.proma_intra_dim}).")
        if self.proma_intra_power_iters < 0:
            errors.append(f"proma_intra_power_iters must be >= 0 (got {self.proma_intra_power_iters}).")
        if self.proma_chunk_mb <= 0:
            errors.append(f"proma_chunk_mb must be > 0 (got {self.proma_chunk_mb}).")
        # Knobs the chosen mode or solver never reads must stay at their defaults: nothing is silently ignored.
        if self.proma_mode == "intra" and self._non_default(_ACCUMULATION_KNOBS):
            errors.append(f"{self._non_default(_ACCUMULATION_KNOBS)} only apply to the accumulation variant: leave "
                          "them at their defaults or set proma_mode='both'.")
        if self.proma_mode == "accumulation" and self._non_default(_INTRA_KNOBS):
            errors.append(f"{self._non_default(_INTRA_KNOBS)} only apply to the intra variant: leave them at their "
                          "defaults or set proma_mode='both'.")
        if self.proma_solver == "gram_schmidt" and self._non_default(["proma_ridge"]):
            errors.append("proma_ridge applies to proma_solver='solve' only (Gram-Schmidt sweeps have no ridge).")
        if self.proma_solver == "solve" and self._non_default(["proma_gs_sweeps"]):
            errors.append("proma_gs_sweeps applies to proma_solver='gram_schmidt' only.")
        M = self.gradient_accumulation_steps
        needs_chain = self.proma_mode != "intra" or self.proma_intra_target != "microbatch"
        if needs_chain and M < 2:
            errors.append(
                "proma_mode / proma_intra_target project the gradient accumulated over earlier micro-batches of the "
                "optimizer step; with gradient_accumulation_steps=1 there is none and the update is the plain policy "
                "gradient: raise gradient_accumulation_steps or use proma_mode='intra' with proma_intra_target="
                "'microbatch'."
            )
        elif (M - 1) < self.proma_skip_fraction * M:
            errors.append(f"proma_skip_fraction={self.proma_skip_fraction} skips all {M} micro-batches of each "
                          "optimizer step: lower it or raise gradient_accumulation_steps.")
        return errors
