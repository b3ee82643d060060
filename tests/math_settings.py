"""Settings for the tests that drive the per-layer math directly, every value named here once.

The package's settings classes have no defaults: a config holds them, and `ISOPOConfig.isopo_settings` /
`PROMAConfig.proma_settings` build the settings from it. A test that builds settings without a config starts from
the values below and names what it changes.
"""

from trl_isopo.layerwise.costs import DEFAULT_BUDGET_BYTES
from trl_isopo.isopo.isopo_backward import ISOPOSettings
from trl_isopo.proma.projection import PROMASettings

# ISOPOConfig's defaults except reg: c = 1, the regularized form (EMA reference points) the math tests exercise; the
# config's default is c = 0.
ISOPO_BASE = dict(p=-1.0, q=0.0, r=0.0, reg=1.0, reg_reference="ema_mean", ema_decay=0.9, fisher_tokens=250,
                  interacting=False, interacting_reg=1.0, route="auto", budget_bytes=DEFAULT_BUDGET_BYTES, seed=0,
                  force_half_operands=False)
# PROMAConfig's defaults.
PROMA_BASE = dict(mode="accumulation", shrinkage=1.0, ridge=1e-2, solver="solve", sweeps=2, relative_bound=None,
                  intra_dim=30, intra_power_iters=1, intra_shrinkage=1.0, intra_target="microbatch", route="auto",
                  budget_bytes=DEFAULT_BUDGET_BYTES)


def isopo_settings(**changes) -> ISOPOSettings:
    return ISOPOSettings(**{**ISOPO_BASE, **changes})


def proma_settings(**changes) -> PROMASettings:
    return PROMASettings(**{**PROMA_BASE, **changes})
