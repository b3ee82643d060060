"""bf16 / fp16 layer operands: products accumulate in float32; statistics, coefficients and gradients are float32.

Compared with float64 oracles (dense per-sequence V_i, `isopo_oracle`). Unit roundoff u: 2^-9 ~ 2.0e-3 for bf16
(8 significant bits), 2^-12 ~ 2.4e-4 for fp16 (11 bits). Two operand policies, both runnable on CPU:

- "upcast": X and G are upcast to float32 once per layer (exact) for the statistics' float32 GEMMs, and the final
  gradient is one bf16 GEMM rounded once to bf16 (fp16: float32 output), the precision of autograd's own weight
  gradient of a half layer: what runs where the device has no half GEMM with float32 output (CPU;
  `statistics.statistics_operands`, `weight_grad._half_reweighted_gemm`);
- "half": X and G stay bf16 / fp16 and every product is accumulated and returned in float32 (`precision.matmul_f32`):
  what runs on CUDA (`out_dtype=torch.float32` GEMMs). Forced on CPU with `ISOPOSettings.force_half_operands`, where
  each product upcasts its operands, which gives the same float32 sums (bf16 x bf16 products are exact in float32).
  The one rounding on this path: the narrower operand's rows scaled by the coefficients are rounded back to the half
  dtype for the final GEMM (`weight_grad._half_reweighted_gemm`; not when the "mat" route keeps V).

The tensors live on the test device (`TRL_ISOPO_TEST_DEVICE`, default CPU). The bounds follow the path actually taken,
`precision.keeps_half_operands(dtype, device)`: on CUDA it is "half" for both fixture values.
"""

import copy

import pytest
import torch
from isopo_oracle import DEVICE, dense_weights, make_batch, make_trainer, per_sequence_data, rel_err
from peft import LoraConfig, get_peft_model

from trl_isopo.layerwise import costs, precision
from trl_isopo.isopo.isopo_backward import ISOPOBackward
from math_settings import isopo_settings
from trl_isopo.layerwise.micro_batch import MicroBatch
from trl_isopo.tiny import build_tiny_causal_lm

U = {torch.bfloat16: 2.0**-9, torch.float16: 2.0**-12}
HALF = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
VARIANTS = {
    "p=-1,c=0": dict(p=-1.0, q=0.0, reg=0.0),
    "p=-1,c=1": dict(p=-1.0, q=0.0, reg=1.0),  # the default setting, with an EMA history
    "q=-1,c=1": dict(p=0.0, q=-1.0, reg=1.0),
    "interacting": dict(p=-1.0, q=0.0, interacting=True, interacting_reg=0.7),
}
# A bf16-rounded product sum (what a half GEMM returning half would give) is off by ~u = 2e-3: 20x this bound.
COEF_TOL = 1e-4


def float32_throughout(dtype, device, force_half=False) -> bool:
    """fp16 operands upcast for the statistics get a float32 final GEMM too (`weight_grad.reweighted_weight_grad`): no
    half rounding anywhere on that path."""
    return dtype == torch.float16 and not precision.keeps_half_operands(dtype, torch.device(device), force_half)


@pytest.fixture(params=["upcast", "half"])
def operands(request):
    return request.param == "half"  # ISOPOSettings.force_half_operands


# ----------------------------------------------------------------------------------------- one layer, pure function
def layer_oracle(X, G, mask, J, A, knobs, hist, n_step=None):
    """float64 coefficients (B,), weight gradient sum_i w_i V_i (d_out, d_in) and bias gradient sum_i w_i b_i (d_out,)
    of one layer with inputs X (B, L, d_in), output gradients G (B, L, d_out) (garbage at padding, dropped here),
    Fisher sample J (valid flat positions) and EMA history `hist` {stat: mu} (c > 0) / {"ntk": mean eigenvalue};
    n_step: the trainer's step normalization (`dense_weights`), None for the layer function alone."""
    pad = ~mask.unsqueeze(-1)
    X, G = X.double().masked_fill(pad, 0.0), G.double().masked_fill(pad, 0.0)
    V = torch.einsum("blo,bli->boi", G, X)
    A = A.double()
    if knobs.get("interacting"):
        Vf = V.reshape(len(A), -1)
        K = Vf @ Vf.T
        lam = knobs["interacting_reg"] * hist["ntk"]
        w = lam * torch.linalg.solve(K + lam * torch.eye(len(A), dtype=K.dtype, device=K.device), A)
    else:
        mu = {k: hist.get(k, 1.0) for k in ("e", "f", "rho")}
        w, _ = dense_weights(V, X, G, J, A, knobs["p"], knobs["q"], 0.0, knobs["reg"], mu if knobs["reg"] else None,
                             n_step=n_step)
    return w, torch.einsum("b,boi->oi", w, V), torch.einsum("b,blo->o", w, G)


def random_layer(d_in, d_out, seed, B=5, L=11):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(B, L, generator=g) > 0.3
    mask[0] = False
    mask[0, 4] = True  # a sequence with one valid token
    mask[1, :3] = False  # left padding
    mask[2, -4:] = False  # right padding
    mask[3] = True
    # Finite garbage at padding in both operands: the layer zeroes the narrower one's rows.
    X = torch.randn(B, L, d_in, generator=g, dtype=torch.float64)
    G = torch.randn(B, L, d_out, generator=g, dtype=torch.float64) * 0.1
    A = torch.tensor([1.0, -0.5, 0.0, 2.0, -1.5])
    return tuple(t.to(DEVICE) for t in (X, G, mask, A))


def history(X, G, mask, J, knobs):
    """An EMA history in the units of the statistics: 0.6 x the batch mean of x^2 (e, f), or of K's eigenvalues."""
    pad = ~mask.unsqueeze(-1)
    V = torch.einsum("blo,bli->boi", G.double().masked_fill(pad, 0.0), X.double().masked_fill(pad, 0.0))
    if knobs.get("interacting"):
        return {"ntk": 0.6 * float(V.pow(2).sum((1, 2)).mean())}
    if not knobs["reg"]:
        return {}
    _, stats = dense_weights(V, X.double().masked_fill(pad, 0.0), G.double().masked_fill(pad, 0.0), J,
                             torch.ones(len(V), dtype=torch.float64, device=V.device), -1.0, 0.0, 0.0, 0.0)
    return {k: 0.6 * float((stats[k] ** 2).mean()) for k in ("e", "f")}


@pytest.mark.parametrize("route", ["gram", "mat", "mat_chunked"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (48, 4), (4, 48)], ids=["full", "full_t", "lora_A", "lora_B"])
@pytest.mark.parametrize("dtype", HALF)
def test_layer_grads_half_operands_match_float64_oracle(dtype, shape, variant, route, operands):
    d_in, d_out = shape
    knobs = VARIANTS[variant]
    X64, G64, mask, A = random_layer(d_in, d_out, seed=d_in * 100 + d_out)
    X, G = X64.to(dtype), G64.to(dtype)  # the layer's half inputs
    # "mat_chunked": a budget below V's size, so V is not kept and the final gradient is the row-scaled GEMM.
    budget = 512 if route == "mat_chunked" else costs.DEFAULT_BUDGET_BYTES
    ctx = ISOPOBackward(isopo_settings(**knobs, route=route.split("_")[0], budget_bytes=budget, fisher_tokens=9,
                                      force_half_operands=operands))
    mb = MicroBatch(mask=mask, advantages=A, seed=5)
    J = ctx.fisher_sample("layer", mb)  # the on-device sample the layer draws (deterministic per seed)
    J = J[mask.reshape(-1)[J]]  # its valid positions (9 of ~35: all of them)
    hist = history(X, G, mask, J, knobs)
    ctx.ema.ema = {f"layer/{k}": v for k, v in hist.items()}
    gw, gb = ctx.layer_grads("layer", X, G, mb, True)
    w = ctx.records[-1][5]
    assert gw.dtype == gb.dtype == w.dtype == torch.float32
    assert torch.isfinite(gw).all() and torch.isfinite(gb).all()
    # Same (half-rounded) inputs in float64: only the computation differs. Statistics and coefficients are float32
    # sums of exact products: ~1e-7 measured.
    w_r, gw_r, gb_r = layer_oracle(X, G, mask, J, A, knobs, hist)
    assert rel_err(w.double(), w_r) < COEF_TOL
    # Gradient: float32 sums, plus without a kept V one rounding (<= u per element) of the scaled narrower operand
    # and, bf16 "upcast" (CPU), one of the result; 4u leaves room for cancellation between sequences of opposite sign
    # (measured <= 0.6u "half", <= 0.9u "upcast"). fp16 "upcast" keeps float32 throughout.
    tol = 1e-5 if float32_throughout(dtype, X.device, operands) else 4 * U[dtype]
    assert rel_err(gw.double(), gw_r) < tol
    assert rel_err(gb.double(), gb_r) < tol
    # The unrounded float64 inputs: the inputs' own rounding (u per element of X and G) dominates (measured ~1.3u).
    w_x, gw_x, _ = layer_oracle(X64, G64, mask, J, A, knobs, hist)
    assert rel_err(gw.double(), gw_x) < 8 * U[dtype]
    assert rel_err(w.double(), w_x) < 8 * U[dtype]


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)], ids=["scale_G", "scale_X"])
def test_cpu_bf16_final_gemm_has_autograd_precision(shape):
    """On CPU the bf16 final GEMM rounds its result once to bf16, as autograd's own weight gradient of a bf16 layer
    does: with all coefficients 1 the layer gradient is within 1.5x autograd's error (float64 oracle), and it is not
    a float32-output GEMM (whose error would be ~1e-7 of the same rounded operands). Where the device has that
    float32-output GEMM (CUDA: the half-operand path) the final gradient is one: ~1e-7, far below autograd's."""
    d_in, d_out = shape
    X64, G64, mask, _ = random_layer(d_in, d_out, seed=11)
    pad = ~mask.unsqueeze(-1)
    X, G = X64.masked_fill(pad, 0.0).bfloat16(), G64.masked_fill(pad, 0.0).bfloat16()
    ctx = ISOPOBackward(isopo_settings(p=-1.0, reg=0.0, route="gram", fisher_tokens=0))
    ctx.weight_override = lambda name, adv: torch.ones_like(adv)
    gw, _ = ctx.layer_grads("layer", X, G, MicroBatch(mask=mask, advantages=torch.ones(5, device=DEVICE)), False)
    want = torch.einsum("blo,bli->oi", G.double(), X.double())
    autograd = (G.reshape(-1, d_out).T @ X.reshape(-1, d_in)).double()  # what autograd computes for the layer
    if precision.keeps_half_operands(torch.bfloat16, X.device):
        assert rel_err(gw.double(), want) < 1e-5 < rel_err(autograd, want)
    else:
        assert 1e-4 < rel_err(gw.double(), want) < 1.5 * rel_err(autograd, want) + 1e-6


def test_half_final_gemm_cannot_overflow_fp16():
    """Coefficients of 1e6 (x an output gradient of ~1 overflows fp16's 65504): the scaled rows are divided by
    max|w| before the rounding to fp16 and the float32 result multiplied back, so the gradient stays finite."""
    X64, G64, mask, A = random_layer(40, 24, seed=3)  # G (24 wide) is the scaled operand
    X, G = X64.half(), (G64 * 10).half()
    ctx = ISOPOBackward(isopo_settings(p=-1.0, reg=0.0, route="gram", fisher_tokens=0, force_half_operands=True))
    ctx.weight_override = lambda name, adv: adv * 1e6
    gw, _ = ctx.layer_grads("layer", X, G, MicroBatch(mask=mask, advantages=A), False)
    pad = ~mask.unsqueeze(-1)
    V = torch.einsum("blo,bli->boi", G.double().masked_fill(pad, 0.0), X.double().masked_fill(pad, 0.0))
    want = torch.einsum("b,boi->oi", A.double() * 1e6, V)
    assert torch.isfinite(gw).all()
    assert rel_err(gw.double(), want) < 4 * U[torch.float16]


def test_matmul_f32_accumulates_in_float32():
    """A long bf16 dot product: float32 accumulation keeps ~1e-7; rounding the sum to bf16 would cost ~1e-3."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 4096, generator=g).to(DEVICE, torch.bfloat16)
    b = torch.randn(4096, 5, generator=g).to(DEVICE, torch.bfloat16)
    want = a.double() @ b.double()
    got = precision.matmul_f32(a, b)
    assert got.dtype == torch.float32 and rel_err(got.double(), want) < 1e-6
    got3 = precision.matmul_f32(a.view(1, 3, 4096).expand(2, 3, 4096), b)  # (B, m, k) @ (k, n)
    assert got3.shape == (2, 3, 5) and rel_err(got3[1].double(), want) < 1e-6
    got_b = precision.matmul_f32(a.unsqueeze(0), b.unsqueeze(0))  # bmm
    assert got_b.dtype == torch.float32 and rel_err(got_b[0].double(), want) < 1e-6
    assert rel_err((a @ b).double(), want) > 1e-4  # what the half GEMM alone returns


# ------------------------------------------------------------------- a small model through the trainer's loss path
def lora(model):
    lc = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                    task_type="CAUSAL_LM", init_lora_weights=False)
    return get_peft_model(model, lc, autocast_adapter_dtype=False)  # adapters in the base dtype (bf16 / fp16)


@pytest.fixture(scope="module", params=[
    pytest.param((torch.bfloat16, "full"), id="bf16-full"),
    pytest.param((torch.bfloat16, "lora"), id="bf16-lora"),
    pytest.param((torch.float16, "full"), id="fp16-full"),
    pytest.param((torch.float32, "autocast"), id="bf16-autocast"),
])
def model_setup(request, tiny_tokenizer, tmp_path_factory):
    """A half model (or a float32 one run under bf16 autocast on the test device), and the float64 oracle data of the
    same weights."""
    dtype, kind = request.param
    model = build_tiny_causal_lm(tiny_tokenizer, dtype=torch.float64, seed=1).to(dtype)
    if kind == "lora":
        model = lora(model)
    model64 = copy.deepcopy(model).to(torch.float64)  # the same weights, exactly
    tmp = tmp_path_factory.mktemp(f"half-{kind}")
    trainer = make_trainer(model, tiny_tokenizer, tmp / "half")
    trainer64 = make_trainer(model64, tiny_tokenizer, tmp / "f64")
    inputs = make_batch(tiny_tokenizer)
    data = per_sequence_data(trainer64, inputs)
    return trainer, inputs, data, dtype, kind


@pytest.mark.parametrize("route", ["gram", "mat"])
@pytest.mark.parametrize("sample", ["all", "sampled"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_model_in_half_precision_matches_float64_oracle(model_setup, variant, sample, route, operands):
    trainer, inputs, data, dtype, kind = model_setup
    ctx = trainer.isopo_backward
    covered = trainer.isopo_coverage["covered"]
    knobs = VARIANTS[variant]
    A = inputs["advantages"]
    k = 0 if sample == "all" else 12  # the exact Fisher estimate, or an on-device sample of 12 of the 21 valid tokens
    trainer.isopo_backward.settings = isopo_settings(
        **{**ctx.settings.__dict__, "r": 0.0, "interacting": False, **knobs, "route": route, "fisher_tokens": k,
           "force_half_operands": operands}
    )
    mask = data["mask"]
    flat = mask.reshape(-1)
    seen = {}  # per layer: its inputs, Fisher sample and coefficients in the ISOPO backward

    used = {}  # per layer: the Fisher sample it read (the first layer reading an input draws it for the others)

    def sample_used(call, _orig=ctx.shared_fisher_sample):
        used[call.name] = _orig(call)
        return used[call.name]

    def record(name, x, g, mb, has_bias, _orig=ctx.layer_grads):
        out = _orig(name, x, g, mb, has_bias)
        J = used[name] if name in used else ctx.fisher_sample(name, mb)  # no sample drawn: J unused
        seen[name] = dict(x=x.detach().clone(), g=g.detach().clone(), J=J[flat[J]], w=ctx.records[-1][5], gw=out[0])
        return out

    # An EMA history (layer-dependent), stored in the trainer's units: statistics times the loss normalizer n_tok.
    n_tok = float(inputs["completion_mask"].sum())
    hist = {}
    for i, n in enumerate(covered):
        V = data["V"][n]
        if knobs.get("interacting"):
            hist[n] = {"ntk": float(V.pow(2).sum((1, 2)).mean()) * (0.5 + 0.3 * i)}
        elif knobs["reg"]:
            _, stats = dense_weights(V, data["X"][n], data["G"][n], flat.nonzero().squeeze(1), A, -1.0, 0.0, 0.0, 0.0)
            hist[n] = {s: float((stats[s] ** 2).mean()) * (0.3 + 0.2 * i) for s in ("e", "f")}
        else:
            hist[n] = {}
    ctx.ema.ema = {f"{n}/{s}": v * n_tok**2 for n, h in hist.items() for s, v in h.items()}
    ctx.layer_grads, ctx.shared_fisher_sample = record, sample_used
    trainer.model.zero_grad(set_to_none=True)
    try:
        with torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=kind == "autocast"):
            with trainer.isopo_active():
                trainer.compute_loss(trainer.model, inputs).backward()
    finally:
        del ctx.layer_grads, ctx.shared_fisher_sample
        ctx.ema.ema = {}
        ctx.ema.discard_step()
        ctx.records.clear()
        ctx.lambdas.clear()
    params = dict(trainer.model.named_parameters())
    for n, p in params.items():
        if p.grad is not None:
            assert p.grad.dtype == p.dtype and torch.isfinite(p.grad).all(), n
    for n in covered:
        s = seen[n]
        g = params[f"{n}.weight"].grad
        assert g is not None and s["w"].dtype == s["gw"].dtype == torch.float32, n
        assert s["x"].dtype == (torch.bfloat16 if kind == "autocast" else dtype), n
        # (1) The layer's own half inputs in float64: only the computation differs (see the layer test's bounds).
        w_r, gw_r, _ = layer_oracle(s["x"], s["g"], mask, s["J"], A, knobs, hist[n], n_step=len(A))
        assert rel_err(s["w"].double(), w_r) < COEF_TOL, n
        exact = float32_throughout(s["x"].dtype, s["x"].device, operands)  # no half rounding (see the layer test)
        assert rel_err(s["gw"].double(), gw_r) < (1e-5 if exact else 4 * U[s["x"].dtype]), n
        # (2) The float64 model with the same weights: the half forward's rounding of X and G dominates. Measured
        # maxima over these cases, coefficients / gradient (the plain REINFORCE gradient's own error in brackets):
        # bf16 full 1.0e-2 / 1.5e-2 [1.0e-2], bf16 LoRA 3.8e-2 / 4.8e-2 [1.9e-2: one more rounded product per
        # layer], fp16 2.3e-3 / 2.1e-3, bf16 autocast 9.2e-3 / 1.1e-2. The largest are p = -1, c = 0, where w_i = A_i
        # / f_i carries f_i's error undamped. Bounds: about twice those.
        tol = {"full": 3e-2, "lora": 8e-2, "autocast": 3e-2}[kind] if dtype != torch.float16 else 5e-3
        V = data["V"][n]
        if knobs.get("interacting"):
            Vf = V.reshape(len(A), -1)
            K = Vf @ Vf.T
            lam = knobs["interacting_reg"] * hist[n]["ntk"]
            w = lam * torch.linalg.solve(K + lam * torch.eye(len(A), dtype=K.dtype, device=K.device), A.double())
        else:
            mu = {"e": 1.0, "f": 1.0, "rho": 1.0, **hist[n]}
            w, _ = dense_weights(V, data["X"][n], data["G"][n], s["J"], A, knobs["p"], knobs["q"], 0.0, knobs["reg"],
                                 mu if knobs["reg"] else None, n_step=len(A))
        assert rel_err(s["w"].double(), w) < tol, n
        assert rel_err(g.double(), torch.einsum("b,boi->oi", w, V)) < tol, n
