"""One covered linear layer's ISOPO gradient for one micro-batch, as a pure function of tensors (paper arXiv
2512.23353, §2 and §3).

For y = x W^T + b with inputs x_t, output gradients g_t of the advantage-free surrogate and sequences i = 1..B
(valid tokens T_i):

    V_i   = sum_{t in T_i} g_t x_t^T                        per-sequence weight gradient  (d_out, d_in)
    e_i   = ||V_i||_F                                         Euclidean norm
    f_i   = ||(g_j^T V_i x_j)_{j in J}|| / ||(|g_j| |x_j|)_{j in J}||      Fisher norm on the token sample J
    rho_i = f_i / e_i                                         relative overlap
    R(s)  = |s| (c = 0),  sqrt(s^2 / (c mu_s) + 1) (c > 0)     regularized magnitude, mu_s the reference point
    w_i   = A_i R(e_i)^q R(f_i)^p R(rho_i)^r                  independent coefficients
    w     = lam (K + lam I)^-1 A,  K_ik = <V_i, V_k>,  lam = c_K mu_K      interacting coefficients
    grad W = sum_i w_i V_i,  grad b = sum_i w_i sum_{t in T_i} g_t

The statistics entering R and K are those of n_i V_i, n_i the sequence's loss normalizer (`stat_scale`), so that
the reference point mu (an EMA over steps) does not depend on token counts or accumulation; c = 0 is homogeneous and
ignores n. For c = 0 the update sum_i A_i s_i V_i is homogeneous of degree 1 + p + q in V: the loss normalization
carried by V is lost (degree 0 for the named settings), so w_i is multiplied by N^(p+q), N = `step_sequences`, the
sequences of this process's optimizer step (micro-batch size x gradient accumulation). With DDP's mean over processes
the update is then the mean over the step's sequences for the named settings, and GRPO's gradient for p = q = 0:
independent of how the step's sequences are split over processes and micro-batches (docs/isopo.md, "Batch
semantics"). The reference point follows `settings.reg_reference` from the layer's stored history (`history`): the
stored EMA, or before any history each sequence's own s^2 (`ema_mean`) or this micro-batch's median (`ema_median`);
`batch_median` uses the micro-batch's median only. What the caller should fold into the EMA is returned.

`ISOPOBackward.layer_grads` (isopo_backward.py) is the glue: it zeroes padding rows (with an input cache shared by the
layers reading one input), draws the Fisher sample, passes the stored EMA values, then folds the returned values and
keeps the metrics record.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from ..layerwise.scratch import Scratch
from ..layerwise.statistics import sequence_statistics
from ..layerwise.weight_grad import reweighted_weight_grad
from .reweight import (
    fisher_norm,
    interacting_coefficients,
    isopo_sequence_scales,
    isopo_sequence_weights,
    nonzero_median,
    relative_overlap,
)


class LayerGrad(NamedTuple):
    """What `isopo_linear_grad` returns. grad_weight (d_out, d_in), grad_bias (d_out,) or None, in the statistics
    dtype (float32; float64 for float64 inputs); record (6, B): rows e, f, rho, scale, A, w of the metrics (a
    statistic not computed repeats another: e = f for p alone; interacting: scale = w); ema: (key, values (n,),
    weights (n,) or None) to fold into the layer's EMA (keys "e", "f", "rho", "ntk" or "<stat>@median"); lam: the
    interacting variant's lambda (else None)."""

    grad_weight: torch.Tensor
    grad_bias: torch.Tensor | None
    record: torch.Tensor
    ema: list
    lam: torch.Tensor | float | None


def reference_point(rule: str, x2: torch.Tensor, stored: float | None, median_stored: float | None):
    """(mu, EMA entries) of one statistic from this micro-batch's x^2 (B,) under `rule` (`isopo_reg_reference`):
    ema_mean: `stored`, else x2 itself; ema_median: `median_stored`, else the median of the positive x2;
    batch_median: that median. Medians are on-device; a micro-batch whose every x is 0 has none (NaN, weight 0)."""
    if rule == "ema_mean":
        return (x2 if stored is None else stored), [("", x2, None)]
    med = nonzero_median(x2)
    if rule == "batch_median":
        return med, []
    has = ~torch.isnan(med)
    entry = ("@median", torch.where(has, med, 0.0), has.to(med.dtype))
    return (med if median_stored is None else median_stored), [entry]


def isopo_linear_grad(
    X: torch.Tensor,
    G: torch.Tensor,
    mask: torch.Tensor,
    advantages: torch.Tensor,
    settings,
    *,
    sample: torch.Tensor | None = None,
    stat_scale: torch.Tensor | None = None,
    history: Mapping[str, float] | None = None,
    coefficients: torch.Tensor | None = None,
    has_bias: bool = False,
    scratch: Scratch | None = None,
    step_sequences: float | None = None,
    shared_input=None,
) -> LayerGrad:
    """ISOPO weight (and bias) gradient of one linear layer for one micro-batch (the module docstring's equations).

    Args:
        X: (B, L, d_in) layer inputs; G: (B, L, d_out) output gradients, same dtype (float32/float64, or bf16/fp16
            where the device has float32-accumulating half GEMMs); at every padding position the row of X or of G
            is zero (either suffices; padding rows of the other may hold anything finite).
        mask: (B, L) bool, valid positions (T_i of each row).
        advantages: (B,) A_i, in the statistics dtype.
        settings: `ISOPOSettings` (p, q, r, reg, reg_reference, interacting, interacting_reg, route, budget,
            force_half_operands).
        sample: (S,) flat indices into B*L of the Fisher token sample J (needed when `settings.needs_fisher`);
            padding positions in it add exactly 0.
        stat_scale: (B,) loss normalizers n_i (None = 1).
        history: the layer's stored EMA values by key ("e", "f", "rho", "ntk", "e@median", ...), missing = none yet.
        coefficients: (B,) w to use instead of the computed ones (tests: e.g. all ones gives plain autograd).
        has_bias: return the bias gradient too.
        scratch: reusable storage for the large temporaries (fresh if None).
        step_sequences: N, the number of sequences in this process's optimizer step (c = 0 only; None = 1).
        shared_input: the engine's entry of X (`layerwise.inputs.SharedInput`), or None: the "gram" route's input
            side (Fisher products, e^2 blocks) is made once for the layers reading X with this sample
            (`statistics.sequence_statistics`).
    """
    s = settings
    stats = sequence_statistics(
        X, G, sample, s.needs_fisher, s.interacting, s.route, s.budget_bytes, has_bias, mask, scratch,
        euclidean=s.needs_euclidean, force_half=s.force_half_operands, shared_input=shared_input,
    )
    w, record, ema, lam = isopo_coefficients(stats, advantages, s, stat_scale, history, coefficients, step_sequences)
    # A non-finite coefficient (overflowing statistics) drops that sequence from this layer, never the run.
    w_finite = torch.nan_to_num(w, nan=0.0, posinf=0.0, neginf=0.0)
    gw, gb = reweighted_weight_grad(X, G, w_finite, stats, s.force_half_operands, scratch=scratch)
    return LayerGrad(gw, gb if has_bias else None, record, ema, lam)


def isopo_coefficients(
    stats,
    advantages: torch.Tensor,
    settings,
    stat_scale: torch.Tensor | None = None,
    history: Mapping[str, float] | None = None,
    coefficients: torch.Tensor | None = None,
    step_sequences: float | None = None,
):
    """(w (B,), record (6, B), EMA entries, lam) of one layer and micro-batch from its per-sequence statistics
    (`statistics.SequenceStats`: e2, Fisher numerator / denominator, K): the module docstring's R, w_i and interacting
    equations, with the step normalization N^(p+q) for c = 0; arguments as in `isopo_linear_grad`. w may hold
    non-finite values (the caller drops them)."""
    s = settings
    history = history or {}
    A, n = advantages, stat_scale
    e = None if stats.e2 is None else stats.e2.clamp_min(0).sqrt()
    ema, lam = [], None
    if s.interacting:
        K = stats.ntk if n is None else stats.ntk * (n.unsqueeze(1) * n.unsqueeze(0))
        mean_eig = torch.diagonal(K).mean()  # trace(K) / B
        stored = history.get("ntk")
        lam = s.interacting_reg * (mean_eig if stored is None else stored)
        w = interacting_coefficients(K, A, lam).to(A.dtype)
        ema.append(("ntk", mean_eig, None))
        f = rho = e  # placeholders in the record (not reported)
        scale = w
    else:
        f = fisher_norm(stats.fisher_num, stats.fisher_den) if s.needs_fisher else None
        rho = relative_overlap(f, e) if s.r != 0 else None
        if s.reg > 0:
            # Degree 0 in the statistics: the normalizer n only matters for the reference point's history.
            en = e if (e is None or n is None) else e * n
            fn = f if (f is None or n is None) else f * n
            mu = {}
            for key, value, exponent in (("e", en, s.q), ("f", fn, s.p), ("rho", rho, s.r)):
                if exponent != 0:
                    mu[key], entries = reference_point(
                        s.reg_reference, value * value, history.get(key), history.get(f"{key}@median")
                    )
                    ema += [(key + suffix, v, wt) for suffix, v, wt in entries]
            scale = isopo_sequence_scales(en, fn, rho, mu, s.p, s.q, s.r, s.reg)
        else:
            # Pure normalization: the coefficient is homogeneous of degree p + q in V, the update sum_i w_i V_i of
            # degree 1 + p + q (0 for the named settings), so V's own scale is kept: no EMA, no normalizer.
            scale = isopo_sequence_scales(e, f, rho, {}, s.p, s.q, s.r, 0.0)
        w = isopo_sequence_weights(A, scale)
        if s.reg == 0 and step_sequences is not None and s.p + s.q != 0:
            w = w * float(step_sequences) ** (s.p + s.q)  # restores the step's normalization (module docstring)
        e = f if e is None else e  # p alone: f > 0 marks the sequences with a nonzero layer gradient
        f = e if f is None else f
        rho = e if rho is None else rho
    if coefficients is not None:
        w = coefficients.to(A.dtype)
    return w, torch.stack([e, f, rho, scale, A, w]), ema, lam
