"""ISOPO for the LM head inside TRL's fused log-prob kernel (opt-in: `isopo_lm_head=True`).

The head is a linear layer W (V, H) (+ b) whose input rows are the final hidden states x_t and whose output-gradient
rows are the logits gradients g_t of the advantage-free surrogate. Its per-sequence gradients V_i = sum_t g_t x_t^T
would take B x V x H floats (8 x 49152 x 576 x 4 bytes = 0.9 GB for SmolLM2), and TRL never forms the logits: its
kernel recomputes them in vocabulary tiles. Every statistic ISOPO needs (`statistics.py`: e_i^2, u_i[j] = g_j^T V_i x_j,
K_ik) is a sum over output rows, hence over vocabulary tiles. So the backward of the head runs:

1. `head_statistics`: per vocabulary tile, the logits of the scored rows only (the last C positions, as a (B, C)
   layout), folded into logits gradients by TRL's own kernel, and the tile's share of the statistics by the "gram"
   or "mat" route of `statistics.py` (whichever is cheaper for the tile's shape);
2. the coefficients w (`layer.isopo_coefficients`, exactly as for a covered layer; EMA under the head's name);
3. TRL's tile loop with rows scaled by w_seq(t) (`kernel.RowScaledChunkedLogProb`): grad W = sum_i w_i V_i, and
   the hidden-state gradient unchanged.

Cost over TRL's backward: step 1, i.e. the scored rows' logits recomputed once more plus the statistics (for
SmolLM2-like shapes about one more head GEMM). The Fisher token sample J is drawn from the scored positions (prompt
rows have g = 0 here; the reference, whose head sees every position, draws from all of them, so its sampled estimate
averages over more zero rows; the exact estimate, `isopo_fisher_tokens=0`, is the same).
"""

from __future__ import annotations

import torch

from ..compat import FOLD_BLOCK_COLUMNS
from ..layerwise.costs import route_costs, statistics_cost
from ..layerwise.head.kernel import tile_fold
from ..layerwise.head.rows import head_row_values, scored_rows
from ..layerwise.precision import stat_dtype
from ..layerwise.statistics import SequenceStats, gather_rows, gram_statistics, materialized_statistics, row_norms
from .layer import isopo_coefficients


def head_statistics(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    log_z: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    rows: torch.Tensor,
    valid: torch.Tensor,
    sample: torch.Tensor | None,
    settings,
    compute_dtype: torch.dtype,
    kernel_args: dict,
) -> SequenceStats:
    """Per-sequence statistics of the head's weight gradient, as `statistics.sequence_statistics` gives for a layer.

    Args:
        hidden (N, H), weight (V, H), bias (V,) | None, targets (N,), log_z (N,), entropy (N,): the kernel's saved
            tensors (entropy = log_z when the loss has no entropy term); grad_logprobs / grad_entropy (N,) float32
            or None: the incoming gradients.
        rows, valid: (B, C) from `scored_rows`.
        sample: (S,) flat indices into B*C of the Fisher sample J (when `settings.needs_fisher`).
        settings: `ISOPOSettings` (needs_fisher, interacting, needs_euclidean, route, budget_bytes).
        compute_dtype, kernel_args: the kernel's (TRL's) tile dtype and fold arguments.
    """
    s = settings
    B, C = rows.shape
    H, vocab, dev = hidden.shape[1], weight.shape[0], hidden.device
    flat, keep = rows.reshape(-1), valid.reshape(-1)
    # Invalid positions: zero input row and zero incoming gradients, hence a zero logits-gradient row (exactly).
    h = hidden.index_select(0, flat).to(compute_dtype) * keep.unsqueeze(1).to(compute_dtype)
    pick = {name: t.index_select(0, flat) for name, t in (("targets", targets), ("log_z", log_z), ("ent", entropy))}
    gl = grad_logprobs.index_select(0, flat) * keep if grad_logprobs is not None else None
    ge = grad_entropy.index_select(0, flat) * keep if grad_entropy is not None else None
    X = h.view(B, C, H)
    S = sample.numel() if s.needs_fisher else 0
    # Vocabulary tile width: the (B C, width) logits tile and its float32 copy within half the budget.
    width = min(vocab, max(128, s.budget_bytes // (2 * 4 * B * C)))
    cost = statistics_cost(X.dtype, dev, s.force_half_operands)  # > 1: half operands upcast for the statistics

    def operand(t):
        return t.float() if cost != 1.0 else t

    c = route_costs(B, C, H, width, S, s.needs_fisher, s.interacting, s.budget_bytes, euclidean=s.needs_euclidean,
                    stat_cost=cost)
    # Here V replaces no GEMM (the weight gradient is the third step): the "mat" route pays for it in full.
    route = s.route if s.route != "auto" else ("gram" if c.gram <= c.mat + cost * B * C * H * width else "mat")
    Xs = operand(X)
    sdt = stat_dtype(Xs.dtype)
    XJ = gather_rows(Xs, sample, None, "XJ") if S else None
    e2 = u = K = None
    gnorm2 = torch.zeros(XJ.shape[0], dtype=sdt, device=dev) if S else None
    buf = torch.empty((B * C, width), device=dev, dtype=compute_dtype)
    for v0 in range(0, vocab, width):
        v1 = min(v0 + width, vocab)
        tile = buf[:, : v1 - v0]
        torch.mm(h, weight[v0:v1].to(compute_dtype).t(), out=tile)
        if bias is not None:
            tile.add_(bias[v0:v1].to(compute_dtype))
        tile_fold(dev, B * C, v1 - v0)(tile, tile.stride(0), pick["targets"], pick["log_z"], pick["ent"],
             gl if gl is not None else pick["log_z"], ge if ge is not None else pick["log_z"], v0, v1 - v0,
             HAS_LOGPROB_GRAD=gl is not None, HAS_ENTROPY_GRAD=ge is not None, BLOCK_SIZE=FOLD_BLOCK_COLUMNS,
             **kernel_args)  # fmt: skip
        G = operand(tile.view(B, C, -1))
        GJ = gather_rows(G, sample, None, "GJ") if S else None
        if S:
            gnorm2 += row_norms(GJ, sdt).square()
        if route == "gram":
            parts = gram_statistics(Xs, G, XJ, GJ, s.interacting, s.budget_bytes, s.needs_euclidean)
        else:
            XJm, GJm = (None, None) if not S else (XJ.to(sdt), GJ.to(sdt))
            parts = materialized_statistics(Xs, G, XJm, GJm, s.interacting, s.budget_bytes, None, s.needs_euclidean)[:3]
        e2 = _add(e2, parts[0])
        u = _add(u, parts[1])
        K = _add(K, parts[2])
    num = den = None
    if S:
        num = (u * u).sum(1)
        den = torch.linalg.vector_norm((gnorm2.sqrt() * row_norms(XJ, sdt))[:S])
    return SequenceStats(e2=e2, fisher_num=num, fisher_den=den, ntk=K, route=route)


def _add(total, part):
    return part if total is None else (total if part is None else total + part)


class ISOPOHead:
    """Row-scale provider of `RowScaledChunkedLogProb` for an ISOPO-transformed head: called in the kernel's backward
    with its saved tensors, returns the per-row coefficients w_seq(t) (N,) of micro-batch `mb` and keeps the head's
    EMA and metrics in `backward` (an `ISOPOBackward`) under `name`; None inside the backward's plain mode."""

    def __init__(self, backward, name: str, mb):
        self.backward, self.name, self.mb = backward, name, mb

    def __call__(self, hidden, weight, bias, targets, log_z, entropy, grad_logprobs, grad_entropy, compute_dtype,
                 kernel_args) -> torch.Tensor | None:  # fmt: skip
        owner, mb, s = self.backward, self.mb, self.backward.settings
        if owner.plain_active:
            return None
        owner.record_call(self.name)
        if hidden.shape[0] == 0:
            # Compact layout with no scored position (every completion empty or masked): no row, no gradient, no
            # statistics to fold. A shape, known on the host: no synchronization.
            return torch.zeros(0, dtype=torch.float32, device=hidden.device)
        rows, valid = scored_rows(mb, hidden.shape[0])
        sample = owner.fisher_sample(self.name, mb, mask=valid) if s.needs_fisher else None
        stats = head_statistics(hidden, weight, bias, targets, log_z, entropy, grad_logprobs, grad_entropy, rows,
                                valid, sample, s, compute_dtype, kernel_args)  # fmt: skip
        dt = stats.e2.dtype if stats.e2 is not None else stats.fisher_num.dtype
        A = mb.advantages_as(dt, hidden.device)
        coef = None if owner.weight_override is None else owner.weight_override(self.name, A)
        w, record, ema, lam = isopo_coefficients(stats, A, s, mb.stat_scale_as(dt, hidden.device),
                                                 owner.history(self.name), coef, mb.step_sequences)  # fmt: skip
        owner.keep(self.name, record, ema, lam)
        w = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)  # as for a layer: a bad sequence drops out
        return head_row_values(hidden.shape[0], mb, w)
