"""The Fisher token sample J: which positions of a micro-batch the Fisher norm estimate reads, per layer."""

from __future__ import annotations

import torch

from .micro_batch import MicroBatch


def fisher_token_sample(mask: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """A Fisher token sample of fixed size min(k, B*L) for mask (B, L) bool: flat indices (S,) into B*L.

    Its valid positions are a uniform sample without replacement of min(k, N_valid) of the N_valid valid positions
    (the k smallest of i.i.d. uniform keys, padding keyed +inf); when N_valid < k, the remaining picks are padding
    positions, whose zeroed operand row adds exactly 0 to the Fisher numerator and denominator. So the estimate has
    the distribution of a sample of the valid positions alone, while nothing reads N_valid on the host. float64
    keys: ties (whose order `topk` may break unevenly) have probability ~(B L)^2 / 2^53.
    """
    keys = torch.rand(mask.numel(), generator=generator, device=mask.device, dtype=torch.float64)
    keys.masked_fill_(~mask.reshape(-1), torch.inf)
    return keys.topk(min(k, keys.numel()), largest=False, sorted=False).indices


class FisherSampler:
    """Draws `fisher_token_sample`s from one generator per device, re-seeded per (micro-batch seed, layer index).

    `override`: {layer name: (S,) indices} used instead of drawing (tests: a fixed sample per layer), or None.
    """

    def __init__(self):
        self._generators: dict[torch.device, torch.Generator] = {}
        self.override: dict[str, torch.Tensor] | None = None

    def draw(self, name: str, index: int, k: int, mb: MicroBatch, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Flat indices (S,) into B*L of J, drawn on the mask's device (`fisher_token_sample`): uniform without
        replacement among the valid positions, |J| = min(k, N_valid), padded with padding positions to the fixed
        size S = min(k, B*L); all B*L positions (the exact estimate) for k <= 0 or k >= B*L.

        Fresh per layer and micro-batch, from a generator on the data's device seeded by (micro-batch seed, layer
        `index`): reproducible for a given seed and device type, independent of the global RNG, and no host-device
        copy. (CPU and CUDA generators give different, equally distributed, samples for one seed.)
        `mask`: another (B, L') pool than the micro-batch's positions (the LM head's scored positions).
        """
        if self.override is not None:
            return self.override[name].to(mb.mask.device)
        pool = mb.mask if mask is None else mask
        device = pool.device
        if k <= 0 or k >= pool.numel():
            return mb.positions(device) if mask is None else torch.arange(pool.numel(), device=device)
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        gen.manual_seed((mb.seed * 1_000_003 + 7919 * index) % (2**63))
        return fisher_token_sample(pool, k, gen)
