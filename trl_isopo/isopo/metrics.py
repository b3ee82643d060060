"""Per-step metrics of ISOPO's backward: one record per covered-layer call, reduced once per optimizer step."""

from __future__ import annotations

from collections import defaultdict

import torch

# The logged metrics (`isopo/<name>`), in the order the trainer reduces them over processes.
METRIC_NAMES = ("euclidean_norm", "fisher_norm", "rel_overlap", "scale_mean", "scale_std", "scale_spread", "ntk_lambda",
                "nonfinite_coefficients")

class StepMetrics:
    """The step's records: per covered-layer call one (6, B) tensor, rows (e, f, rho, scale, A, w) (a statistic not
    computed repeats another: e = f for p alone; interacting: scale = alpha), and the interacting variant's lam per
    call. Kept on the device during the step (no host read per layer); `reduce` reads them once."""

    def __init__(self):
        self.records: list[torch.Tensor] = []
        self.lambdas: list = []

    def keep(self, record: torch.Tensor, lam=None) -> None:
        if lam is not None:
            self.lambdas.append(lam)
        self.records.append(record)

    def reduce(self, settings) -> dict[str, tuple[float, float]]:
        """{metric: (sum over layer calls, number of layer calls)} of this step's records; clears them. `settings`:
        the `ISOPOSettings` the records were made with.

        Per layer call: euclidean_norm (when e is computed, see `ISOPOSettings.needs_euclidean`) / fisher_norm /
        rel_overlap are means over the micro-batch's sequences;
        scale_mean / scale_std the mean and std of the per-sequence scale (the coefficient over the advantage; 1 =
        REINFORCE) over sequences with a nonzero layer gradient (and, interacting, a nonzero advantage);
        scale_spread the coefficient of variation scale_std / scale_mean of the same sequences (a layer call with
        fewer than 2 such sequences or a zero mean is left out): ~0 means the layer's update is REINFORCE times a
        per-layer constant;
        nonfinite_coefficients counts dropped coefficients; ntk_lambda is lam (interacting), in the units of the
        normalization-free kernel (`MicroBatch.stat_scale`).
        """
        s = settings
        out = {}
        groups = defaultdict(list)
        for rec in self.records:
            groups[tuple(rec.shape)].append(rec)
        for recs in groups.values():
            e, f, rho, scale, A, w = torch.stack(recs).to("cpu", torch.float64).unbind(1)  # each (n, B)
            keep = e > 0  # sequences with a nonzero gradient in this layer (f > 0 when e is not computed)
            if s.interacting:
                scale = scale / torch.where(A != 0, A, 1.0)  # alpha_i / A_i
                keep = keep & (A != 0)
            n_keep = keep.sum(1).clamp_min(1)
            mean = torch.where(keep, scale, 0.0).sum(1) / n_keep
            std = (torch.where(keep, (scale - mean.unsqueeze(1)) ** 2, 0.0).sum(1) / n_keep).sqrt()
            parts = {"scale_mean": mean, "scale_std": std}
            spread_ok = (keep.sum(1) >= 2) & (mean != 0) & torch.isfinite(std / mean)
            if bool(spread_ok.any()):
                parts["scale_spread"] = (std / mean).abs()[spread_ok]
            if s.needs_euclidean:
                parts["euclidean_norm"] = e.mean(1)
            if s.needs_fisher:
                parts["fisher_norm"] = f.mean(1)
            if not s.interacting and s.r != 0:
                parts["rel_overlap"] = rho.mean(1)
            parts["nonfinite_coefficients"] = (~torch.isfinite(w)).sum(1).double()
            for k, v in parts.items():
                total, count = out.get(k, (0.0, 0.0))
                out[k] = (total + float(v.sum()), count + v.numel())
        if self.lambdas:
            lam = torch.stack([torch.as_tensor(x, dtype=torch.float64).cpu() for x in self.lambdas])
            out["ntk_lambda"] = (float(lam.sum()), float(lam.numel()))
        self.records.clear()
        self.lambdas.clear()
        return out
