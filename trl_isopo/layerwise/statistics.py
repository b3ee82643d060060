"""Per-sequence gradient statistics of one linear layer, without per-sequence backward passes.

For y = x W^T (+ b) and one micro-batch in padded layout, X: (B, L, d_in) layer inputs and G: (B, L, d_out) output
gradients of the advantage-free surrogate. At every invalid (padding) position one of the two rows is zero and the
other finite, so only one operand needs a masked copy (the caller masks the narrower one); every product below then
drops padding exactly, as autograd's own weight gradient G^T X does. Sequence i's weight gradient is V_i = G_i^T X_i.
Every quantity ISOPO needs follows from exact identities (paper arXiv 2512.23353,
§2.0.2 "Efficient implementation" and §3; docs/isopo.md, "Exactness"):

- e_i^2 = ||V_i||^2 = sum_{t,t' in i} (g_t . g_t')(a_t . a_t')                      (diagonal Gram blocks)
- u_i[j] = g_j^T V_i a_j = sum_{t in i} (g_j . g_t)(a_j . a_t)   for j in the Fisher sample J
- K_ik = <V_i, V_k> = sum_{t in i, t' in k} (g_t . g_t')(a_t . a_t')             (NTK, interacting variant)

Two routes compute them (`gram_statistics`, `materialized_statistics`; "auto" picks by `costs.route_costs`):

- "gram": token Gram matrices (cost ~ tokens^2 (d_in + d_out)), never forms V_i;
- "mat": materializes V (B, d_out, d_in) in d_out chunks (cost ~ B d_in d_out per statistic); V then also gives the
  final gradient sum_i w_i V_i (`weight_grad.reweighted_weight_grad`), replacing autograd's weight-gradient GEMM.

Both are chunked so that no intermediate exceeds `budget_bytes`; they agree to float rounding (tests compare them
with each other and with brute-force per-sequence autograd). Dtypes follow `precision.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .costs import DEFAULT_BUDGET_BYTES, ROUTES, TRI_ROWS, gathered_rows, route_costs, rows_per_chunk, statistics_cost
from .costs import euclid_rows_per_chunk, fisher_rows_per_chunk, gram_input_kept, v_rows_per_chunk
from .precision import matmul_f32, stat_dtype
from .scratch import Scratch

ROW_GRAM_BLOCK = 8192  # columns per block of the V V^T sum (`row_gram`)


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
    overlaps: torch.Tensor | None = None



def statistics_operands(
    X: torch.Tensor, G: torch.Tensor, force_half: bool = False
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(X, G, `costs.statistics_cost`): half operands are upcast to float32 where the device has no float32-output
    half GEMM (unless `force_half`), everything else is returned as it is."""
    cost = statistics_cost(X.dtype, X.device, force_half)
    return (X.float(), G.float(), cost) if cost != 1.0 else (X, G, cost)

def row_norms(T: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """Euclidean norms of the rows of T (n, d) -> (n,) computed and returned in `dt`."""
    return torch.linalg.vector_norm(T, dim=1) if T.dtype == dt else torch.linalg.vector_norm(T, dim=1, dtype=dt)



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
    force_half: bool = False,
    overlap_with: torch.Tensor | None = None,
    shared_input=None,
) -> SequenceStats:
    """Per-sequence statistics of the layer gradient.

    Args:
        X: (B, L, d_in) inputs.
        G: (B, L, d_out) output gradients, same dtype as X; at each invalid position the row of X or of G is zero
            (see above).
        sample: (S,) flat indices into B*L of the Fisher token sample J; needed if `fisher`. It may hold padding
            positions (a fixed-size sample, `sampling.fisher_token_sample`): their zero row adds exactly 0 to the
            numerator and the denominator.
        fisher: compute the Fisher numerator sum_j u_i[j]^2 and denominator ||(|g_j||a_j|)_j||.
        ntk: compute K (B, B).
        route: "gram", "mat" or "auto" (cheapest by `route_costs`).
        budget_bytes: bound on any chunked intermediate (Gram row blocks, V chunks).
        bias: also return the per-sequence bias gradients sum_t g_t, (B, d_out).
        mask: (B, L) valid positions, for the bias sums when G is not the masked operand.
        scratch: reusable storage for the large temporaries: materialized V, Fisher sample rows (fresh if None).
        euclidean: compute e^2 (free with K; on "gram" without K it costs about 0.6x the Fisher numerator).
        force_half: keep half operands where the device has no float32-output half GEMM (`precision.py`).
        overlap_with: a (d_out, d_in) matrix M: the "mat" route also returns <V_i, M> (B,) as `overlaps`, one pass
            over each V chunk while it is there (else None: the "gram" route never forms V).
        shared_input: the engine's entry of this layer's input (`layerwise.inputs.SharedInput`), or None: on the
            "gram" route the input side (Fisher products X a_J^T, e^2 blocks X_i X_i^T) is made once per input and
            sample where `costs.gram_input_kept` (`gram_input_statistics`; needs `mask`), and "auto" prices a layer
            whose input side exists without it.

    Returns:
        `SequenceStats` in `stat_dtype(X.dtype)`; e2 is None if neither `euclidean` nor `ntk`.
    """
    X, G, stat_cost = statistics_operands(X, G, force_half)
    B, L, d_in = X.shape
    sdt = stat_dtype(X.dtype)
    d_out = G.shape[-1]
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    if fisher and sample is None:
        raise ValueError("the Fisher estimate needs a token sample")
    S = int(sample.numel()) if fisher else 0
    # The input side is kept for the other layers reading X only within the budget (`costs.gram_input_kept`).
    item, euclid = item_bytes(sdt), euclidean and not ntk
    share = shared_input is not None and mask is not None and route != "mat"
    share = share and gram_input_kept(B, L, S, fisher, euclid, item, budget_bytes)
    key = ("isopo_gram_input", sample.data_ptr() if fisher else None, S, euclid, X.dtype, budget_bytes)
    key = key if share else None
    if route == "auto":
        cost = route_costs(B, L, d_in, d_out, S, fisher, ntk, budget_bytes, euclidean=euclidean, stat_cost=stat_cost,
                           input_shared=share and shared_input.peek(key) is not None)
        route = cost.best

    num = den = None
    inputs = None
    if share and route == "gram":
        step = euclid_rows_per_chunk(B, L, item, budget_bytes) if euclid else 0
        inputs = shared_input.statistic(key, lambda: gram_input_statistics(X, sample if fisher else None, mask, step))
    if fisher:
        XJ = gather_rows(X, sample, scratch, "XJ") if inputs is None else inputs.XJ
        GJ = gather_rows(G, sample, scratch, "GJ")
        # No absolute "+ 1e-12" (the reference's): |g_j| carries the loss normalization; 0 is handled by fisher_norm.
        den = torch.linalg.vector_norm(row_norms(GJ[:S], sdt) * row_norms(XJ[:S], sdt))
        if route == "mat" and XJ.dtype != sdt:  # "mat" contracts them with V (float32): the small factors upcast
            XJ, GJ = XJ.to(sdt), GJ.to(sdt)

    if route == "gram":
        stats = gram_statistics(X, G, XJ if fisher else None, GJ if fisher else None, ntk, budget_bytes, euclidean,
                                inputs)
    else:
        stats = materialized_statistics(
            X, G, XJ if fisher else None, GJ if fisher else None, ntk, budget_bytes, scratch, euclidean,
            overlap_with,
        )
    e2, u, K, V, overlaps = stats
    if fisher:
        num = (u * u).sum(1)
    bias_per_seq = None
    if bias:  # (B, 1, L) @ (B, L, d_out): masked sums over positions without a masked copy of G
        if mask is None:
            bias_per_seq = G.sum(1) if G.dtype == sdt else G.sum(1, dtype=sdt)
        else:
            bias_per_seq = matmul_f32(mask.to(G.dtype).unsqueeze(1), G).squeeze(1)
    return SequenceStats(e2=e2, fisher_num=num, fisher_den=den, ntk=K, route=route, V=V, bias_per_seq=bias_per_seq,
                         overlaps=overlaps)


def item_bytes(dt: torch.dtype) -> int:
    return torch.finfo(dt).bits // 8


class GramInputs(NamedTuple):
    """The input side of the "gram" route for one input X (B, L, d_in), as the masked input gives it (padding rows
    zeroed, whichever operand the layer masked): `sample` (kept so that its storage, part of the key, lives as long
    as the entry), XJ (S', d_in) the gathered sample rows and P (B, L, S') with P[i, t, j] = a_t . a_j (Fisher
    numerator; None without it), `blocks` the e^2 row blocks X[:, t0:t1] X[:, t0:]^T (empty without e^2)."""

    sample: torch.Tensor | None
    XJ: torch.Tensor | None
    P: torch.Tensor | None
    blocks: list


def gram_input_statistics(X: torch.Tensor, sample: torch.Tensor | None, mask: torch.Tensor, step: int) -> GramInputs:
    """`GramInputs` of X for the Fisher `sample` (or None) and e^2 row blocks of `step` rows (0: none). Padding is
    zeroed in every product, so a layer whose G is the masked operand gets the statistics it would compute itself
    (those terms were 0 through its G). Nothing here depends on the layer's output side: every layer reading X with
    the same sample shares them (`sequence_statistics`' shared_input)."""
    m = mask.to(stat_dtype(X.dtype))
    XJ = P = None
    if sample is not None:
        XJ = gather_rows(X, sample, None, "")
        XJ[: sample.numel()] *= m.reshape(-1)[sample].unsqueeze(1).to(XJ.dtype)
        P = matmul_f32(X, XJ.T)
        P *= m.unsqueeze(2)
    blocks = []
    for t0 in range(0, X.shape[1] if step else 0, max(step, 1)):
        t1 = min(X.shape[1], t0 + step)
        block = matmul_f32(X[:, t0:t1], X[:, t0:].transpose(1, 2))
        block *= m[:, t0:t1].unsqueeze(2) * m[:, t0:].unsqueeze(1)
        blocks.append(block)
    return GramInputs(sample, XJ, P, blocks)


def gather_rows(T: torch.Tensor, index: torch.Tensor, scratch: Scratch | None, slot: str) -> torch.Tensor:
    """Rows `index` of T (B, L, d) flattened to (B*L, d), zero-padded to a multiple of SAMPLE_MULTIPLE rows (zero
    rows give u[:, j] = 0, leaving the numerator exact). `index_select` into the padded buffer, far faster on CPU than
    advanced indexing plus `cat` (docs/isopo.md, "Cost")."""
    n, d = index.numel(), T.shape[-1]
    rows = gathered_rows(n)
    out = T.new_empty(rows, d) if scratch is None else scratch.get(slot, (rows, d), T.dtype, T.device)
    if rows > n:
        out[n:].zero_()
    torch.index_select(T.reshape(-1, d), 0, index, out=out[:n])
    return out



def row_gram(Vf: torch.Tensor) -> torch.Tensor:
    """Vf Vf^T for Vf (B, n) with n up to d_in * d_out, as a sum of (B, ROW_GRAM_BLOCK) block products.

    One GEMM with an inner dimension of millions accumulates each entry in one long float32 sum: relative error 5e-4
    at n = 4.4M (896 x 4864, random V) against 7.5e-8 for blocks of 8192, and slower on CPU than the blocked form
    (docs/isopo.md, "Cost").
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



def gram_statistics(X, G, XJ, GJ, ntk, budget, euclidean=True, inputs=None):
    """The "gram" route: (e2 (B,) | None, u (B, S') | None, K (B, B) | None, None, None) from token Gram blocks (no
    V, hence no overlaps). XJ, GJ: the gathered sample rows (`gather_rows`, S' rows) or None; ntk: form K; budget:
    bytes per intermediate; inputs: the input side made once for the layers reading X (`gram_input_statistics`,
    when `costs.gram_input_kept`), or None."""
    B, L, _ = X.shape
    sdt = stat_dtype(X.dtype)  # products and sums (float32 for half operands)
    item = item_bytes(sdt)
    u = None
    if XJ is not None:
        # u[i, j] = sum_{t in i} (a_t . a_j)(g_t . g_j): (B, c, S) blocks over positions t.
        S = XJ.shape[0]
        u = torch.zeros(B, S, dtype=sdt, device=X.device)
        step = fisher_rows_per_chunk(B, L, S, item, budget)
        for t0 in range(0, L, step):
            Ga = matmul_f32(X[:, t0 : t0 + step], XJ.T) if inputs is None else inputs.P  # one block if shared
            Gg = matmul_f32(G[:, t0 : t0 + step], GJ.T)
            u += (Ga * Gg).sum(1)
    if ntk:
        # K = P (Ga o Gg) P^T over all B*L positions; row blocks of the flat token axis, upper triangle only.
        N = B * L
        Xf, Gf = X.reshape(N, -1), G.reshape(N, -1)
        seq = torch.arange(B, device=X.device).repeat_interleave(L)
        K = torch.zeros(B, B, dtype=sdt, device=X.device)
        step = min(TRI_ROWS, rows_per_chunk(2 * N * item, budget, N))
        for r0 in range(0, N, step):
            r1 = min(N, r0 + step)
            M = matmul_f32(Xf[r0:r1], Xf[r0:].T) * matmul_f32(Gf[r0:r1], Gf[r0:].T)  # (c, N - r0)
            M[:, r1 - r0 :] *= 2  # strictly-upper blocks stand for their transposes too
            rows = torch.zeros(r1 - r0, B, dtype=M.dtype, device=M.device)
            rows.index_add_(1, seq[r0:], M)  # (c, B): segment sums over t'
            K.index_add_(0, seq[r0:r1], rows)
        K = 0.5 * (K + K.T)  # fold the doubled upper triangle into a symmetric K
        return torch.diagonal(K).clone(), u, K, None, None
    if not euclidean:
        return None, u, None, None, None
    # e_i^2 from the diagonal blocks, upper triangle of each L x L block.
    e2 = torch.zeros(B, dtype=sdt, device=X.device)
    step = euclid_rows_per_chunk(B, L, item, budget)
    for i, t0 in enumerate(range(0, L, step)):
        t1 = min(L, t0 + step)
        Xg = matmul_f32(X[:, t0:t1], X[:, t0:].transpose(1, 2)) if inputs is None else inputs.blocks[i]
        M = Xg * matmul_f32(G[:, t0:t1], G[:, t0:].transpose(1, 2))
        e2 += M[:, :, : t1 - t0].sum((1, 2)) + 2 * M[:, :, t1 - t0 :].sum((1, 2))
    return e2, u, None, None, None


def materialized_statistics(X, G, XJ, GJ, ntk, budget, scratch=None, euclidean=True, overlap_with=None):
    """The "mat" route: (e2, u, K, V, overlaps) as `gram_statistics`, V (B, d_out, d_in) kept when one chunk holds
    it. XJ, GJ: the gathered sample rows in `stat_dtype(X.dtype)` (V's dtype). With `overlap_with` M (d_out, d_in),
    overlaps = <V_i, M> (B,), summed chunk by chunk (a chunked V then needs no second pass over X and G for them);
    else None."""
    B, L, d_in = X.shape
    d_out = G.shape[-1]
    sdt = stat_dtype(X.dtype)  # V (float32 for half operands: it feeds the norms and the final sum)
    item = item_bytes(sdt)
    # Per d_out row: the V chunk (B, c, d_in) and, for the Fisher numerator, Y = V a_J (B, c, S).
    S = XJ.shape[0] if XJ is not None else 0
    step = v_rows_per_chunk(B, d_in, d_out, S, item, budget)
    # u[i, j] = sum_o g_j[o] (V_i a_j)[o] contracts the longer of (c, d_in) in one 2-D GEMM: with c > d_in, V is
    # stored transposed, V^T (B, d_in, c), so that (B d_in, c) @ (c, S) reads it in place (the (B, c, d_in) layout
    # needed a transposed copy of V per chunk; a broadcast (S, c) @ (B, c, d_in) ran 1.2-1.4x slower).
    transposed = XJ is not None and min(step, d_out) > d_in
    XJt = XJ.T.contiguous() if transposed else None  # (d_in, S)
    e2, u, K, b = [], [], [], []  # per-chunk terms, summed at the end (one chunk in the common case: no zero-init)
    M = None if overlap_with is None else overlap_with.to(sdt)
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
        if M is not None:  # <V_i, M> as a product with V's flat rows: no V-sized temporary
            Mc = M[o0:o1].T.contiguous() if transposed else M[o0:o1]
            b.append(Vf @ Mc.reshape(-1))
        if ntk:  # with K, e^2 = diag K (no extra pass over V)
            K.append(row_gram(Vf))
        elif euclidean:
            e2.append(torch.linalg.vector_norm(Vf, dim=1).square_())  # a reduction, no (B, c, d_in) temporary
        if XJ is not None:
            # The small factor is made contiguous first: a broadcast product with a transposed view ran 2-3x slower.
            if transposed:
                Zt = Vf.view(B * d_in, o1 - o0) @ GJ[:, o0:o1].T  # (B d_in, S): sum_o V_i[o, :] g_j[o]
                u.append((Zt.view(B, d_in, -1) * XJt).sum(1))
            else:
                u.append(((V @ XJ.T) * GJ[:, o0:o1].T.contiguous()).sum(1))
    u = sum_terms(u) if XJ is not None else None
    V = V if step >= d_out else None  # kept for the final gradient only when it is the whole V (one chunk)
    b = None if M is None else sum_terms(b)
    if ntk:
        K = sum_terms(K)
        return torch.diagonal(K).clone(), u, K, V, b
    return (sum_terms(e2) if euclidean else None), u, None, V, b


def sum_terms(terms: list[torch.Tensor]) -> torch.Tensor:
    return terms[0] if len(terms) == 1 else torch.stack(terms).sum(0)

