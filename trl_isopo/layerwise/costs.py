"""Cost model of the two statistics routes: which one "auto" picks for a layer, and what benchmarks and tests count.

Both routes (`statistics.py`) compute the same per-sequence statistics; their work differs with the layer's shape:
"gram" ~ tokens^2 (d_in + d_out), "mat" ~ B d_in d_out per statistic plus the memory traffic of materializing V.
Costs are multiply-accumulates beyond the plain backward's one weight-gradient GEMM. The chunking helpers here decide
how the routes split their work under the byte budget, so that the model prices exactly what the routes run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .precision import HALF_DTYPES, keeps_half_operands

ROUTES = ("auto", "gram", "mat")
DEFAULT_BUDGET_BYTES = 256 * 2**20
# The materialized route is memory-bound: V (B, d_out, d_in) is written once and read twice (norms, final sum). Each
# float streamed is charged this many multiply-accumulates (about peak MAC rate / float bandwidth of one CPU core;
# larger on GPUs). The value is the one with which "auto" picked the faster route on the benchmark's layers
# (docs/isopo.md, "Cost").
MAT_MACS_PER_FLOAT = 16
MAT_PASSES_OVER_V = 3
# Symmetric Gram blocks are computed as row blocks [t0, t0 + TRI_ROWS) against columns [t0, L): about half of the
# full products once L spans several blocks, while each block GEMM stays large enough to run at full speed.
TRI_ROWS = 64
# GEMMs against the Fisher sample run far slower on CPU for sample sizes that are not a multiple of 8 (timings in
# docs/isopo.md, "Cost"), so the sample is zero-padded to one.
SAMPLE_MULTIPLE = 8
# On a device without float32-output half GEMMs (CPU), cost of one MAC of the upcast float32 statistics relative to
# one MAC of the half weight-gradient GEMM that autograd (and ISOPO's final GEMM) runs (about 2 on an AVX512-BF16 CPU
# core; docs/isopo.md, "Cost"). It makes "auto" prefer the route whose float32 work is smallest.
UPCAST_GEMM_COST = 2.0


def statistics_cost(dtype: torch.dtype, device: torch.device, force_half: bool = False) -> float:
    """Price of a statistics MAC relative to a weight-gradient MAC for layer operands of `dtype` on `device`:
    `UPCAST_GEMM_COST` where half operands are upcast for the statistics (`precision.keeps_half_operands`), else 1."""
    return UPCAST_GEMM_COST if dtype in HALF_DTYPES and not keeps_half_operands(dtype, device, force_half) else 1.0


def gathered_rows(n: int) -> int:
    """Rows of the gathered Fisher sample of n tokens: n zero-padded to a multiple of SAMPLE_MULTIPLE."""
    return -(-n // SAMPLE_MULTIPLE) * SAMPLE_MULTIPLE


@dataclass(frozen=True)
class RouteCost:
    """Extra multiply-accumulates over the plain backward (which already does one weight-gradient GEMM)."""

    gram: float
    mat: float

    @property
    def best(self) -> str:
        return "gram" if self.gram < self.mat else "mat"


@functools.lru_cache(maxsize=4096)  # called per layer and micro-batch with a few distinct shapes: pure Python
def route_costs(
    B: int,
    L: int,
    d_in: int,
    d_out: int,
    S: int,
    fisher: bool,
    ntk: bool,
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    *,
    euclidean: bool = True,
    macs_per_float: int = MAT_MACS_PER_FLOAT,
    stat_cost: float = 1.0,
    input_shared: bool = False,
) -> RouteCost:
    """Analytic extra MACs of each route for one layer and micro-batch (padded layout, B rows of length L).

    gram: e^2 (if `euclidean`) from diagonal L x L blocks, computed as upper-triangular row blocks (about half of
    B L^2 (d_in + d_out)), unless K is formed (then e^2 = diag K); Fisher numerator B L S (d_in + d_out); K about
    (B L)^2 (d_in + d_out) / 2.
    mat: V costs what the replaced weight-gradient GEMM costs (0 extra); the final sum B d_in d_out if V fits the
    budget, else one more weight-gradient GEMM B L d_in d_out; e^2 B d_in d_out (free as diag K); Fisher
    B S d_in d_out; K B^2 d_in d_out; plus `macs_per_float` per float of V streamed (0: arithmetic only, where every
    term but the e^2 reduction over V is a GEMM; a test counts them against the GEMMs `sequence_statistics` runs).
    input_shared: the input side of "gram" (the Fisher numerator's products X a_J^T and the e^2 blocks X_i X_i^T)
    was made by an earlier layer reading the same input (`statistics.gram_input_statistics`): "gram" pays only the
    output side of those terms (d_out for d_in + d_out); K's are not shared.
    stat_cost: price of a statistics MAC (V's included) relative to a weight-gradient MAC (`statistics_cost`).
    Above 1, V no longer costs what the replaced GEMM costs, and without a kept V the final gradient is the half
    GEMM that replaces autograd's (0 extra).
    """
    dd = d_in + d_out
    side = d_out if input_shared else dd
    gram = B * L * S * side if fisher else 0.0
    if ntk:
        gram += tri_work(B * L, min(TRI_ROWS, B * L)) * dd
    elif euclidean:
        gram += B * tri_work(L, min(TRI_ROWS, L)) * side
    # V is kept for the final sum only if it fits the budget (float32); else the final gradient is one more GEMM.
    fits = v_rows_per_chunk(B, d_in, d_out, S if fisher else 0, 4, budget_bytes) >= d_out
    passes = MAT_PASSES_OVER_V - (not (euclidean or ntk)) - (not fits)  # write; e^2 or K read; final-sum read
    wgrad = B * L * d_in * d_out  # one weight-gradient GEMM
    mat = (euclidean and not ntk) * B * d_in * d_out  # with K, e^2 = diag K
    mat += B * S * d_in * d_out if fisher else 0.0
    mat += B * B * d_in * d_out if ntk else 0.0
    # A kept V replaces autograd's GEMM (the part of its price above a weight-gradient MAC is extra) and the final
    # gradient is its sum; else V is extra and the final gradient one more GEMM (stat_cost = 1) or the half GEMM
    # replacing autograd's (stat_cost > 1): both priced as one stat_cost-priced wgrad here.
    mat += (1 - 1 / stat_cost) * wgrad + B * d_in * d_out if fits else wgrad
    mat = stat_cost * mat + passes * macs_per_float * B * d_in * d_out
    return RouteCost(gram=float(stat_cost * gram), mat=float(mat))


def input_group_costs(
    shapes: list[tuple[int, int]], B: int, L: int, S: int, fisher: bool, ntk: bool,
    budget_bytes: int = DEFAULT_BUDGET_BYTES, *, euclidean: bool = True, stat_cost: float = 1.0, route: str = "auto",
    item: int = 4,
) -> list[tuple[RouteCost, str, bool]]:
    """(cost, route taken, input_shared) of each covered layer reading one input, `shapes` (d_in, d_out) in backward
    order: the layers after the first one on "gram" find its input side made, when it is kept (`gram_input_kept`,
    statistics of `item` bytes), and "auto" prices them without (`route_costs`)."""
    out, made = [], False
    one_block = gram_input_kept(B, L, S, fisher, euclidean and not ntk, item, budget_bytes)
    for d_in, d_out in shapes:
        cost = route_costs(B, L, d_in, d_out, S, fisher, ntk, budget_bytes, euclidean=euclidean, stat_cost=stat_cost,
                           input_shared=made)
        taken = cost.best if route == "auto" else route
        out.append((cost, taken, made))
        made = made or (one_block and taken == "gram")
    return out


def gemm_macs(
    B: int, L: int, d_in: int, d_out: int, S: int, fisher: bool, ntk: bool, budget_bytes: int, route: str, *,
    euclidean: bool, bias: bool, input_shared: bool = False,
) -> float:
    """The MACs one `layer_grads` call runs as matrix products (mm / bmm, what torch's FlopCounterMode counts) beyond
    autograd's weight-gradient GEMM: `route_costs`' arithmetic without its e^2 reduction over V ("mat"), plus with
    a bias the per-sequence sums (B, 1, L) @ (B, L, d_out) and their weighted sum. S: the sample as gathered
    (zero-padded to a multiple of SAMPLE_MULTIPLE). input_shared: as in `route_costs`."""
    cost = route_costs(B, L, d_in, d_out, S, fisher, ntk, budget_bytes, euclidean=euclidean, macs_per_float=0,
                       input_shared=input_shared)
    macs = getattr(cost, route)
    if route == "mat" and euclidean and not ntk:
        macs -= B * d_in * d_out
    return macs + (B * (L + 1) * d_out if bias else 0)

def tri_work(n: int, step: int) -> int:
    """Entries of an n x n symmetric Gram that row blocks [t0, t0 + step) x [t0, n) compute: n (n + step) / 2 if
    step divides n."""
    return sum(min(step, n - t0) * (n - t0) for t0 in range(0, n, step))



def rows_per_chunk(row_bytes: int, budget_bytes: int, total: int) -> int:
    return max(1, min(total, budget_bytes // max(row_bytes, 1)))


def fisher_rows_per_chunk(B: int, L: int, S: int, item: int, budget_bytes: int) -> int:
    """Positions t per block of the "gram" route's Fisher numerator: each holds (B, c, S) input and output products
    (S: the gathered sample's rows)."""
    return rows_per_chunk(2 * B * S * item, budget_bytes, L)


def euclid_rows_per_chunk(B: int, L: int, item: int, budget_bytes: int) -> int:
    """Rows t per block of the "gram" route's e^2: (B, c, L - t0) input and output products against columns t0..L."""
    return min(TRI_ROWS, rows_per_chunk(2 * B * L * item, budget_bytes, L))


def gram_input_kept(B: int, L: int, S: int, fisher: bool, euclidean: bool, item: int, budget_bytes: int) -> bool:
    """Whether the "gram" route's input side (`statistics.gram_input_statistics`) is kept for the other layers reading
    the input: there is one (Fisher numerator, or e^2 without K), the Fisher products fit one block
    (`fisher_rows_per_chunk`) and the e^2 blocks, B tri(L) floats, half the budget."""
    if fisher and fisher_rows_per_chunk(B, L, gathered_rows(S), item, budget_bytes) < L:
        return False
    if euclidean:
        return B * tri_work(L, euclid_rows_per_chunk(B, L, item, budget_bytes)) * item <= budget_bytes // 2
    return fisher


def v_rows_per_chunk(B: int, d_in: int, d_out: int, S: int, item: int, budget_bytes: int) -> int:
    """Output rows of V per "mat" chunk: each row costs (B, d_in) of V plus (B, S) of V a_J. V is kept for the final
    gradient iff this is d_out (one chunk); `route_costs` prices the same decision."""
    return rows_per_chunk(B * (d_in + S) * item, budget_bytes, d_out)

