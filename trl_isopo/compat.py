"""Names that differ between the transformers / TRL versions this package is tested with (pyproject.toml's range).

A name that differs across that range is resolved here once, from the installed library, so a release that renames
it is met in one place. (TRL private names used elsewhere in the package are not gathered here yet.)"""

from __future__ import annotations

import dataclasses

from transformers import TrainingArguments

_TRAINING_FIELDS = {f.name for f in dataclasses.fields(TrainingArguments)}

# transformers >= 5.18 names it `activation_checkpointing` (`gradient_checkpointing` stays as a deprecated alias that
# prints a FutureWarning); transformers 5.17 only has `gradient_checkpointing`.
CHECKPOINTING_FIELD = "activation_checkpointing" if "activation_checkpointing" in _TRAINING_FIELDS else (
    "gradient_checkpointing")
