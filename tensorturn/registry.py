"""The mode registry: a mode's name → its package. One line here adds a mode.

A leaf of the vocabulary (of TensorTurn it imports only its errors, and a mode's package only by
name when it is asked for): the spec, the CLI and the Celery app look modes up here without
importing the modes, which sit high above them.
"""

from __future__ import annotations

import importlib
from dataclasses import fields
from typing import Any

REGISTRY: dict[str, str] = {
    "fused": "tensorturn.modes.fused",
    "ensemble": "tensorturn.modes.ensemble",
}


def mode_names() -> list[str]:
    return list(REGISTRY)


def get_mode(name: str) -> Any:
    """The mode's plug-in (a :class:`tensorturn.modes.Mode`); SpecError for an unknown name."""
    from tensorturn.errors import SpecError

    if name not in REGISTRY:
        raise SpecError(f"unknown mode {name!r}: choose {' or '.join(REGISTRY)}")
    return importlib.import_module(REGISTRY[name]).MODE


def task_modules() -> list[str]:
    """Every mode's tasks module (the Celery app includes them)."""
    return [f"{path}.tasks" for path in REGISTRY.values()]


def option_owner(field: str) -> str | None:
    """The mode whose options include ``field``, if any."""
    for name in REGISTRY:
        if field in {f.name for f in fields(get_mode(name).Options)}:
            return name
    return None
