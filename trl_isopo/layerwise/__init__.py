"""The method-neutral per-layer engine: what ISOPO and PROMA share to rebuild each covered linear layer's gradient
inside one backward pass. A method passes its own name (`MethodName`) and rule in; nothing here names a method."""

from .method import MethodName

__all__ = ["MethodName"]
