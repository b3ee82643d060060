"""PROMA's backward object: `PROMABackward`, the `layerwise.engine.LayerBackward` whose per-layer weight gradient is
the PROMA increment dS_m of `projection.proma_layer_step` (docs/proma.md).

The shared machinery (the covered-linear autograd Function, the micro-batch window, `plain()` mode for the KL pass,
input masking, call tracking, other-parameter handling) is the base class's; here only PROMA's state around one layer
call: the running gradients S of every covered layer on this process (`PROMALayerState`, reset by the trainer at the
first micro-batch of each optimizer step, never read from `.grad`), the sketch generator's seed and the metrics.

What varies per micro-batch (its index in the optimizer step, the skip gate's decision, the sketch seed's key) is
bound into the micro-batch itself (`PROMAMicroBatch`), so a checkpoint recompute or a late backward sees the values of
the micro-batch it belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layerwise.engine import LayerBackward
from ..layerwise.micro_batch import MicroBatch
from ..layerwise.rule import LayerCall, LayerGrads, MethodName
from .projection import METRIC_NAMES, PROMALayerState, PROMASettings, proma_layer_step, sketch_seed

_ACTIVE = METRIC_NAMES.index("active")
# Metrics of the accumulation variant: averaged over the calls that had a running gradient to project (not the
# first micro-batch of a step, whose S is zero); the intra ones over every projected call.
ACCUMULATION_METRICS = ("running_norm", "projected_fraction", "bound_factor", "reduction_pct")
INTRA_METRICS = ("intra_rank", "intra_fraction", "intra_reduction_pct")


@dataclass(frozen=True)
class PROMAMicroBatch(MicroBatch):
    """`MicroBatch` plus PROMA's per-micro-batch values.

    index: 0-based position of the micro-batch in this process's optimizer step.
    active: the skip gate's decision (`projection.projection_active`).
    sketch_key: integers that, with the layer index, seed the intra sketches (`projection.sketch_seed`): (seed,
        process index, global step, index).
    """

    index: int = 0
    active: bool = True
    sketch_key: tuple = ()


PROMA = MethodName(title="PROMA", prefix="proma")


class PROMABackward(LayerBackward):
    """PROMA's per-layer backward (module docstring). `settings`: `PROMASettings`."""

    def __init__(self, settings: PROMASettings):
        super().__init__(PROMA)
        self.settings = settings
        self.states: dict[str, PROMALayerState] = {}
        # Device sums of the metric vectors since the last `pop_metrics`: over every layer call, and over the calls
        # with a running gradient (the accumulation metrics). No host read in the backward.
        self._sum_all: torch.Tensor | None = None
        self._sum_chain: torch.Tensor | None = None

    def start_step(self) -> None:
        """Forget every layer's running gradient: called by the trainer before the first micro-batch of each
        optimizer step."""
        for state in self.states.values():
            state.reset()

    def generator(self, name: str, mb: PROMAMicroBatch, device: torch.device) -> torch.Generator:
        """A fresh generator for layer `name`'s sketches in `mb` (the global RNG is never drawn from)."""
        return torch.Generator(device=device).manual_seed(sketch_seed(*mb.sketch_key, self.layer_index[name]))

    def grads(self, call: LayerCall) -> LayerGrads:
        """dS_m of one covered layer (and of its bias) in one micro-batch (`projection.proma_layer_step`)."""
        name, mb = call.name, call.mb
        if self.calls.get(name, 0) > 1:
            # A second backward of the same module in one micro-batch would project against an S that already holds
            # this micro-batch's first increment.
            raise RuntimeError(
                f"PROMA: covered layer {name} ran twice in one micro-batch (a module called twice per forward, or a "
                "weight shared between modules). Freeze it or exclude it from the LoRA target_modules."
            )
        if not isinstance(mb, PROMAMicroBatch):
            raise TypeError("PROMABackward's window needs a PROMAMicroBatch")
        s = self.settings
        state = self.states.setdefault(name, PROMALayerState())
        chained = state.weight is not None
        generator = self.generator(name, mb, call.X.device) if s.intra and mb.active else None
        out = proma_layer_step(
            call.X, call.G, mb.mask, call.advantages, s, running=state.weight, running_bias=state.bias,
            generator=generator, active=mb.active, has_bias=call.has_bias, scratch=self.scratch,
            keep_running=s.needs_running, shared_input=call.shared_input,
        )  # fmt: skip
        state.update(out)
        self._keep(out.metrics, chained)
        return LayerGrads(out.grad_weight, out.grad_bias)

    def _keep(self, metrics: torch.Tensor, chained: bool) -> None:
        metrics = metrics.detach().to(torch.float64)
        if self._sum_all is None or self._sum_all.device != metrics.device:
            self._sum_all = torch.zeros_like(metrics)
            self._sum_chain = torch.zeros_like(metrics)
        self._sum_all += metrics
        if chained:
            self._sum_chain += metrics

    def pop_metrics(self, device: torch.device | None = None) -> torch.Tensor:
        """(2, len(METRIC_NAMES)) float64: the metric sums over every layer call and over the calls with a running
        gradient since the last call (on `device`; zeros if none), and clears them. Reduce over processes, then
        `metric_means`."""
        if self._sum_all is None:
            return torch.zeros(2, len(METRIC_NAMES), dtype=torch.float64, device=device)
        out = torch.stack([self._sum_all, self._sum_chain]).to(device or self._sum_all.device)
        self._sum_all = self._sum_chain = None
        return out

    def log_metrics(self, reduce) -> dict[str, float]:
        """The metric means since the last log over all processes (`reduce`: sum over processes, to the host)."""
        return self.metric_means(reduce(self.pop_metrics()))

    def metric_means(self, sums: torch.Tensor) -> dict[str, float]:
        """{"proma/<name>": mean over active layer calls} from `pop_metrics`' sums (host values), for the variants
        that run; empty where no call was projected."""
        every, chain = sums.tolist()
        out = {}
        if self.settings.accumulation and chain[_ACTIVE] > 0:
            out.update({self.method.metric(n): chain[METRIC_NAMES.index(n)] / chain[_ACTIVE]
                        for n in ACCUMULATION_METRICS})
        if self.settings.intra and every[_ACTIVE] > 0:
            out.update({self.method.metric(n): every[METRIC_NAMES.index(n)] / every[_ACTIVE] for n in INTRA_METRICS})
        return out
