"""TRL's Triton kernels of the fused LM head, run by Triton's interpreter on CPU tensors: the GPU-only branches.

On CUDA / XPU `head.kernel.tile_fold` hands the backward tiles to TRL's `_backward_kernel` (Triton) and TRL's forward
folds its tiles with `_forward_kernel`; on CPU both are torch code (`head.kernel.backward_tile_inplace`, TRL's
`_forward_tile`). With TRITON_INTERPRET=1 Triton runs a kernel's Python body on numpy arrays, so the GPU branch runs
here, against the CPU fold and a float64 evaluation of the same formula. The switch must be on before TRL decorates
its kernels (at import), so one child process (this file run as a script) computes every case; the tests check it.

Expected differences: both sides compute in float32, but the kernel's exp is numpy's and its tanh is 2 sigmoid(2x) - 1
(the CPU fold: torch.tanh), so they agree to a few float32 ulps of the row's largest gradient, not bit for bit. The
interpreter rounds float32 -> bfloat16 toward zero (`triton/runtime/interpreter.py`, `_convert_float` without a
rounding mode; a GPU rounds to nearest), so bf16 tiles agree to one bf16 ulp of each element.
"""

import importlib.util
import itertools
import os
import subprocess
import sys

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (pip install triton)")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Fold blocks of 16 columns: several blocks per row, the last one partial (the head cases run TRL's block of 1024).
FOLD_CASES = list(itertools.product(DTYPES, ["none", "softcap"], ["logprobs", "entropy", "both"], [16]))
HEAD_CASES = [("none", "no_bias"), ("softcap", "bias")]
N, H, V, CHUNK = 13, 16, 53, 16  # 4 vocabulary tiles, the last one partial
# Float32 evaluation error, relative to the row's largest |gradient|. Kernel against CPU fold: numpy's exp and the
# sigmoid form of tanh against torch's, measured up to 1.7e-6 (soft cap), 2.2e-7 without. Each fold against float64:
# measured up to 4.3e-6 (the entropy term's log p + H cancels), the same for both folds.
FOLD_TOL = 1e-5
# Spacing of half values relative to 1 (bf16: 8 significant bits, fp16: 11), times max(|x|, smallest normal): one ulp
# at x, subnormals included (fp16 results of ~1e-7 are subnormal, spaced 2^-24).
ULP = {"bfloat16": 2.0**-7, "float16": 2.0**-10}


def _half_ulp_bound(dtype, x):
    return ULP[dtype] * x.abs().clamp_min(torch.finfo(DTYPES[dtype]).smallest_normal)


# ------------------------------------------------------------------------------------------------ the child process
def _fold_case(k, dtype, softcap, grads, block):
    """One [n, c] logits tile at vocab_start 32 of a 120-token vocabulary, log Z and entropy from the full row (so
    p <= 1), targets inside and outside the tile: the interpreted kernel, both CPU folds, and float64."""
    from trl_isopo.layerwise.head.kernel import backward_tile_inplace

    g = torch.Generator().manual_seed(21)
    n, c, v0, vocab, ls, inv_t, cap = 9, 40, 32, 120, 1.3, 1 / 0.7, 2.5
    full = torch.randn(n, vocab, generator=g, dtype=torch.float64) * 3
    tile = full[:, v0 : v0 + c].to(dtype)
    full[:, v0 : v0 + c] = tile.double()

    def transform(y):
        y = y * ls
        return (cap * torch.tanh(y / cap) if softcap == "softcap" else y) * inv_t

    logp_full = torch.log_softmax(transform(full), -1)
    log_z = torch.logsumexp(transform(full), -1).float()
    entropy = -(logp_full.exp() * logp_full).sum(-1).float()
    targets = torch.tensor([32, 71, 40, 3, 119, 33, 46, 0, 39])
    gl = torch.randn(n, generator=g) if grads != "entropy" else None
    ge = torch.randn(n, generator=g) if grads != "logprobs" else None
    kw = dict(logit_scale=ls, softcap=cap, inv_t=inv_t, HAS_SOFTCAP=softcap == "softcap",
              HAS_LOGPROB_GRAD=gl is not None, HAS_ENTROPY_GRAD=ge is not None, BLOCK_SIZE=block)
    args = (targets, log_z, entropy, gl if gl is not None else log_z, ge if ge is not None else log_z, v0, c)
    out = {}
    for name, fold in (("kernel", k._backward_kernel[(n, -(-c // block))]), ("inplace", backward_tile_inplace),
                       ("trl_torch", k._backward_tile)):
        t = tile.clone()
        fold(t, t.stride(0), *args, **kw)
        out[name] = t
    # float64: the same formula on the same (rounded) tile and float32 log Z / entropy
    y = tile.double() * ls
    t = torch.tanh(y / cap) if softcap == "softcap" else None
    z = (cap * t if t is not None else y) * inv_t
    log_p = z - log_z.double().unsqueeze(-1)
    p = log_p.exp()
    grad = torch.zeros_like(z)
    if gl is not None:
        onehot = (torch.arange(v0, v0 + c) == targets.unsqueeze(-1)).double()
        grad += gl.double().unsqueeze(-1) * (onehot - p)
    if ge is not None:
        grad -= ge.double().unsqueeze(-1) * p * (log_p + entropy.double().unsqueeze(-1))
    grad = grad * inv_t * ((1 - t * t) if t is not None else 1.0) * ls
    out["float64"] = grad
    return out


def _head_case(k, softcap, bias, triton_path):
    """`RowScaledChunkedLogProb` forward + backward (row scale with zeros and negatives), all outputs requested."""
    from trl_isopo.layerwise.head.kernel import RowScaledChunkedLogProb

    k._use_triton = lambda device: triton_path  # what TRL and `tile_fold` ask: the GPU branch on CPU tensors
    g = torch.Generator().manual_seed(5)
    h = torch.randn(N, H, generator=g).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if bias == "bias" else None
    targets = torch.randint(0, V, (N,), generator=g)
    scale = torch.randn(N, generator=g)
    scale[::5] = 0.0
    cfg = (0.7, CHUNK, 2.5 if softcap == "softcap" else None, 1.3)
    out = RowScaledChunkedLogProb.apply(h, w, b, targets, scale, *cfg, ("entropy", "log_sum_sq_probs",
                                                                        "mean_logits", "is_top1"))
    gl, ge = torch.randn(N, generator=g), torch.randn(N, generator=g)
    leaves = [x for x in (h, w, b) if x is not None]
    grads = torch.autograd.grad((gl * out[0] + ge * out[1]).sum(), leaves)
    return {"outputs": [o.detach() for o in out], "grads": [x.detach() for x in grads]}


def _isopo_head_case(k, triton_path):
    """The ISOPO-transformed head (`head.ISOPOHead`: statistics over vocabulary tiles folded by `tile_fold`, then the
    row-scaled kernel), p = -1 with an exact Fisher estimate, on TRL's full row layout."""
    from trl_isopo.layerwise.head.kernel import RowScaledChunkedLogProb
    from trl_isopo.isopo.head import ISOPOHead
    from math_settings import isopo_settings
    from trl_isopo.isopo.isopo_backward import ISOPOBackward
    from trl_isopo.layerwise.micro_batch import MicroBatch

    k._use_triton = lambda device: triton_path
    g = torch.Generator().manual_seed(8)
    B, L, C = 4, 9, 5
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, :2] = False
    mask[1, -2:] = False
    n_rows = B * (L - 1)
    h = torch.randn(n_rows, H, generator=g).requires_grad_()
    w = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    targets = torch.randint(0, V, (n_rows,), generator=g)
    ctx = ISOPOBackward(isopo_settings(p=-1.0, q=0.0, r=0.0, fisher_tokens=0))
    mb = MicroBatch(mask=mask, advantages=torch.tensor([1.0, -0.5, 2.0, -1.5]), logits_to_keep=C, seed=3)
    out = RowScaledChunkedLogProb.apply(h, w, None, targets, ISOPOHead(ctx, "lm_head", mb), 0.7, CHUNK, None, 1.0, ())
    scored = torch.zeros(B, L - 1, dtype=torch.bool)
    scored[:, -C:] = mask[:, -C:]
    gh, gw = torch.autograd.grad((-out[0] * scored.reshape(-1).float()).sum(), (h, w))
    return {"grads": [gh, gw], "coefficients": ctx.records[-1][5].detach()}


def child(path):
    import trl.kernels.chunked_logprob as k

    from trl_isopo.layerwise.head import kernel as fused_head

    res = {"kernel_types": [type(k._backward_kernel).__name__, type(k._forward_kernel).__name__]}
    use_triton = k._use_triton
    k._use_triton = lambda device: True
    fold = fused_head.tile_fold(torch.device("cpu"), 9, 40)
    res["tile_fold_is_kernel"] = fold is not fused_head.backward_tile_inplace
    k._use_triton = use_triton
    res["fold"] = {case: _fold_case(k, DTYPES[case[0]], *case[1:]) for case in FOLD_CASES}
    res["head"] = {case: {path: _head_case(k, *case, path) for path in (True, False)} for case in HEAD_CASES}
    res["isopo_head"] = {path: _isopo_head_case(k, path) for path in (True, False)}
    torch.save(res, path)


# ------------------------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), str(path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return torch.load(path, weights_only=False)


def test_interpreter_runs_trl_kernels(interpreted):
    assert interpreted["kernel_types"] == ["InterpretedFunction", "InterpretedFunction"]
    assert interpreted["tile_fold_is_kernel"]  # what `tile_fold` hands out where TRL uses Triton


def _row_scale(t):
    return t.double().abs().amax(-1, keepdim=True).clamp_min(1e-30)


@pytest.mark.parametrize("dtype,softcap,grads,block", FOLD_CASES, ids=["-".join(map(str, c)) for c in FOLD_CASES])
def test_backward_kernel_matches_cpu_fold(interpreted, dtype, softcap, grads, block):
    """The interpreted kernel against `backward_tile_inplace` (the CPU fold) and TRL's torch fold on the same tile."""
    r = interpreted["fold"][(dtype, softcap, grads, block)]
    kern, cpu = r["kernel"].double(), r["inplace"].double()
    assert r["kernel"].dtype == DTYPES[dtype] and torch.equal(r["inplace"], r["trl_torch"])
    assert cpu.abs().sum() > 0
    if dtype in ULP:  # one half-dtype ulp of each element (bf16: the interpreter truncates), plus float32 noise
        bound = _half_ulp_bound(dtype, cpu) + FOLD_TOL * _row_scale(cpu)
    else:
        bound = FOLD_TOL * _row_scale(cpu)
    assert ((kern - cpu).abs() <= bound).all(), ((kern - cpu).abs() / _row_scale(cpu)).max()


@pytest.mark.parametrize("dtype,softcap,grads,block", FOLD_CASES, ids=["-".join(map(str, c)) for c in FOLD_CASES])
def test_backward_kernel_matches_float64(interpreted, dtype, softcap, grads, block):
    """Both folds against float64 of the formula on the same tile: equally accurate."""
    r = interpreted["fold"][(dtype, softcap, grads, block)]
    ref = r["float64"]
    for name in ("kernel", "inplace"):
        got = r[name].double()
        if dtype in ULP:
            bound = _half_ulp_bound(dtype, ref) + FOLD_TOL * _row_scale(ref)
        else:
            bound = FOLD_TOL * _row_scale(ref)
        assert ((got - ref).abs() <= bound).all(), (name, ((got - ref).abs() / _row_scale(ref)).max())


@pytest.mark.parametrize("softcap,bias", HEAD_CASES, ids=["-".join(c) for c in HEAD_CASES])
def test_row_scaled_head_triton_path_matches_cpu_path(interpreted, softcap, bias):
    """`RowScaledChunkedLogProb` with TRL's forward kernel and `tile_fold`'s kernel (the GPU branches) against the CPU
    path: every output and gradient (float32) to float32 rounding, is_top1 exactly."""
    gpu, cpu = interpreted["head"][(softcap, bias)][True], interpreted["head"][(softcap, bias)][False]
    for a, b in zip(gpu["outputs"], cpu["outputs"]):
        if a.dtype == torch.bool:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(gpu["grads"], cpu["grads"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
        assert not torch.equal(b, torch.zeros_like(b))


def test_isopo_head_triton_path_matches_cpu_path(interpreted):
    """The ISOPO head's statistics tiles and row-scaled backward through the kernel: same coefficients and gradients."""
    gpu, cpu = interpreted["isopo_head"][True], interpreted["isopo_head"][False]
    torch.testing.assert_close(gpu["coefficients"], cpu["coefficients"], rtol=1e-5, atol=1e-6)
    for a, b in zip(gpu["grads"], cpu["grads"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


if __name__ == "__main__":
    child(sys.argv[1])
