"""Fused LM-head log-probs whose weight gradient is row-scaled, in one tile-recompute pass.

`RowScaledChunkedLogProb.apply(hidden, weight, bias, targets, row_scale, temperature, chunk_size,
final_logit_softcapping, logit_scale, outputs)` is a drop-in for TRL's `ChunkedLogProbFunction` (same forward values,
same output tuple, same grad to `hidden`) except that row t's contribution to the gradients of `weight` and `bias` is
multiplied by `row_scale[t]`:

    grad_hidden = G @ W                 (as TRL)
    grad_weight = G.T @ (row_scale * hidden)
    grad_bias   = G.T @ row_scale

where G [N, V] is the gradient w.r.t. the logits from grad_logprobs (and grad_entropy, if any). Each [n, chunk] tile
of G is recomputed once and feeds both GEMMs; scaling the hidden rows (n x H, once per token chunk) instead of the tile
keeps the tile shared. Compared with calling TRL's kernel twice (once per gradient target) this saves one head
forward and one tile recompute in backward.

Numerics mirror TRL's kernel (its torch path) so values match it, not just the math:
- compute dtype = autocast dtype if autocast is on for the device, else `hidden.dtype`; weight/bias/hidden are cast
  to it and the tile GEMM runs in it;
- tile post-processing (transform, online logsumexp, logits grad) runs in fp32, also for fp64 inputs, so outputs are
  fp32; the logits grad is rounded into the compute dtype before the GEMMs (as TRL writes it into the tile);
- gradients accumulate in fp32 for every input dtype (fp64 included: with fp32 statistics, fp64 accumulation would
  not buy fp64 accuracy) and are cast to the parameter dtype at the end;
- logits transform: z = softcap * tanh(scale * y / softcap) / T, softcap skipped when None, `softcap or 1.0` as TRL
  (so 0.0 behaves like 1.0);
- `is_top1` uses first-argmax tie breaking (a tie with an earlier vocab id is not top-1).
On CPU the forward outputs and grad_hidden are bit-identical to TRL's (same fp32 ops, same order). On CUDA/XPU TRL
folds tiles with Triton kernels (tanh via sigmoid, blockwise sums) while this module always uses torch ops, so values
agree to fp32 rounding, not bitwise, and the elementwise passes are not fused.

Row scaling applies to the whole per-row gradient, i.e. also to the entropy term when the loss uses the entropy.
(The two-call scheme in `other_params._AdvantageWeightedHead` sends no entropy gradient to the weight at all.)
"""

from __future__ import annotations

import math

import torch
from packaging.version import Version
from trl.kernels.chunked_logprob import OPTIONAL_OUTPUTS, TOKEN_CHUNK_SIZE

from .plain import plain_backward_active

# `torch.addmm(..., out_dtype=torch.float32)` from bf16/fp16 inputs exists on CUDA from torch 2.8
_MM_OUT_DTYPE = Version(torch.__version__) >= Version("2.8.0")


def _compute_dtype(hidden: torch.Tensor) -> torch.dtype:
    """Dtype of the projection GEMM: the autocast dtype when autocast is on for hidden's device, else hidden's."""
    device_type = hidden.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype


def _addmm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc [M, K] (fp32) += a [M, J] @ b [J, K], without rounding the product to a/b's (half) dtype first."""
    if _MM_OUT_DTYPE and acc.device.type == "cuda" and a.dtype in (torch.float16, torch.bfloat16):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _project(
    hidden_chunk: torch.Tensor,  # [n, H], compute dtype
    weight: torch.Tensor,  # [V, H]
    bias: torch.Tensor | None,  # [V]
    start: int,
    end: int,
    out: torch.Tensor,  # [n, end - start], compute dtype; overwritten
) -> torch.Tensor:
    """Raw logits tile hidden_chunk @ weight[start:end].T (+ bias), in out's dtype. Returns out."""
    torch.mm(hidden_chunk, weight[start:end].to(out.dtype).t(), out=out)
    if bias is not None:
        out.add_(bias[start:end].to(out.dtype))
    return out


def _transform_(y: torch.Tensor, logit_scale: float, softcap: float | None, inv_t: float, keep_tanh: bool = False):
    """Raw logits y [n, c] -> (z, tanh(scale*y/softcap) if keep_tanh else None), fp32 [n, c], where
    z = softcap * tanh(scale*y/softcap) / T. Works in place on y when y is fp32 (y is scratch for every caller);
    multiplications by exactly 1.0 are skipped (exact, and one memory pass fewer each)."""
    x = y.float()
    if logit_scale != 1.0:
        x.mul_(logit_scale)
    t = None
    if softcap is not None:
        x.div_(softcap).tanh_()
        if keep_tanh:
            t, x = x, x * softcap
        else:
            x.mul_(softcap)
    if inv_t != 1.0:
        x.mul_(inv_t)
    return x, t


def _logits_grad(
    y: torch.Tensor,  # [n, c] raw logits tile, compute dtype; consumed (reused as scratch when fp32)
    local_targets: torch.Tensor,  # [n] target ids minus the tile's first vocab id
    log_z: torch.Tensor,  # [n] fp32
    entropy: torch.Tensor | None,  # [n] fp32, needed iff grad_entropy is given
    grad_logprobs: torch.Tensor | None,  # [n] fp32
    grad_entropy: torch.Tensor | None,  # [n] fp32
    logit_scale: float,
    softcap: float | None,
    inv_t: float,
) -> torch.Tensor:
    """d loss / d y for one tile, fp32 [n, c] (loss = sum(grad_logprobs*logprobs + grad_entropy*entropy)).

    Written as in-place passes over one or two tile-sized buffers (this elementwise work costs about as much as a
    GEMM on CPU and is memory-bound on GPU). Each element sees the same fp32 operations in the same order as TRL's
    torch path, so the result is bit-identical to it; multiplications by exactly 1.0 are skipped (they are exact).
    """
    z, t = _transform_(y, logit_scale, softcap, inv_t, keep_tanh=True)
    log_p = z.sub_(log_z.unsqueeze(-1))
    # grad_logprobs term: g_j = gl * ([j == target] - p_j); the target column is patched afterwards
    p = log_p.exp_() if grad_entropy is None else torch.exp(log_p)
    if grad_logprobs is not None:
        gl = grad_logprobs.unsqueeze(-1)
        idx = local_targets.clamp(0, z.shape[1] - 1).unsqueeze(-1)
        in_tile = ((local_targets >= 0) & (local_targets < z.shape[1])).unsqueeze(-1)
        target_g = gl * (1 - p.gather(-1, idx))
        g = p.mul_(-gl) if grad_entropy is None else p * -gl
        g.scatter_(-1, idx, torch.where(in_tile, target_g, g.gather(-1, idx)))
    if grad_entropy is not None:
        # grad_entropy term: g_j -= ge * p_j * (log p_j + H)
        ent = p.mul_(grad_entropy.unsqueeze(-1)).mul_(log_p.add_(entropy.unsqueeze(-1)))
        g = g.sub_(ent) if grad_logprobs is not None else ent.neg_()
    # chain rule through 1/T, softcap * tanh(. / softcap) and logit_scale
    if inv_t != 1.0:
        g.mul_(inv_t)
    if t is not None:
        g.mul_(t.mul_(t).neg_().add_(1))
    if logit_scale != 1.0:
        g.mul_(logit_scale)
    return g


class RowScaledChunkedLogProb(torch.autograd.Function):
    """See the module docstring. Shapes: hidden [N, H], weight [V, H], bias [V] | None, targets [N] (long, in
    [0, V)), row_scale [N] (non-differentiable). Returns (logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1),
    each [N] (fp32; is_top1 bool) or None when not in `outputs`; only logprobs and entropy are differentiable."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        row_scale: torch.Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = OPTIONAL_OUTPUTS,
    ):
        # An unused entropy (logging only) then reaches backward as None instead of a zero tensor to fold in
        ctx.set_materialize_grads(False)
        N, vocab = hidden.shape[0], weight.shape[0]
        if row_scale.shape != (N,):
            raise ValueError(f"row_scale must have shape ({N},), got {tuple(row_scale.shape)}")
        compute_dtype = _compute_dtype(hidden)
        softcap = None if final_logit_softcapping is None else (final_logit_softcapping or 1.0)
        tf = (logit_scale, softcap, 1 / temperature)
        want = {name: name in outputs for name in OPTIONAL_OUTPUTS}
        dev, f32 = hidden.device, torch.float32

        running_max = torch.full((N,), -math.inf, device=dev, dtype=f32)
        sum_exp = torch.zeros(N, device=dev, dtype=f32)
        z_exp_sum = torch.zeros(N, device=dev, dtype=f32)  # sum_j e_j z_j (entropy)
        sq_exp_sum = torch.zeros(N, device=dev, dtype=f32)  # sum_j e_j^2 (log_sum_sq_probs)
        z_sum = torch.zeros(N, device=dev, dtype=f32)  # sum_j z_j (mean_logits)
        max_before_target = torch.full((N,), -math.inf, device=dev, dtype=f32)  # is_top1
        target_z = torch.zeros(N, device=dev, dtype=f32)
        buf = torch.empty((min(N, TOKEN_CHUNK_SIZE), min(chunk_size, vocab)), device=dev, dtype=compute_dtype)

        for t0 in range(0, N, TOKEN_CHUNK_SIZE):
            rows = slice(t0, min(t0 + TOKEN_CHUNK_SIZE, N))
            h = hidden[rows].to(compute_dtype)
            n = h.shape[0]
            for v0 in range(0, vocab, chunk_size):
                v1 = min(v0 + chunk_size, vocab)
                z, _ = _transform_(_project(h, weight, bias, v0, v1, buf[:n, : v1 - v0]), *tf)
                local = targets[rows] - v0
                in_tile = (local >= 0) & (local < v1 - v0)
                picked = z.gather(-1, local.clamp(0, v1 - v0 - 1).unsqueeze(-1)).squeeze(-1)
                target_z[rows] = torch.where(in_tile, picked, target_z[rows])
                if want["mean_logits"]:
                    z_sum[rows] += z.sum(-1)
                if want["is_top1"]:
                    earlier = torch.arange(v1 - v0, device=dev) >= local.unsqueeze(-1)
                    earlier = z.masked_fill(earlier, -math.inf).amax(-1)
                    max_before_target[rows] = torch.maximum(max_before_target[rows], earlier)
                # online logsumexp: rescale the running sums to the new running max
                m_old = running_max[rows]
                m_new = torch.maximum(m_old, z.amax(-1))
                rescale = torch.exp(m_old - m_new)
                # z is not needed after e unless the entropy sum needs both: then e gets its own buffer
                e = torch.exp(z - m_new.unsqueeze(-1)) if want["entropy"] else z.sub_(m_new.unsqueeze(-1)).exp_()
                sum_exp[rows] = sum_exp[rows] * rescale + e.sum(-1)
                if want["entropy"]:
                    z_exp_sum[rows] = z_exp_sum[rows] * rescale + (e * z).sum(-1)
                if want["log_sum_sq_probs"]:
                    sq_exp_sum[rows] = sq_exp_sum[rows] * (rescale * rescale) + (e * e).sum(-1)
                running_max[rows] = m_new

        log_z = running_max + torch.log(sum_exp)
        logprobs = target_z - log_z
        entropy = log_z - z_exp_sum / sum_exp if want["entropy"] else None
        log_sum_sq_probs = torch.log(sq_exp_sum) - 2 * torch.log(sum_exp) if want["log_sum_sq_probs"] else None
        mean_logits = z_sum / vocab if want["mean_logits"] else None
        is_top1 = (target_z >= running_max) & (target_z > max_before_target) if want["is_top1"] else None

        ctx.save_for_backward(hidden, weight, bias, targets, row_scale, log_z, entropy)
        ctx.compute_dtype, ctx.chunk_size, ctx.tf = compute_dtype, chunk_size, tf
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq_probs, mean_logits, is_top1) if x is not None))
        return logprobs, entropy, log_sum_sq_probs, mean_logits, is_top1

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy, *_):
        from trl.trainer.utils import maybe_gather_lm_head_ctx  # ZeRO-3: the head is gathered again for the recompute

        hidden, weight, bias, targets, row_scale, log_z, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        need_b = need_b and bias is not None
        nones = (None,) * 8
        if not (need_h or need_w or need_b) or (grad_logprobs is None and grad_entropy is None):
            return (None, None, None) + nones[:7]
        compute_dtype, chunk_size, tf = ctx.compute_dtype, ctx.chunk_size, ctx.tf
        N, dev, f32 = hidden.shape[0], hidden.device, torch.float32
        grad_logprobs = grad_logprobs.float() if grad_logprobs is not None else None
        grad_entropy = grad_entropy.float() if grad_entropy is not None else None
        scale = row_scale.detach().to(device=dev, dtype=f32)
        if plain_backward_active():  # an ordinary gradient (ISOPO's KL term): rows are not scaled
            scale = torch.ones_like(scale)

        with maybe_gather_lm_head_ctx(weight, bias):
            vocab = weight.shape[0]
            grad_h = torch.zeros(hidden.shape, device=dev, dtype=f32) if need_h else None
            grad_w = torch.zeros(weight.shape, device=weight.device, dtype=f32) if need_w else None
            grad_b = torch.zeros(bias.shape, device=bias.device, dtype=f32) if need_b else None
            buf = torch.empty((min(N, TOKEN_CHUNK_SIZE), min(chunk_size, vocab)), device=dev, dtype=compute_dtype)
            for t0 in range(0, N, TOKEN_CHUNK_SIZE):
                rows = slice(t0, min(t0 + TOKEN_CHUNK_SIZE, N))
                h = hidden[rows].to(compute_dtype)
                n = h.shape[0]
                # Weight-side GEMM operand: hidden rows pre-multiplied by row_scale (fp32 product, one rounding)
                h_scaled = (h.float() * scale[rows].unsqueeze(-1)).to(compute_dtype) if need_w else None
                g_rows = (
                    grad_logprobs[rows] if grad_logprobs is not None else None,
                    grad_entropy[rows] if grad_entropy is not None else None,
                )
                for v0 in range(0, vocab, chunk_size):
                    v1 = min(v0 + chunk_size, vocab)
                    tile = _project(h, weight, bias, v0, v1, buf[:n, : v1 - v0])
                    ent = entropy[rows] if grad_entropy is not None else None
                    # The logits grad replaces the logits in the tile, rounded to the compute dtype as in TRL
                    g = _logits_grad(tile, targets[rows] - v0, log_z[rows], ent, *g_rows, *tf)
                    if g.data_ptr() != tile.data_ptr():
                        tile.copy_(g)
                    if need_h:
                        _addmm_acc(grad_h[rows], tile, weight[v0:v1].to(compute_dtype))
                    if need_w:
                        _addmm_acc(grad_w[v0:v1], tile.t(), h_scaled)
                    if need_b:
                        grad_b[v0:v1].addmv_(tile.t().float(), scale[rows])

        return (
            grad_h.to(hidden.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
        ) + nones[:7]
