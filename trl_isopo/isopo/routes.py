"""Per-sequence gradient statistics of one linear layer, without per-sequence backward passes.

For y = x W^T (+ b) and one micro-batch in padded layout, X: (B, L, d_in) layer inputs and G: (B, L, d_out) output
gradients of the advantage-free surrogate. At every invalid (padding) position one of the two rows is zero and the
other finite, so only one operand needs a masked copy (the caller masks the narrower one); every product below then
drops padding exactly, as autograd's own weight gradient G^T X does. Sequence i's weight gradient is V_i = G_i^T X_i.
Every quantity ISOPO needs follows from exact identities (`isopo-spec.md` §3.2):

- e_i^2 = ||V_i||^2 = sum_{t,t' in i} (g_t . g_t')(a_t . a_t')                      (diagonal Gram blocks)
- u_i[j] = g_j^T V_i a_j = sum_{t in i} (g_j . g_t)(a_j . a_t)   for j in the Fisher sample J
- K_ik = <V_i, V_k> = sum_{t in i, t' in k} (g_t . g_t')(a_t . a_t')             (NTK, interacting variant)

Two routes compute them:

- "gram": token Gram matrices (cost ~ tokens^2 (d_in + d_out)), never forms V_i;
- "mat": materializes V (B, d_out, d_in) in d_out chunks (cost ~ B d_in d_out per statistic); V then also gives the
  final gradient sum_i w_i V_i, replacing autograd's weight-gradient GEMM.

Both are chunked so that no intermediate exceeds `budget_bytes`; they agree to float rounding (tests compare them
with each other and with brute-force per-sequence autograd).

Dtypes: X and G are float64, float32, or both bf16 / fp16 (the layer's own dtype). Every statistic and V is a
float32 sum of exact products (float64 for float64 operands, `stat_dtype`): half operands enter the GEMMs as they are
where the device returns their products in float32 (`half_gemm_kernel`: CUDA, XPU), else (CPU) they are upcast once
per layer for the statistics (`statistics_operands`). The final weight gradient of half operands is one half GEMM
(`_half_reweighted_gemm`): float32-accumulated, and on a device without float32 outputs rounded once to the half
dtype, which is the precision of the weight gradient autograd itself computes for a half layer.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

ROUTES = ("auto", "gram", "mat")
DEFAULT_BUDGET_BYTES = 256 * 2**20
# The materialized route is memory-bound: V (B, d_out, d_in) is written once and read twice (norms, final sum). Each
# float streamed is charged this many multiply-accumulates (about peak MAC rate / float bandwidth of one CPU core;
# larger on GPUs). With 16, "auto" measured best-or-tied on 896/4864-wide layers at 8 x 256 tokens (docs/isopo.md).
MAT_MACS_PER_FLOAT = 16
MAT_PASSES_OVER_V = 3
# Symmetric Gram blocks are computed as row blocks [t0, t0 + TRI_ROWS) against columns [t0, L): about half of the
# full products once L spans several blocks, while each block GEMM stays large enough to run at full speed.
TRI_ROWS = 64
# GEMMs against the Fisher sample run far slower for sample sizes that are not a multiple of 8 (CPU, measured:
# (2048 x 4864) @ (4864 x S) takes 123 ms at S = 250 and 88 ms at S = 256), so the sample is zero-padded to one.
SAMPLE_MULTIPLE = 8
ROW_GRAM_BLOCK = 8192  # columns per block of the V V^T sum (`_row_gram`)
HALF_DTYPES = (torch.float16, torch.bfloat16)
# Test hook: keep bf16 / fp16 operands even where the device has no half GEMM with float32 outputs (CPU); every
# product then upcasts its operands (`matmul_f32`) and the final GEMM returns float32, as on CUDA. Off, such operands
# are upcast once per layer for the statistics and the final GEMM is a half one (`_half_reweighted_gemm`).
KEEP_HALF_OPERANDS = False
# On a device without float32-output half GEMMs (CPU), cost of one MAC of the upcast float32 statistics relative to
# one MAC of the half weight-gradient GEMM that autograd (and ISOPO's final GEMM) runs. Measured with torch 2.13 on
# an AVX512-BF16 CPU core: (4864 x 2048) @ (2048 x 896) 203 ms float32 vs 94 ms bf16; the batched per-sequence
# (8, 4864, 256) @ (8, 256, 896) 314 vs 118 ms. It makes "auto" prefer the route whose float32 work is smallest.
UPCAST_GEMM_COST = 2.0


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the statistics, coefficients and GEMM accumulations for operands of `dtype`: float64 for float64,
    float32 for everything else (float32, bf16, fp16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=None)
def half_gemm_kernel(device_type: str, dtype: torch.dtype) -> bool:
    """Whether `torch.mm` / `torch.bmm` accept `out_dtype=torch.float32` for `dtype` operands on this device type:
    bf16 / fp16 products accumulated and returned in float32 by the GEMM itself (CUDA and XPU kernels since torch
    2.8; torch 2.13 has none on CPU). Probed once per (device type, dtype)."""
    try:
        a = torch.ones(1, 1, dtype=dtype, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
        torch.bmm(a[None], a[None], out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # NotImplementedError is a RuntimeError
        return False
    return True


def keeps_half_operands(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether half X and G of `dtype` enter the statistics' GEMMs as they are: where the device multiplies them
    into float32 (`half_gemm_kernel`; ~15x the float32 GEMM rate on recent GPUs). Otherwise (CPU) they are upcast
    once per layer; the upcast is exact (every bf16 / fp16 value is a float32 value), so both give float32-accumulated
    products of the same operands."""
    return dtype in HALF_DTYPES and (KEEP_HALF_OPERANDS or half_gemm_kernel(device.type, dtype))


def statistics_cost(dtype: torch.dtype, device: torch.device) -> float:
    """Price of a statistics MAC relative to a weight-gradient MAC for layer operands of `dtype` on `device`:
    `UPCAST_GEMM_COST` where half operands are upcast for the statistics, else 1."""
    return UPCAST_GEMM_COST if dtype in HALF_DTYPES and not keeps_half_operands(dtype, device) else 1.0


def statistics_operands(X: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(X, G, `statistics_cost`): half operands are upcast to float32 where the device has no float32-output half
    GEMM, everything else is returned as it is."""
    cost = statistics_cost(X.dtype, X.device)
    return (X.float(), G.float(), cost) if cost != 1.0 else (X, G, cost)


def matmul_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b for (m, k) @ (k, n), (B, m, k) @ (B, k, n) or (B, m, k) @ (k, n), optionally into `out`.

    bf16 / fp16 operands (both of one dtype) give a float32 result accumulated in float32: the device's
    `out_dtype=torch.float32` GEMM, else (CPU) the float32 GEMM of the exactly upcast operands. Not a half GEMM
    followed by `.float()`: that rounds every product sum to ~3 significant digits. Other dtypes: plain `a @ b`.
    """
    if a.dtype not in HALF_DTYPES:
        if a.dim() == 3 and b.dim() == 3:
            return torch.bmm(a, b, out=out)
        return a @ b if out is None else torch.mm(a, b, out=out)
    if a.dim() == 3 and b.dim() == 2:  # fold the batch into the rows, as `matmul` does
        flat = None if out is None else out.view(-1, b.shape[-1])
        return matmul_f32(a.reshape(-1, a.shape[-1]), b, flat).view(*a.shape[:2], b.shape[-1])
    op = torch.bmm if a.dim() == 3 else torch.mm
    kw = {} if out is None else {"out": out}
    if half_gemm_kernel(a.device.type, a.dtype):
        return op(a, b, out_dtype=torch.float32, **kw)
    return op(a.float(), b.float(), **kw)


def _row_norms(T: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """Euclidean norms of the rows of T (n, d) -> (n,) computed and returned in `dt`."""
    return torch.linalg.vector_norm(T, dim=1) if T.dtype == dt else torch.linalg.vector_norm(T, dim=1, dtype=dt)


def gathered_rows(n: int) -> int:
    """Rows of the gathered Fisher sample of n tokens: n zero-padded to a multiple of SAMPLE_MULTIPLE."""
    return -(-n // SAMPLE_MULTIPLE) * SAMPLE_MULTIPLE


@dataclass
class SequenceStats:
    """Statistics of one layer and micro-batch, all in `stat_dtype` of the operands. Shapes: e2 (B,) or None,
    fisher_num (B,) or None, fisher_den scalar or None, ntk (B, B) or None; `V` (B, d_out, d_in) is kept only by the
    "mat" route when it fits the budget (a transposed view of a (B, d_in, d_out) tensor when the Fisher contraction
    wanted that layout)."""

    e2: torch.Tensor | None
    fisher_num: torch.Tensor | None
    fisher_den: torch.Tensor | None
    ntk: torch.Tensor | None
    route: str
    V: torch.Tensor | None = None
    bias_per_seq: torch.Tensor | None = None


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
) -> RouteCost:
    """Analytic extra MACs of each route for one layer and micro-batch (padded layout, B rows of length L).

    gram: e^2 (if `euclidean`) from diagonal L x L blocks, computed as upper-triangular row blocks (about half of
    B L^2 (d_in + d_out)), unless K is formed (then e^2 = diag K); Fisher numerator B L S (d_in + d_out); K about
    (B L)^2 (d_in + d_out) / 2.
    mat: V costs what the replaced weight-gradient GEMM costs (0 extra); the final sum B d_in d_out if V fits the
    budget, else one more weight-gradient GEMM B L d_in d_out; e^2 B d_in d_out (free as diag K); Fisher
    B S d_in d_out; K B^2 d_in d_out; plus `macs_per_float` per float of V streamed (0: arithmetic only, where every
    term but the e^2 reduction over V is a GEMM; a test counts them against the GEMMs `sequence_statistics` runs).
    stat_cost: price of a statistics MAC (V's included) relative to a weight-gradient MAC (`statistics_operands`).
    Above 1, V no longer costs what the replaced GEMM costs, and without a kept V the final gradient is the half
    GEMM that replaces autograd's (0 extra).
    """
    dd = d_in + d_out
    gram = B * L * S * dd if fisher else 0.0
    if ntk:
        gram += _tri_work(B * L, min(TRI_ROWS, B * L)) * dd
    elif euclidean:
        gram += B * _tri_work(L, min(TRI_ROWS, L)) * dd
    # V is kept for the final sum only if it fits the budget (float32); else the final gradient is one more GEMM.
    fits = _v_rows_per_chunk(B, d_in, d_out, S if fisher else 0, 4, budget_bytes) >= d_out
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


def gemm_macs(
    B: int, L: int, d_in: int, d_out: int, S: int, fisher: bool, ntk: bool, budget_bytes: int, route: str, *,
    euclidean: bool, bias: bool,
) -> float:
    """The MACs one `layer_grads` call runs as matrix products (mm / bmm, what torch's FlopCounterMode counts) beyond
    autograd's weight-gradient GEMM: `route_costs`' arithmetic without its e^2 reduction over V ("mat"), plus with
    a bias the per-sequence sums (B, 1, L) @ (B, L, d_out) and their weighted sum. S: the sample as gathered
    (zero-padded to a multiple of SAMPLE_MULTIPLE)."""
    cost = route_costs(B, L, d_in, d_out, S, fisher, ntk, budget_bytes, euclidean=euclidean, macs_per_float=0)
    macs = getattr(cost, route)
    if route == "mat" and euclidean and not ntk:
        macs -= B * d_in * d_out
    return macs + (B * (L + 1) * d_out if bias else 0)


class Scratch:
    """Reusable storage for the large per-layer temporaries (materialized V, Fisher sample rows) of one backward pass.

    Every layer of a model asks for buffers of the same few shapes. On CPU each fresh allocation above glibc's mmap
    threshold comes from new pages, and faulting them in costs about as much as the GEMM that fills them (measured:
    a batched (8, 4864, 256) x (8, 256, 896) product, 301 ms fresh vs 224 ms into reused storage), so layers share one
    buffer per slot. The owner drops it (`clear`) when the backward pass ends.
    """

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._buffers.get(slot)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._buffers[slot] = buf
        return buf[:n].view(shape)

    def clear(self) -> None:
        self._buffers.clear()


def sequence_statistics(
    X: torch.Tensor,
    G: torch.Tensor,
    sample: torch.Tensor | None,
    fisher: bool,
    ntk: bool,
    route: str = "auto",
    budget_bytes: int = DEFAULT_BUDGET_BYTES,
    bias: bool = False,
    mask: torch.Tensor | None = None,
    scratch: Scratch | None = None,
    *,
    euclidean: bool = True,
) -> SequenceStats:
    """Per-sequence statistics of the layer gradient.

    Args:
        X: (B, L, d_in) inputs.
        G: (B, L, d_out) output gradients, same dtype as X; at each invalid position the row of X or of G is zero
            (see above).
        sample: (S,) flat indices into B*L of the Fisher token sample J; needed if `fisher`. It may hold padding
            positions (a fixed-size sample, `linear.fisher_token_sample`): their zero row adds exactly 0 to the
            numerator and the denominator.
        fisher: compute the Fisher numerator sum_j u_i[j]^2 and denominator ||(|g_j||a_j|)_j||.
        ntk: compute K (B, B).
        route: "gram", "mat" or "auto" (cheapest by `route_costs`).
        budget_bytes: bound on any chunked intermediate (Gram row blocks, V chunks).
        bias: also return the per-sequence bias gradients sum_t g_t, (B, d_out).
        mask: (B, L) valid positions, for the bias sums when G is not the masked operand.
        scratch: reusable storage for the large temporaries: materialized V, Fisher sample rows (fresh if None).
        euclidean: compute e^2 (free with K; on "gram" without K it costs about 0.6x the Fisher numerator).

    Returns:
        `SequenceStats` in `stat_dtype(X.dtype)`; e2 is None if neither `euclidean` nor `ntk`.
    """
    X, G, stat_cost = statistics_operands(X, G)
    B, L, d_in = X.shape
    sdt = stat_dtype(X.dtype)
    d_out = G.shape[-1]
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    if fisher and sample is None:
        raise ValueError("the Fisher estimate needs a token sample")
    S = int(sample.numel()) if fisher else 0
    if route == "auto":
        route = route_costs(B, L, d_in, d_out, S, fisher, ntk, budget_bytes, euclidean=euclidean, stat_cost=stat_cost).best

    num = den = None
    if fisher:
        XJ, GJ = (_gather_rows(T, sample, scratch, slot) for T, slot in ((X, "XJ"), (G, "GJ")))
        # No absolute "+ 1e-12" (the reference's): |g_j| carries the loss normalization; 0 is handled by fisher_norm.
        den = torch.linalg.vector_norm(_row_norms(GJ[:S], sdt) * _row_norms(XJ[:S], sdt))
        if route == "mat" and XJ.dtype != sdt:  # "mat" contracts them with V (float32): the small factors upcast
            XJ, GJ = XJ.to(sdt), GJ.to(sdt)

    if route == "gram":
        stats = _gram(X, G, XJ if fisher else None, GJ if fisher else None, ntk, budget_bytes, euclidean)
    else:
        stats = _mat(X, G, XJ if fisher else None, GJ if fisher else None, ntk, budget_bytes, scratch, euclidean)
    e2, u, K, V = stats
    if fisher:
        num = (u * u).sum(1)
    bias_per_seq = None
    if bias:  # (B, 1, L) @ (B, L, d_out): masked sums over positions without a masked copy of G
        if mask is None:
            bias_per_seq = G.sum(1) if G.dtype == sdt else G.sum(1, dtype=sdt)
        else:
            bias_per_seq = matmul_f32(mask.to(G.dtype).unsqueeze(1), G).squeeze(1)
    return SequenceStats(e2=e2, fisher_num=num, fisher_den=den, ntk=K, route=route, V=V, bias_per_seq=bias_per_seq)


def _gather_rows(T: torch.Tensor, index: torch.Tensor, scratch: Scratch | None, slot: str) -> torch.Tensor:
    """Rows `index` of T (B, L, d) flattened to (B*L, d), zero-padded to a multiple of SAMPLE_MULTIPLE rows (zero
    rows give u[:, j] = 0, leaving the numerator exact). `index_select` into the padded buffer: advanced indexing
    plus `cat` measured 10x slower on CPU (2.3 + 3.4 ms vs 0.25 ms for 250 rows of 4864)."""
    n, d = index.numel(), T.shape[-1]
    rows = gathered_rows(n)
    out = T.new_empty(rows, d) if scratch is None else scratch.get(slot, (rows, d), T.dtype, T.device)
    if rows > n:
        out[n:].zero_()
    torch.index_select(T.reshape(-1, d), 0, index, out=out[:n])
    return out


def _tri_work(n: int, step: int) -> int:
    """Entries of an n x n symmetric Gram that row blocks [t0, t0 + step) x [t0, n) compute: n (n + step) / 2 if
    step divides n."""
    return sum(min(step, n - t0) * (n - t0) for t0 in range(0, n, step))


def _row_gram(Vf: torch.Tensor) -> torch.Tensor:
    """Vf Vf^T for Vf (B, n) with n up to d_in * d_out, as a sum of (B, ROW_GRAM_BLOCK) block products.

    One GEMM with an inner dimension of millions accumulates each entry in one long float32 sum: measured relative
    error 5e-4 at n = 4.4M (896 x 4864, random V), and 3x the time of the blocked form on CPU (blocks of 8192:
    7.5e-8 and 27 ms, of 65536: 9.4e-7 and 28-32 ms; a pass that only reads V, its norms, takes 13 ms).
    """
    B, n = Vf.shape
    m = n // ROW_GRAM_BLOCK
    K = torch.zeros(B, B, dtype=Vf.dtype, device=Vf.device)
    if m > 0:
        blocks = Vf[:, : m * ROW_GRAM_BLOCK].reshape(B, m, ROW_GRAM_BLOCK).transpose(0, 1)  # (m, B, block) view
        K += torch.bmm(blocks, blocks.transpose(1, 2)).sum(0)
    if m * ROW_GRAM_BLOCK < n:
        rest = Vf[:, m * ROW_GRAM_BLOCK :]
        K += rest @ rest.T
    return K


def _rows_per_chunk(row_bytes: int, budget_bytes: int, total: int) -> int:
    return max(1, min(total, budget_bytes // max(row_bytes, 1)))


def _v_rows_per_chunk(B: int, d_in: int, d_out: int, S: int, item: int, budget_bytes: int) -> int:
    """Output rows of V per "mat" chunk: each row costs (B, d_in) of V plus (B, S) of V a_J. V is kept for the final
    gradient iff this is d_out (one chunk); `route_costs` prices the same decision."""
    return _rows_per_chunk(B * (d_in + S) * item, budget_bytes, d_out)


def _gram(X, G, XJ, GJ, ntk, budget, euclidean=True):
    B, L, _ = X.shape
    sdt = stat_dtype(X.dtype)  # products and sums (float32 for half operands)
    item = torch.finfo(sdt).bits // 8
    u = None
    if XJ is not None:
        # u[i, j] = sum_{t in i} (a_t . a_j)(g_t . g_j): (B, c, S) blocks over positions t.
        S = XJ.shape[0]
        u = torch.zeros(B, S, dtype=sdt, device=X.device)
        step = _rows_per_chunk(2 * B * S * item, budget, L)
        for t0 in range(0, L, step):
            Ga = matmul_f32(X[:, t0 : t0 + step], XJ.T)
            Gg = matmul_f32(G[:, t0 : t0 + step], GJ.T)
            u += (Ga * Gg).sum(1)
    if ntk:
        # K = P (Ga o Gg) P^T over all B*L positions; row blocks of the flat token axis, upper triangle only.
        N = B * L
        Xf, Gf = X.reshape(N, -1), G.reshape(N, -1)
        seq = torch.arange(B, device=X.device).repeat_interleave(L)
        K = torch.zeros(B, B, dtype=sdt, device=X.device)
        step = min(TRI_ROWS, _rows_per_chunk(2 * N * item, budget, N))
        for r0 in range(0, N, step):
            r1 = min(N, r0 + step)
            M = matmul_f32(Xf[r0:r1], Xf[r0:].T) * matmul_f32(Gf[r0:r1], Gf[r0:].T)  # (c, N - r0)
            M[:, r1 - r0 :] *= 2  # strictly-upper blocks stand for their transposes too
            rows = torch.zeros(r1 - r0, B, dtype=M.dtype, device=M.device)
            rows.index_add_(1, seq[r0:], M)  # (c, B): segment sums over t'
            K.index_add_(0, seq[r0:r1], rows)
        K = 0.5 * (K + K.T)  # fold the doubled upper triangle into a symmetric K
        return torch.diagonal(K).clone(), u, K, None
    if not euclidean:
        return None, u, None, None
    # e_i^2 from the diagonal blocks, upper triangle of each L x L block.
    e2 = torch.zeros(B, dtype=sdt, device=X.device)
    step = min(TRI_ROWS, _rows_per_chunk(2 * B * L * item, budget, L))
    for t0 in range(0, L, step):
        t1 = min(L, t0 + step)
        M = matmul_f32(X[:, t0:t1], X[:, t0:].transpose(1, 2)) * matmul_f32(G[:, t0:t1], G[:, t0:].transpose(1, 2))
        e2 += M[:, :, : t1 - t0].sum((1, 2)) + 2 * M[:, :, t1 - t0 :].sum((1, 2))
    return e2, u, None, None


def _mat(X, G, XJ, GJ, ntk, budget, scratch=None, euclidean=True):
    """XJ, GJ: the gathered sample rows in `stat_dtype(X.dtype)` (V's dtype)."""
    B, L, d_in = X.shape
    d_out = G.shape[-1]
    sdt = stat_dtype(X.dtype)  # V (float32 for half operands: it feeds the norms and the final sum)
    item = torch.finfo(sdt).bits // 8
    # Per d_out row: the V chunk (B, c, d_in) and, for the Fisher numerator, Y = V a_J (B, c, S).
    S = XJ.shape[0] if XJ is not None else 0
    step = _v_rows_per_chunk(B, d_in, d_out, S, item, budget)
    # u[i, j] = sum_o g_j[o] (V_i a_j)[o] contracts the longer of (c, d_in) in one 2-D GEMM: with c > d_in, V is
    # stored transposed, V^T (B, d_in, c), so that (B d_in, c) @ (c, S) reads it in place (the (B, c, d_in) layout
    # needed a transposed copy of V per chunk; a broadcast (S, c) @ (B, c, d_in) ran 1.2-1.4x slower).
    transposed = XJ is not None and min(step, d_out) > d_in
    XJt = XJ.T.contiguous() if transposed else None  # (d_in, S)
    e2, u, K = [], [], []  # per-chunk terms, summed at the end (one chunk in the common case: no zero-init + add)
    V = None
    for o0 in range(0, d_out, step):
        o1 = min(d_out, o0 + step)
        if transposed:
            out = None if scratch is None else scratch.get("V", (B, d_in, o1 - o0), sdt, X.device)
            Vt = matmul_f32(X.transpose(1, 2), G[:, :, o0:o1], out=out)  # (B, d_in, c)
            V, Vf = Vt.transpose(1, 2), Vt.view(B, -1)  # V: a (B, c, d_in) view
        else:
            out = None if scratch is None else scratch.get("V", (B, o1 - o0, d_in), sdt, X.device)
            V = matmul_f32(G[:, :, o0:o1].transpose(1, 2), X, out=out)  # (B, c, d_in)
            Vf = V.view(B, -1)
        if ntk:  # with K, e^2 = diag K (no extra pass over V)
            K.append(_row_gram(Vf))
        elif euclidean:
            e2.append(torch.linalg.vector_norm(Vf, dim=1).square_())  # a reduction, no (B, c, d_in) temporary
        if XJ is not None:
            # The small factor is made contiguous first: a broadcast product with a transposed view ran 2-3x slower.
            if transposed:
                Zt = Vf.view(B * d_in, o1 - o0) @ GJ[:, o0:o1].T  # (B d_in, S): sum_o V_i[o, :] g_j[o]
                u.append((Zt.view(B, d_in, -1) * XJt).sum(1))
            else:
                u.append(((V @ XJ.T) * GJ[:, o0:o1].T.contiguous()).sum(1))
    u = _total(u) if XJ is not None else None
    V = V if step >= d_out else None  # kept for the final gradient only when it is the whole V (one chunk)
    if ntk:
        K = _total(K)
        return torch.diagonal(K).clone(), u, K, V
    return (_total(e2) if euclidean else None), u, None, V


def _total(terms: list[torch.Tensor]) -> torch.Tensor:
    return terms[0] if len(terms) == 1 else torch.stack(terms).sum(0)


def reweighted_weight_grad(
    X: torch.Tensor, G: torch.Tensor, w: torch.Tensor, stats: SequenceStats | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_i w_i V_i, sum_i w_i b_i): the layer's weight and bias gradients, shapes (d_out, d_in), (d_out,) or None,
    in `stat_dtype(X.dtype)`. w: (B,).

    Uses the materialized V when the "mat" route kept it (B d_in d_out MACs), else one GEMM of the row-scaled output
    gradients, (w_seq(t) g_t)^T a_t, in place of autograd's weight-gradient GEMM. Without `stats` the bias gradient
    is summed over all positions (G must then be the masked operand).
    """
    sdt = stat_dtype(X.dtype)
    w = w.to(sdt)
    if stats is not None and stats.V is not None:
        B, d_out, d_in = stats.V.shape
        if stats.V.is_contiguous():
            gw = (w @ stats.V.view(B, -1)).view(d_out, d_in)  # one pass over V
        else:  # V stored transposed (`_mat`): the (d_in, d_out) sum, then one d_out x d_in copy (1/B of V)
            gw = (w @ stats.V.transpose(1, 2).reshape(B, -1)).view(d_in, d_out).T.contiguous()
    elif X.dtype == torch.bfloat16 or keeps_half_operands(X.dtype, X.device):
        gw = _half_reweighted_gemm(X, G, w)
    else:  # float32 / float64, or fp16 without a float32-output half GEMM (CPU): float32 GEMM of upcast operands
        X, G = X.to(sdt), G.to(sdt)
        if G.shape[-1] <= X.shape[-1]:  # scale the narrower operand's rows: sum_t (w_s(t) g_t) a_t^T
            gw = (G * w.view(-1, 1, 1)).reshape(-1, G.shape[-1]).T @ X.reshape(-1, X.shape[-1])
        else:
            gw = G.reshape(-1, G.shape[-1]).T @ (X * w.view(-1, 1, 1)).reshape(-1, X.shape[-1])
    if stats is not None:  # the bias gradient only when the statistics were asked for it (no extra pass over G)
        gb = None if stats.bias_per_seq is None else w @ stats.bias_per_seq
    else:
        gb = (G.to(sdt) * w.view(-1, 1, 1)).sum((0, 1))
    return gw, gb


def _half_reweighted_gemm(X: torch.Tensor, G: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """sum_t w_s(t) g_t a_t^T (d_out, d_in) float32 for half X (B, L, d_in), G (B, L, d_out) and float32 w (B,).

    The narrower operand's rows are scaled in float32 and rounded once to the half dtype (the GEMM needs one dtype),
    by w / max|w|, multiplied back on the float32 result: fp16 cannot overflow (|scaled row| <= |row|), and the
    sequences with the largest coefficients keep the operand's full precision. The GEMM accumulates in float32; where
    the device has no float32 output for it (CPU) its result is rounded once to the half dtype, as autograd's own
    weight gradient of a half layer is (and as the gradient is anyway when stored in a half parameter's .grad).
    """
    top = w.abs().amax()
    top = torch.where(top > 0, top, 1.0)
    wn = (w / top).view(-1, 1, 1)
    # Without a float32-output half GEMM only bf16 comes here (float32's range: its half output cannot overflow)
    mm = matmul_f32 if keeps_half_operands(X.dtype, X.device) else _half_mm
    if G.shape[-1] <= X.shape[-1]:
        Gs = (G.float() * wn).to(G.dtype)
        gw = mm(Gs.reshape(-1, G.shape[-1]).T, X.reshape(-1, X.shape[-1]))
    else:
        Xs = (X.float() * wn).to(X.dtype)
        gw = mm(G.reshape(-1, G.shape[-1]).T, Xs.reshape(-1, X.shape[-1]))
    return gw.mul_(top)


def _half_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of half operands: float32-accumulated, rounded once to the half dtype, returned in float32."""
    return (a @ b).float()
