"""Checks of the float64 PROMA oracle itself (tests/proma_oracle.py)."""

import torch
from proma_oracle import F64, assert_matches, flat, micro_batch, oracle_fit


def test_per_sequence_gradients_sum_to_the_captured_layer_gradient():
    for pad in ("x_zero", "g_zero"):
        X, G, mask, A, V = micro_batch(pad=pad, empty_row=True)
        m = mask.unsqueeze(-1)
        dense = torch.einsum("blo,bli->boi", torch.where(m, G, 0.0), torch.where(m, X, 0.0))
        assert (V - dense).abs().max() < 1e-12
        assert V[2].abs().max() == 0  # the empty sequence


def test_oracle_fit_limits():
    X, G, mask, A, V = micro_batch(seed=3)
    S = torch.randn(V.shape[1:], dtype=F64)
    exact = oracle_fit(V, S, solver="exact")
    assert_matches(oracle_fit(V, S, 1e-14), exact)  # lam -> 0
    assert oracle_fit(V, S, 1e14).norm() < 1e-12 * S.norm()  # lam -> inf
    assert_matches(oracle_fit(V, S, solver="gram_schmidt", sweeps=200), exact)
    residual = S.reshape(-1) - exact
    assert (flat(V) @ residual).abs().max() < 1e-12 * S.norm() * flat(V).norm()
