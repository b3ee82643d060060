"""TRL's fused LM-head log-prob kernel with a per-row scale on the weight gradient.

`RowScaledChunkedLogProb.apply(hidden, weight, bias, targets, row_scale, temperature, chunk_size,
final_logit_softcapping, logit_scale, outputs)` is a drop-in for TRL's `ChunkedLogProbFunction` (same arguments plus
`row_scale`, same outputs, same gradient to `hidden`) except that row t's contribution to the gradients of `weight`
and `bias` is multiplied by `row_scale[t]`:

    grad_hidden = G @ W                 (as TRL)
    grad_weight = G.T @ (row_scale * hidden)
    grad_bias   = G.T @ row_scale

where G [N, V] is the gradient w.r.t. the logits. Each [n, chunk] tile of G is recomputed once and feeds both GEMMs
(calling TRL's kernel twice, once per gradient target, would recompute every tile twice).

It is TRL's kernel, not a copy of it: the forward *is* `ChunkedLogProbFunction.forward` (run on a recording context
so the row scale can be saved next to TRL's tensors), and the backward runs TRL's own tile fold on CUDA / XPU (its
Triton kernel) and TRL's float32-accumulating GEMM helper, in TRL's loop order. Only the weight-side operand
differs: the hidden rows pre-multiplied by the scale (one product in float32, or float64 for float64 inputs, rounded
once to the compute dtype). Elsewhere (CPU) the fold is `backward_tile_inplace`: TRL's torch fold, the same float32
operations per element in the same order, written as in-place passes over the tile (TRL's allocates about six
tile-sized temporaries per tile: docs/isopo.md, "Cost").
With row_scale = 1 every output and gradient is bit-identical to TRL's; `tests/test_isopo_fused_head.py` checks this
and the scaled gradients against TRL called with scaled incoming gradients and a dense float64 reference. TRL is
pinned to 1.16.x, whose kernel exposes these pieces (`trl_isopo.compat`); a TRL without them fails at import with the
names it lacks.

Row scaling applies to the whole per-row gradient, i.e. also to the entropy term when the loss uses the entropy.
`row_scale` may also be a provider called in backward (`interception.RowValues`, `isopo.ISOPOHead`); one that returns
None (its backward object is in plain mode: ISOPO's KL term) leaves the rows unscaled, the ordinary gradient.
"""

from __future__ import annotations

import torch

from ...compat import (
    FOLD_BLOCK_COLUMNS,
    TOKEN_CHUNK_SIZE,
    ChunkedLogProbFunction,
    addmm_fp32,
    maybe_gather_lm_head_ctx,
    triton_tile_fold,
)


def backward_tile_inplace(tile, tile_stride, targets, log_z, entropy, grad_logprobs, grad_entropy, vocab_start, n_cols,
                          logit_scale, softcap, inv_t, HAS_SOFTCAP, HAS_LOGPROB_GRAD, HAS_ENTROPY_GRAD, BLOCK_SIZE):
    """TRL's torch tile fold (same signature and result, bit for bit): overwrite the raw logits tile [n, c] with
    d loss / d logits (loss = sum(grad_logprobs * logprobs + grad_entropy * entropy)), as in-place float32 passes over
    at most two tile-sized buffers. Multiplications by exactly 1.0 are skipped (exact)."""
    x = tile.float()  # the tile itself when it is float32
    if logit_scale != 1.0:
        x.mul_(logit_scale)
    t = None
    if HAS_SOFTCAP:
        t = x.div_(softcap).tanh_()
        x = t * softcap
    if inv_t != 1.0:
        x.mul_(inv_t)
    log_p = x.sub_(log_z.unsqueeze(-1))
    p = torch.exp(log_p) if HAS_ENTROPY_GRAD else log_p.exp_()
    if HAS_LOGPROB_GRAD:  # g_j = gl * ([j == target] - p_j): -gl * p everywhere, then the target column patched
        gl = grad_logprobs.unsqueeze(-1)
        local = targets - vocab_start
        idx = local.clamp(0, n_cols - 1).unsqueeze(-1)
        in_tile = ((local >= 0) & (local < n_cols)).unsqueeze(-1)
        target_g = gl * (1 - p.gather(-1, idx))
        g = p * -gl if HAS_ENTROPY_GRAD else p.mul_(-gl)
        g.scatter_(-1, idx, torch.where(in_tile, target_g, g.gather(-1, idx)))
    if HAS_ENTROPY_GRAD:  # g_j -= ge * p_j * (log p_j + H)
        ent = p.mul_(grad_entropy.unsqueeze(-1)).mul_(log_p.add_(entropy.unsqueeze(-1)))
        g = g.sub_(ent) if HAS_LOGPROB_GRAD else ent.neg_()
    if inv_t != 1.0:
        g.mul_(inv_t)
    if t is not None:
        g.mul_(t.mul_(t).neg_().add_(1))
    if logit_scale != 1.0:
        g.mul_(logit_scale)
    if g.data_ptr() != tile.data_ptr():
        tile.copy_(g)


def tile_fold(device: torch.device, n_rows: int, n_cols: int):
    """The backward fold for one [n_rows, n_cols] tile: TRL's Triton kernel where TRL uses it, else the in-place one."""
    return triton_tile_fold(device, n_rows, n_cols) or backward_tile_inplace


class _RecordingContext:
    """Stands in for autograd's ctx while TRL's forward runs: keeps what it saves and the attributes it sets, passes
    the calls that must reach autograd (materialize_grads, non-differentiable outputs) to the real ctx."""

    def __init__(self, ctx):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "saved", ())

    def save_for_backward(self, *tensors):
        object.__setattr__(self, "saved", tensors)

    def set_materialize_grads(self, value):
        self._ctx.set_materialize_grads(value)

    def mark_non_differentiable(self, *tensors):
        self._ctx.mark_non_differentiable(*tensors)

    def __getattr__(self, name):  # anything else TRL's forward reads (e.g. needs_input_grad) comes from the real ctx
        return getattr(self._ctx, name)


class RowScaledChunkedLogProb(torch.autograd.Function):
    """See the module docstring. Shapes: hidden [N, H], weight [V, H], bias [V] | None, targets [N] (long, in
    [0, V)), row_scale [N] (non-differentiable). Returns (logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1),
    each [N] (fp32; is_top1 bool) or None when not in `outputs`; only logprobs and entropy are differentiable."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, row_scale, *trl_args):
        # row_scale may also be a provider called in backward (`isopo.ISOPOHead`: coefficients that depend on the
        # logits gradients themselves), with the saved tensors, the incoming gradients, compute dtype, fold arguments;
        # it returns the (N,) scale, or None for an unscaled (ordinary) gradient.
        ctx.provider = row_scale if callable(row_scale) else None
        if ctx.provider is not None:
            row_scale = hidden.new_empty(0)
        elif row_scale.shape != (hidden.shape[0],):
            raise ValueError(f"row_scale must have shape ({hidden.shape[0]},), got {tuple(row_scale.shape)}")
        rec = _RecordingContext(ctx)
        out = ChunkedLogProbFunction.forward(rec, hidden, weight, bias, targets, *trl_args)
        # TRL saves (hidden, weight, bias, targets, log_z, entropy or log_z) and sets these three attributes
        ctx.save_for_backward(*rec.saved, row_scale)
        ctx.compute_dtype, ctx.chunk_size, ctx.kernel_args = rec.compute_dtype, rec.chunk_size, rec.kernel_args
        return out

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        hidden, weight, bias, targets, log_z, entropy, row_scale = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        nones = (None,) * (len(ctx.needs_input_grad) - 3)
        if not (need_h or need_w or need_b) or (grad_logprobs is None and grad_entropy is None):
            return (None, None, None) + nones
        dt, chunk, dev, f32 = ctx.compute_dtype, ctx.chunk_size, hidden.device, torch.float32
        # The scaled product is formed in float32 (float64 for float64 inputs) and rounded once to the compute dtype
        prod_dt = torch.promote_types(dt, f32)
        scale = None if ctx.provider is not None else row_scale.detach().to(device=dev, dtype=prod_dt)
        gl = grad_logprobs.float().contiguous() if grad_logprobs is not None else None
        ge = grad_entropy.float().contiguous() if grad_entropy is not None else None
        N = hidden.shape[0]
        with maybe_gather_lm_head_ctx(weight, bias):  # ZeRO-3: the head is gathered again for the recompute
            if ctx.provider is not None and (need_w or need_b):
                scale = ctx.provider(hidden, weight, bias, targets, log_z, entropy, gl, ge, dt, ctx.kernel_args)
                scale = None if scale is None else scale.to(device=dev, dtype=prod_dt)
            vocab = weight.shape[0]
            grad_h = torch.zeros(hidden.shape, device=dev, dtype=f32) if need_h else None
            grad_w = torch.zeros(weight.shape, device=weight.device, dtype=f32) if need_w else None
            grad_b = torch.zeros(bias.shape, device=bias.device, dtype=f32) if need_b else None
            step = TOKEN_CHUNK_SIZE
            buf = torch.empty((min(N, step), chunk), device=dev, dtype=dt)
            for t0 in range(0, N, step):
                rows = slice(t0, min(t0 + step, N))
                h = hidden[rows].to(dt)
                n = h.shape[0]
                h_w = h if scale is None or not (need_w or need_b) else (h.to(prod_dt) * scale[rows, None]).to(dt)
                for v0 in range(0, vocab, chunk):
                    v1 = min(v0 + chunk, vocab)
                    w_chunk = weight[v0:v1].to(dt)
                    tile = buf[:n, : v1 - v0]
                    torch.mm(h, w_chunk.t(), out=tile)
                    if bias is not None:
                        tile.add_(bias[v0:v1].to(dt))
                    tile_fold(dev, n, v1 - v0)(  # the tile becomes the logits gradient G, in the compute dtype
                        tile,
                        tile.stride(0),
                        targets[rows],
                        log_z[rows],
                        entropy[rows],
                        gl[rows] if gl is not None else log_z,
                        ge[rows] if ge is not None else log_z,
                        v0,
                        v1 - v0,
                        HAS_LOGPROB_GRAD=gl is not None,
                        HAS_ENTROPY_GRAD=ge is not None,
                        BLOCK_SIZE=FOLD_BLOCK_COLUMNS,
                        **ctx.kernel_args,
                    )
                    if need_h:
                        addmm_fp32(grad_h[rows], tile, w_chunk)
                    if need_w:
                        addmm_fp32(grad_w[v0:v1], tile.t(), h_w)
                    if need_b:
                        if scale is None:
                            grad_b[v0:v1] += tile.sum(dim=0, dtype=f32)
                        else:
                            grad_b[v0:v1] += (tile.to(prod_dt) * scale[rows, None]).sum(0, dtype=f32)

        return (
            grad_h.to(hidden.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
        ) + nones
