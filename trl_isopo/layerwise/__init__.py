"""The method-neutral per-layer engine: what ISOPO and PROMA share to rebuild each covered linear layer's gradient
inside one backward pass. A method passes its own name (`MethodName`) and rule (`LayerBackward.grads`) in; nothing
here names a method. The protocol: docs/layerwise.md.

`LayerwiseTrainer` (the trainer of a rule) loads TRL and is resolved lazily; the rest imports with torch alone.
"""

from ..lazy import lazy_getattr
from .engine import LayerBackward
from .micro_batch import MicroBatch
from .rule import LayerCall, LayerGrads, MethodName

_EXPORTS = {"LayerwiseTrainer": ".trainer"}

__all__ = ["LayerBackward", "LayerCall", "LayerGrads", "LayerwiseTrainer", "MethodName", "MicroBatch"]

__getattr__ = lazy_getattr(__name__, _EXPORTS)
