"""Lazy package attributes (PEP 562): a name's module is imported on first access, so importing a package stays cheap
(the trainers and configs load TRL; the math does not)."""

from importlib import import_module


def lazy_getattr(package: str, exports: dict[str, str]):
    """A module-level `__getattr__` for `package` that resolves each name of `exports` (name -> module, absolute or
    relative to `package`) by importing its module."""

    def __getattr__(name: str):
        if name in exports:
            return getattr(import_module(exports[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
