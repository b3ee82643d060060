"""`PackageTrainer`: what every trainer of this package does around GRPOTrainer's constructor, once.

GRPOTrainer 1.16's constructor signature (names, order, defaults: tests/test_isopo_trainer.py checks it), the
default config named after the model, the config's type checked, the seam's checks of the GRPOTrainer hooks and
state the package relies on (`compat.check_grpo_hooks` / `check_grpo_state`) and vLLM's CPU weight sync. A trainer
sets `config_class` and `_name` (TRL's model-card name) and fills in `_check_args` (before TRL builds anything) and `_after_init`.
"""

from __future__ import annotations

from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import get_config_model_id

from .compat import check_grpo_hooks, check_grpo_state
from .vllm_cpu import apply_cpu_weight_sync


class PackageTrainer(GRPOTrainer):
    """A GRPOTrainer subclass of this package (see the module docstring)."""

    config_class: type[GRPOConfig] = GRPOConfig
    _short_name: str | None = None  # the default config's output_dir suffix "<model>-<short name>"; None: `_name`

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
    ):
        check_grpo_hooks(type(self).__name__)
        if args is None:
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            args = self.config_class(f"{model_name.split('/')[-1]}-{self._short_name or self._name}")
        if not isinstance(args, self.config_class):
            name = self.config_class.__name__
            article = "an" if name[0] in "AEIOU" else "a"
            raise TypeError(f"{type(self).__name__} needs {article} {name}, got {type(args).__name__}.")
        self._check_args(args)
        super().__init__(
            model, reward_funcs, args, train_dataset, eval_dataset, processing_class, reward_processing_classes,
            callbacks, optimizers, quantization_config, peft_config, tools, rollout_func, environment_factory,
        )
        check_grpo_state(self)
        apply_cpu_weight_sync(self)  # TRL's weight sync cannot write into vLLM's packed CPU layers
        self._after_init(args)

    def _check_args(self, args) -> None:
        """Refuse a configuration before TRL builds the trainer, with what to change (a config's fields may have been
        changed after its own checks ran); set up state TRL's constructor may already read."""

    def _after_init(self, args) -> None:
        """The trainer's own set-up once GRPOTrainer's is done."""
