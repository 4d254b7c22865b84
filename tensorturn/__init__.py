"""TensorTurn: train one model on several machines you own (fused DiLoCo or ensemble runs).

The Python API (:mod:`tensorturn.api`): ``tensorturn.Pool``, ``tensorturn.Run``, and
``tensorturn.load(DIR)`` for an exported model (:mod:`tensorturn.export`). They are imported on
first use: ``import tensorturn`` loads neither torch nor Celery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorturn.api import Pool, Run
    from tensorturn.export import load

__version__ = "0.1.0"
__all__ = ["Pool", "Run", "load", "__version__"]

# name → the module that defines it (PEP 562: a module's __getattr__ answers names it lacks)
_LAZY = {"Pool": "tensorturn.api", "Run": "tensorturn.api", "load": "tensorturn.export"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tensorturn' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
