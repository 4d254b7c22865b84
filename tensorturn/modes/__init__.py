"""Run modes as plug-ins: each mode is a package ``tensorturn.modes.<name>`` whose ``MODE`` object
follows :class:`Mode`, and whose ``tasks`` module holds its Celery tasks.

Adding a mode is its own package plus one line in :data:`REGISTRY`. The plug-in object and its
options import no torch (the CLI validates a run with them); its ``tasks`` module does.
"""

from __future__ import annotations

import importlib
from dataclasses import fields
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ..board import RunBoard
    from ..recipes import Recipe
    from ..spec import ModeOptions, RunSpec
    from ..store import Store

REGISTRY: dict[str, str] = {
    "fused": "tensorturn.modes.fused",
    "ensemble": "tensorturn.modes.ensemble",
}


class Mode(Protocol):
    """What the rest of TensorTurn knows of a mode."""

    name: str
    Options: type["ModeOptions"]
    unit: str  # what progress counts: "rounds", "segments", ...

    def prepare(self, spec: "RunSpec", online_workers: int) -> None:
        """Fill options that depend on the pool (say, one ensemble member per machine)."""

    def model_configs(self, spec: "RunSpec", recipe: "Recipe") -> list[dict[str, Any]]:
        """The model configurations the run trains (the memory check takes the largest)."""

    def start(self, spec: "RunSpec", store: "Store", board: "RunBoard") -> None:
        """Store what the run starts from, record it on the board, queue its first work."""

    def resume(self, spec: "RunSpec", store: "Store", board: "RunBoard") -> str:
        """Queue whatever is missing from the store; say what was resumed."""

    def progress(self, doc: dict[str, Any]) -> tuple[int, int, list[tuple[str, str]]]:
        """(units done, units in all, [(event key, one line)]) from a run's description."""

    def final_key(self, run_id: str) -> str:
        """Where the run's result lives in the store."""


class ModeBase:
    """What modes share: a name, an options class, what progress counts, and the mode's
    ``tasks`` module, where the torch-heavy work (starting and resuming a run) is imported only
    when a run starts."""

    def __init__(self, name: str, options: type["ModeOptions"], unit: str, tasks: str):
        self.name, self.Options, self.unit, self.tasks = name, options, unit, tasks

    def prepare(self, spec: "RunSpec", online_workers: int) -> None:
        pass

    def start(self, spec: "RunSpec", store: "Store", board: "RunBoard") -> None:
        importlib.import_module(self.tasks).start(spec, store, board)

    def resume(self, spec: "RunSpec", store: "Store", board: "RunBoard") -> str:
        return importlib.import_module(self.tasks).resume(spec, store, board)


def mode_names() -> list[str]:
    return list(REGISTRY)


def get_mode(name: str) -> Mode:
    from ..errors import SpecError

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
