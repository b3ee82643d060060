"""PROMA's cost model (`projection.proma_extra_macs`, `intra.intra_macs`) against the matrix products that
`proma_layer_step` really runs: a dispatch-level counter of mm / bmm / addmm / mv / dot multiply-accumulates, minus
autograd's own weight-gradient GEMM, must equal the model's `gemm_only` count for every mode, route, orientation,
bias, chunked V and sketch size clipped by the rows."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from math_settings import proma_settings
from trl_isopo.layerwise.inputs import SharedInput
from trl_isopo.layerwise.micro_batch import MicroBatch
from trl_isopo.proma.intra import intra_macs, sketch_size
from trl_isopo.layerwise.costs import route_costs
from trl_isopo.proma.projection import accumulation_route, proma_extra_macs, proma_layer_step


class MatmulMacs(TorchDispatchMode):
    """Multiply-accumulates of every matrix product dispatched (in-place addmm_ included, which torch's
    FlopCounterMode does not count)."""

    def __init__(self):
        super().__init__()
        self.macs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.overloadpacket.__name__
        t = [a for a in args if isinstance(a, torch.Tensor)]
        if op == "mm":
            self.macs += t[0].shape[0] * t[0].shape[1] * t[1].shape[1]
        elif op == "bmm":
            self.macs += t[0].shape[0] * t[0].shape[1] * t[0].shape[2] * t[1].shape[2]
        elif op in ("addmm", "addmm_", "baddbmm"):
            a, b = t[1], t[2]
            self.macs += a.numel() * b.shape[-1]
        elif op in ("mv", "dot"):
            self.macs += t[0].numel()
        return func(*args, **(kwargs or {}))


CASES = [  # mode, route, chained, bias, V fits the budget, intra_dim, power iterations
    ("intra", "auto", False, False, True, 5, 1),
    ("intra", "auto", True, True, True, 5, 0),
    ("intra", "auto", False, False, True, 5, 2),
    ("intra", "auto", False, True, True, 200, 1),  # k clipped to min(B L, d_in, d_out)
    ("accumulation", "mat", True, False, True, 30, 1),
    ("accumulation", "gram", True, True, True, 30, 1),
    ("accumulation", "mat", False, True, True, 30, 1),  # first micro-batch: a plain re-weighted GEMM
    ("accumulation", "mat", True, True, False, 30, 1),  # V chunked: the overlaps take one more GEMM
    ("accumulation", "auto", True, True, True, 30, 1),
]


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_model_counts_the_products_proma_layer_step_runs(case, shape):
    mode, route, chained, bias, fits, dim, q = case
    d_in, d_out = shape
    B, L = 4, 16
    budget = {} if fits else dict(budget_bytes=B * d_out * d_in * 4 - 1)
    s = proma_settings(mode=mode, route=route, intra_dim=dim, intra_power_iters=q, **budget)
    check_count(s, B, L, d_in, d_out, chained, bias)


def test_auto_route_is_priced_as_the_statistics_pick_it():
    """At B = 4, L = 8 "auto" picks "gram" for the kernel (with the per-float charge on V); the count of the products
    alone must still price the route that runs, not the one cheapest without that charge ("mat")."""
    check_count(proma_settings(mode="accumulation", route="auto"), 4, 8, 24, 40, chained=True, bias=False)


def test_auto_route_counts_the_overlaps():
    """"auto" picks accumulation's route with the overlaps <V_i, S> priced ("gram": one more weight-gradient GEMM;
    "mat": a pass over V's chunks). At B = 2, L = 32, 64 -> 128 the kernel alone would go to "gram", K and the
    overlaps together to "mat"; the step must run the pick (its product count is the model's), and at Qwen3-1.7B's
    MLP shape with V in chunks (8 x 256 tokens, 2048 -> 6144) the pick is "mat" too."""
    s = proma_settings(mode="accumulation", route="auto", budget_bytes=10**9)
    assert route_costs(2, 32, 64, 128, 0, False, True, s.budget_bytes).best == "gram"
    assert accumulation_route(s, 2, 32, 64, 128) == "mat"
    check_count(s, 2, 32, 64, 128, chained=True, bias=False)
    default = proma_settings(mode="accumulation", route="auto")
    assert route_costs(8, 256, 2048, 6144, 0, False, True, default.budget_bytes).best == "gram"
    assert accumulation_route(default, 8, 256, 2048, 6144) == "mat"


@pytest.mark.parametrize("q", [0, 1, 2])
@pytest.mark.parametrize("shape", [(24, 40), (40, 24)])
def test_model_counts_a_layer_whose_input_basis_is_shared(shape, q):
    """The second layer reading an input (k after q) runs no input range finder: `input_shared=True` prices it."""
    check_count(proma_settings(mode="intra", intra_dim=5, intra_power_iters=q), 4, 16, *shape, chained=False,
                bias=False, input_shared=True)


def check_count(s, B, L, d_in, d_out, chained, bias, input_shared=False):
    g = torch.Generator().manual_seed(d_in)
    mask = torch.rand(B, L, generator=g) > 0.2
    x = torch.randn(B, L, d_in, generator=g, dtype=torch.float64)
    gr = torch.randn(B, L, d_out, generator=g, dtype=torch.float64) * mask.unsqueeze(-1)
    running = torch.randn(d_out, d_in, generator=g, dtype=torch.float64) if chained else None
    running_bias = torch.randn(d_out, generator=g, dtype=torch.float64) if chained and bias else None
    A = torch.randn(B, generator=g, dtype=torch.float64)
    shared = None
    if input_shared:  # the first layer reading x fills the entry, outside the count
        shared = SharedInput(x, MicroBatch(mask=mask, advantages=A))
        proma_layer_step(x, gr, mask, A, s, generator=torch.Generator().manual_seed(2), shared_input=shared)
    with MatmulMacs() as counter:
        proma_layer_step(x, gr, mask, A, s, running=running, running_bias=running_bias,
                         generator=torch.Generator().manual_seed(1), has_bias=bias, shared_input=shared)
    counted = counter.macs - B * L * d_in * d_out  # autograd's weight-gradient GEMM, which PROMA replaces
    kw = dict(chained=chained, bias=bias, input_shared=input_shared)
    assert counted == proma_extra_macs(s, B, L, d_in, d_out, gemm_only=True, **kw)
    # the full model adds what is no matrix product (QRs, passes over V), never less
    assert proma_extra_macs(s, B, L, d_in, d_out, **kw) >= counted


def test_intra_closed_form():
    n, d_in, d_out, dim, q = 2048, 896, 4864, 30, 1
    k = sketch_size(dim, n, d_in, d_out)
    products, qrs = intra_macs(n, d_in, d_out, dim, q)
    assert products == 3 * n * k * (d_in + d_out) + 2 * d_in * d_out * k + 2 * d_out * k * k
    assert 0 < qrs < products / 10  # k = 30 columns: the QRs are a small share of the products
    # each of the 2q+1 passes per side streams its operand once
    assert intra_macs(n, d_in, d_out, dim, q, macs_per_float=16)[1] - qrs == 3 * n * (d_in + d_out) * 16


def test_unpriced_settings_are_refused():
    for changes in (dict(mode="both"), dict(mode="intra", intra_target="accumulated")):
        with pytest.raises(ValueError, match="prices mode"):
            proma_extra_macs(proma_settings(**changes), 4, 16, 24, 40)
