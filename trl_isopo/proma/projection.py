"""One covered linear layer's PROMA step for one micro-batch (arXiv 2601.10498 v4, §2 and the intra variant).

`proma_layer_step` combines the two variants (`accumulation.py`, `intra.py`) into the weight-gradient increment
that the layer's backward returns, dS_m = S_m - S_{m-1}, as ONE re-weighted GEMM plus at most one rank-k update:

    dS_m = sum_i c_i V_i - s_i Q_g M Q_a^T,        c_i = A_i - s kappa w_i / e_i   (c_i = A_i without accumulation)

with the k x k core M of the intra target, C_i = Q_g^T V_i Q_a (`intra.sequence_cores`):

    "microbatch"        M = sum_i A_i C_i                  (= Q_g^T G_m Q_a)   G~_m = G_m - s_i Pi(G_m) replaces G_m
    "accumulated"       M = Q_g^T S_{m-1} Q_a              S' = S_{m-1} - s_i Pi(S_{m-1}) is what accumulation fits
    "accumulated_after" M = Q_g^T S_{m-1} Q_a + sum_i c_i C_i   S_m = S' - s_i Pi(S'), S' = S_{m-1} + G_m - s kappa P_m

For "accumulated", accumulation fits S' instead of S_{m-1}: b_i = <V_i, S_{m-1}> - s_i <C_i, M>. For "microbatch",
the relative bound compares ||P|| with ||G~_m|| (||G~||^2 = ||G||^2 - (2 s_i - s_i^2) ||M||^2). Each form is checked
against a dense float64 oracle in tests/test_proma_*.py.

Micro-batches before the skip gate (`projection_active`) get dS_m = G_m (neither variant). The running gradient is
per process (one chain per rank, docs/proma.md); its dtype is the statistics dtype (float32 for half layers).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..layerwise.costs import MAT_MACS_PER_FLOAT, ROUTES, gemm_macs, route_costs, statistics_cost
from ..layerwise.precision import matmul_f32, stat_dtype
from ..layerwise.statistics import sequence_statistics
from ..layerwise.weight_grad import reweighted_weight_grad
from .accumulation import SOLVERS, accumulation_coefficients, dense_accumulation_step, running_overlaps
from .intra import INTRA_TARGETS, core_of, factored_basis, intra_macs, sequence_cores

MODES = ("accumulation", "intra", "both")
# Order of the entries of `PROMAStep.metrics` (a device vector, reduced by the caller at logging time).
METRIC_NAMES = (
    "active",  # 1 if this micro-batch was projected (after the skip gate), else 0 (and every other entry 0)
    "running_norm",  # ||S_{m-1}|| (of S' for intra_target="accumulated")
    "projected_fraction",  # kappa ||P_m|| / ||S_{m-1}||: the part of S lying in the micro-batch's span (ridge fit)
    "bound_factor",  # kappa (1 when the relative bound is off or inactive)
    "reduction_pct",  # 100 (1 - ||S - s kappa P|| / ||S||): the reference's norm-reduction metric
    "intra_rank",  # resolved sketch columns (min over the two bases)
    "intra_fraction",  # ||Pi(T)|| / ||T|| of the intra target T
    "intra_reduction_pct",  # 100 (1 - ||T - s_i Pi(T)|| / ||T||)
)


@dataclass(frozen=True)
class PROMASettings:
    """The math knobs (documented on `PROMAConfig`). budget_bytes bounds chunked intermediates. No defaults: a
    config is the one place that has them, and `PROMAConfig.proma_settings` builds these from it."""

    mode: str
    shrinkage: float
    ridge: float
    solver: str
    sweeps: int
    relative_bound: float | None
    intra_dim: int
    intra_power_iters: int
    intra_shrinkage: float
    intra_target: str
    route: str
    budget_bytes: int

    def __post_init__(self):
        for name, value, choices in (("mode", self.mode, MODES), ("solver", self.solver, SOLVERS),
                                     ("intra_target", self.intra_target, INTRA_TARGETS), ("route", self.route, ROUTES)):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}, got {value!r}")

    @property
    def accumulation(self) -> bool:
        return self.mode in ("accumulation", "both")

    @property
    def intra(self) -> bool:
        return self.mode in ("intra", "both")

    @property
    def needs_running(self) -> bool:
        """Whether a micro-batch's step reads S_{m-1}: accumulation, or an intra target on S. Intra on each
        micro-batch's own gradient (the default target) does not, so no running copy is kept for it."""
        return self.accumulation or self.intra_target != "microbatch"

    def accumulation_knobs(self) -> dict:
        return dict(shrinkage=self.shrinkage, ridge=self.ridge, solver=self.solver, sweeps=self.sweeps,
                    relative_bound=self.relative_bound)


def projection_active(index: int, num_micro_batches: int, skip_fraction: float) -> bool:
    """The skip gate: micro-batch `index` (0-based within the optimizer step) of `num_micro_batches` is projected
    iff index >= skip_fraction * num_micro_batches (host integers only; the earlier ones are summed plainly)."""
    return index >= skip_fraction * num_micro_batches


def sketch_seed(*key: int) -> int:
    """A 63-bit seed for the intra sketches of one layer call from integers such as (seed, process index, global
    step, micro-batch index, layer index): a fixed hash, so runs are reproducible and calls independent."""
    digest = hashlib.blake2b(repr(tuple(int(k) for k in key)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class PROMAStep(NamedTuple):
    """What `proma_layer_step` returns, in `stat_dtype(X.dtype)`.

    grad_weight: (d_out, d_in) dS_m, the weight gradient the backward returns (autograd accumulation then sums
    the increments into S_M). grad_bias: (d_out,) or None. running / running_bias: S_m (and the bias's), new tensors
    (never aliasing grad_weight), None when not kept. metrics: (len(METRIC_NAMES),) float32 device vector.
    """

    grad_weight: torch.Tensor
    grad_bias: torch.Tensor | None
    running: torch.Tensor | None
    running_bias: torch.Tensor | None
    metrics: torch.Tensor


@dataclass
class PROMALayerState:
    """The running gradients of one covered layer on this process: S (d_out, d_in) and the bias's (d_out,), None
    before the first micro-batch of an optimizer step. The owner resets it at every optimizer step."""

    weight: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    def reset(self) -> None:
        self.weight = self.bias = None

    def update(self, step: PROMAStep) -> None:
        self.weight, self.bias = step.running, step.running_bias


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    return torch.where(den > 0, num / torch.where(den > 0, den, 1.0), 0.0)


def _reduction_pct(sq_before: torch.Tensor, sq_after: torch.Tensor) -> torch.Tensor:
    return 100.0 * (1.0 - _ratio(sq_after.clamp_min(0).sqrt(), sq_before.clamp_min(0).sqrt())) * (sq_before > 0)


def _sq(M: torch.Tensor) -> torch.Tensor:
    """||M||^2 as a float64 scalar (a reduction in M's dtype: no float64 copy of a weight-sized M)."""
    return torch.linalg.vector_norm(M).to(torch.float64).square()


def accumulation_route(s: PROMASettings, B: int, L: int, d_in: int, d_out: int, stat_cost: float = 1.0) -> str:
    """The statistics route of accumulation's kernel K and overlaps <V_i, S>: `s.route`, or for "auto" the cheaper of
    "gram" (K from token Grams; the overlaps one more weight-gradient GEMM) and "mat" (K and the overlaps from the
    chunks of V, one pass each) by `costs.route_costs` plus the overlaps. `stat_cost`: `costs.statistics_cost`."""
    if s.route != "auto":
        return s.route
    cost = route_costs(B, L, d_in, d_out, 0, False, True, s.budget_bytes, stat_cost=stat_cost)
    gram = cost.gram + stat_cost * B * L * d_in * d_out
    mat = cost.mat + (1 + MAT_MACS_PER_FLOAT) * B * d_in * d_out
    return "gram" if gram < mat else "mat"


def proma_layer_step(
    X: torch.Tensor,
    G: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    settings: PROMASettings,
    *,
    running: torch.Tensor | None = None,
    running_bias: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    active: bool = True,
    has_bias: bool = False,
    stats=None,
    sketches: tuple[torch.Tensor, torch.Tensor] | None = None,
    scratch=None,
    keep_running: bool = True,
    shared_input=None,
) -> PROMAStep:
    """PROMA weight-gradient increment of one covered linear layer for one micro-batch (module docstring).

    Args:
        X: (B, L, d_in) layer inputs; G: (B, L, d_out) output gradients of the advantage-free surrogate (so that
            sum_i A_i V_i is the micro-batch's policy gradient), float64 / float32 / bf16 / fp16. At every padding
            position the row of X or of G is zero and the other finite (ISOPO's layer contract).
        mask: (B, L) bool valid positions. advantages: (B,) A_i.
        settings: `PROMASettings`.
        running: (d_out, d_in) S_{m-1} of this layer on this process, None at the first micro-batch of the step.
        running_bias: (d_out,) the bias's running gradient (accumulation PROMA per parameter tensor), or None.
        generator: torch.Generator for the intra sketches (needed when the intra variant runs and `sketches` is None).
        active: the skip gate's decision (`projection_active`); False gives dS = G_m.
        has_bias: also return the bias gradient: accumulation PROMA of the bias tensor on its own per-sequence
            gradients sum_{t in T_i} delta_t (the intra variant leaves it as is).
        stats: ISOPO `SequenceStats` with `ntk` already computed for this layer (else computed here when needed).
        sketches: (Omega_a, Omega_g) to use instead of drawing from `generator` (tests).
        scratch: ISOPO `Scratch` for the statistics' large temporaries.
        keep_running: return S_m (and the bias's); False returns None for both (`PROMASettings.needs_running`
            says when the next step does not read them: a full-size copy per layer saved).
        shared_input: the engine's entry of X (`layerwise.inputs.SharedInput`): the intra input range finder is
            computed once for the layers that read X (`intra.factored_basis`); None computes it here.
    """
    s = settings
    sdt = stat_dtype(X.dtype)
    f64 = torch.float64
    A = advantages.to(device=X.device, dtype=sdt)
    S = None if running is None else running.to(sdt)
    zero = torch.zeros((), dtype=f64, device=X.device)
    m = dict.fromkeys(METRIC_NAMES, zero)
    acc = active and s.accumulation and S is not None
    intra = active and s.intra
    c = A.to(f64)
    s_sq = None if S is None else _sq(S)
    basis = cores = M_S = None
    if intra:
        # Per-sequence cores only where accumulation needs them (its overlaps with S', or the bound's ||G~||);
        # otherwise the core comes from the materialized target (Q_g^T T Q_a: d_out d_in k MACs instead of two
        # passes n k (d_in + d_out) over the micro-batch, fewer whenever n > d_in d_out / (d_in + d_out)).
        need_cores = acc and s.intra_target in ("accumulated", "microbatch")
        basis = factored_basis(X, G, mask, s.intra_dim, s.intra_power_iters, generator, sketches=sketches,
                               budget_bytes=s.budget_bytes, rows=need_cores, shared_input=shared_input)
        cores = sequence_cores(basis) if need_cores else None
        if S is not None and s.intra_target != "microbatch":
            M_S = core_of(basis, S)
    si = s.intra_shrinkage
    shrink = 2 * si - si * si  # ||T - s_i Pi T||^2 = ||T||^2 - shrink ||Pi T||^2 (Pi an orthogonal projector)
    if acc:
        if stats is None or stats.ntk is None:
            # the "mat" route sums <V_i, S> while each chunk of V is there: with V too large to keep, that saves a
            # weight-gradient-sized GEMM per layer (running_overlaps without V)
            route = accumulation_route(s, *X.shape[:2], X.shape[-1], G.shape[-1], statistics_cost(X.dtype, X.device))
            stats = sequence_statistics(X, G, None, False, True, route, s.budget_bytes, False, mask, scratch,
                                        overlap_with=S)
        b_raw = stats.overlaps if stats.overlaps is not None else running_overlaps(X, G, S, stats.V, s.budget_bytes)
        K, b_raw = stats.ntk.to(f64), b_raw.to(f64)
        g_sq, fit_sq = None, s_sq
        if intra and s.intra_target == "accumulated":  # accumulation fits S' = S - s_i Pi(S)
            b_raw = b_raw - si * (cores * M_S).sum((1, 2)).to(f64)
            fit_sq = s_sq - shrink * _sq(M_S)
        elif intra and s.intra_target == "microbatch":  # the bound compares with ||G~||
            g_sq = A.to(f64) @ K @ A.to(f64) - shrink * _sq(torch.einsum("b,bij->ij", A, cores))
        co = accumulation_coefficients(K, b_raw, A, g_sq_norm=g_sq, **s.accumulation_knobs())
        c = co.coefficients
        removed = s.shrinkage * co.kappa
        after_sq = fit_sq - 2 * removed * co.p_dot_s + removed * removed * co.p_norm * co.p_norm
        fit_norm = fit_sq.clamp_min(0).sqrt()
        m.update(running_norm=fit_norm, projected_fraction=_ratio(co.kappa * co.p_norm, fit_norm),
                 bound_factor=co.kappa, reduction_pct=_reduction_pct(fit_sq, after_sq))
    gw, _ = reweighted_weight_grad(X, G, c.to(sdt), stats if acc else None, bias=False, scratch=scratch)
    if intra:
        target = s.intra_target
        if target == "microbatch":  # Q_g^T G_m Q_a (gw = G_m when accumulation does not run: c = A)
            M = torch.einsum("b,bij->ij", A, cores) if acc else core_of(basis, gw)
            t_sq = A.to(f64) @ K @ A.to(f64) if acc else _sq(gw)  # ||G_m||^2
        elif target == "accumulated":
            M = torch.zeros(basis.Q_g.shape[1], basis.Q_a.shape[1], dtype=sdt, device=X.device) if M_S is None \
                else M_S
            t_sq = zero if S is None else s_sq
        else:
            after = gw.clone() if S is None else S + gw  # S' (becomes S_m below); gw = sum_i c_i V_i
            M = core_of(basis, after)
            t_sq = _sq(after)
        low = basis.Q_g @ M
        gw.addmm_(low, basis.Q_a.T, alpha=-si)
        m_sq = _sq(M)
        m.update(intra_rank=basis.rank.to(f64), intra_fraction=_ratio(m_sq.sqrt(), t_sq.clamp_min(0).sqrt()),
                 intra_reduction_pct=_reduction_pct(t_sq, t_sq - shrink * m_sq))
    if active:
        m["active"] = torch.ones((), dtype=f64, device=X.device)
    gb = new_bias = None
    if has_bias:
        if stats is not None and stats.bias_per_seq is not None:
            per_seq = stats.bias_per_seq.to(sdt)
        else:  # (B, 1, L) @ (B, L, d_out): masked per-sequence sums, float32-accumulated for half G
            per_seq = matmul_f32(mask.to(G.dtype).unsqueeze(1), G).squeeze(1).to(sdt)
        bias_running = None if running_bias is None else running_bias.to(sdt)
        if active and s.accumulation:
            gb, _ = dense_accumulation_step(per_seq, A, bias_running, **s.accumulation_knobs())
        else:
            gb = A @ per_seq
        new_bias = gb.clone() if bias_running is None else bias_running + gb
    if not keep_running:
        new_running = new_bias = None
    elif intra and s.intra_target == "accumulated_after":
        new_running = after.addmm_(low, basis.Q_a.T, alpha=-si)
    else:
        new_running = gw.clone() if S is None else S + gw
    metrics = torch.stack([m[name] for name in METRIC_NAMES]).to(torch.float32)
    return PROMAStep(gw, gb, new_running, new_bias, metrics)


def proma_extra_macs(
    s: PROMASettings,
    B: int,
    L: int,
    d_in: int,
    d_out: int,
    *,
    chained: bool = True,
    bias: bool = False,
    gemm_only: bool = False,
    macs_per_float: int = MAT_MACS_PER_FLOAT,
    stat_cost: float = 1.0,
    input_shared: bool = False,
) -> float:
    """Multiply-accumulates of one active `proma_layer_step` call beyond autograd's weight-gradient GEMM (and its
    bias sum), for the "accumulation" or the "intra" mode (default intra target); B sequences of padded length L.

    accumulation (`chained`: S_{m-1} exists; else the call is a plain re-weighted GEMM): the kernel K by ISOPO's
    `route_costs` (ntk) on `accumulation_route`'s pick, the overlaps <V_i, S> ("mat": one product over the chunks of V
    in the statistics' loop; "gram": one weight-gradient GEMM), the B x B fit.
    intra: `intra.intra_macs` (range finders, their QRs, the core and the rank-k update). bias: the per-sequence
    sums (B, 1, L) @ (B, L, d_out) and their weighting (with accumulation, its B x d_out fit).
    `gemm_only`: only the matrix products (what a MAC counter over mm / bmm / addmm / mv / dot sees; tests), else
    also the passes over V (accumulation) or over X and D (intra's range finders) at `macs_per_float` per float
    streamed, and the QRs. `stat_cost`: as in `costs.route_costs`. `input_shared`: intra, a layer reading the input
    of an earlier one (q/k/v after the first, up after gate): its input range finder is shared (`intra_macs`).
    """
    if s.mode not in ("accumulation", "intra") or s.intra_target != "microbatch":
        raise ValueError("proma_extra_macs prices mode 'accumulation' or 'intra' (intra_target 'microbatch')")
    small = 0.0  # B x B and B-vector products of the fit: w Kh w, A K A (mv + dot each), w . b
    if s.mode == "accumulation":
        small = 2 * B * B + 3 * B + (s.sweeps * B * B if s.solver == "gram_schmidt" else 0)
    macs = 0.0
    if s.mode == "intra":
        gemm, other = intra_macs(B * L, d_in, d_out, s.intra_dim, s.intra_power_iters, macs_per_float, input_shared)
        macs = stat_cost * (gemm + (0 if gemm_only else other))
    elif chained:
        route = accumulation_route(s, B, L, d_in, d_out, stat_cost)  # the route that runs, whatever this call prices
        if gemm_only:
            macs = gemm_macs(B, L, d_in, d_out, 0, False, True, s.budget_bytes, route, euclidean=True, bias=False)
        else:
            cost = route_costs(B, L, d_in, d_out, 0, False, True, s.budget_bytes, macs_per_float=macs_per_float,
                               stat_cost=stat_cost)
            macs = getattr(cost, route)
        if route == "mat":  # <V_i, S> chunk by chunk in the statistics' loop: one product over V's flat rows
            macs += B * d_in * d_out + (0 if gemm_only else macs_per_float * B * d_in * d_out)
        else:
            macs += stat_cost * B * L * d_in * d_out  # X S^T or G S
        macs += small
    if bias:
        macs += B * L * d_out + B * d_out  # per-sequence sums, then their weighted sum
        if s.mode == "accumulation" and chained:
            macs += B * B * d_out + B * d_out + small  # the bias's own fit: U U^T, U S_b
    return float(macs)
