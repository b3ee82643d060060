"""How a per-layer method names itself in errors, config fields, coverage and metric keys."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MethodName:
    """A method's name as the engine prints it: `title` in messages ("ISOPO"), `prefix` in its config fields
    (`isopo_lm_head`), coverage keys (`isopo_layers`) and logged metrics (`isopo/scale_mean`)."""

    title: str
    prefix: str

    def field(self, name: str) -> str:
        """The method's config field or coverage key `name`: "lm_head" -> "isopo_lm_head"."""
        return f"{self.prefix}_{name}"

    def metric(self, name: str) -> str:
        """The logged metric `name`: "scale_mean" -> "isopo/scale_mean"."""
        return f"{self.prefix}/{name}"
