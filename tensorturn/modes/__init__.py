"""Run modes as plug-ins: each mode is a package ``tensorturn.modes.<name>`` whose ``MODE`` object
follows :class:`Mode`, and whose ``tasks`` module holds its Celery tasks.

Adding a mode is its own package plus one line in :data:`tensorturn.registry.REGISTRY`. The plug-in object and its
options import no torch (the CLI validates a run with them); its ``tasks`` module does.
"""

from __future__ import annotations

import importlib
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tensorturn.recipes import Recipe
    from tensorturn.spec import ModeOptions, RunSpec
    from tensorturn.state.board import RunBoard
    from tensorturn.store.objects import Store

from tensorturn.registry import REGISTRY, get_mode, mode_names, option_owner, task_modules

__all__ = ["REGISTRY", "Mode", "ModeBase", "get_mode", "mode_names", "option_owner", "task_modules"]


class Mode(Protocol):
    """What the rest of TensorTurn knows of a mode."""

    name: str
    Options: type["ModeOptions"]
    unit: str  # what progress counts: "rounds", "segments", ...

    def prepare(self, spec: "RunSpec", online_workers: int) -> None:
        """Fill options that depend on the pool (say, one ensemble member per machine)."""

    def size(self, spec: "RunSpec", workers: int) -> None:
        """Fill what the pool's size decides, for a pool of ``workers`` machines."""

    def model_configs(self, spec: "RunSpec", recipe: "Recipe") -> list[dict[str, Any]]:
        """The model configurations the run trains (the memory check takes the largest)."""

    def start(self, spec: "RunSpec", store: "Store", board: "RunBoard", allow: Collection[str] = ()) -> None:
        """Store what the run starts from, record it on the board, queue its first work.
        ``allow``: recipe names allowed here besides the machine's allowlist (those the user who
        starts the run in this process named; :func:`tensorturn.recipes.resolve`)."""

    def resume(self, spec: "RunSpec", store: "Store", board: "RunBoard", allow: Collection[str] = ()) -> str:
        """Queue whatever is missing from the store; say what was resumed (``allow``: as for
        :meth:`start`)."""

    def progress(self, doc: dict[str, Any]) -> tuple[int, int, list[tuple[str, str]]]:
        """(units done, units in all, [(event key, one line)]) from a run's description."""

    def live_line(self, doc: dict[str, Any], width: int = 80) -> str:
        """What the run is doing now, in one line of at most ``width`` columns ("" if nothing
        to say), from the live parts of its description (:mod:`tensorturn.state.live`)."""


class ModeBase:
    """What modes share: a name, an options class, what progress counts, and the mode's
    ``tasks`` module, where the torch-heavy work (starting and resuming a run) is imported only
    when a run starts."""

    def __init__(self, name: str, options: type["ModeOptions"], unit: str, tasks: str):
        self.name, self.Options, self.unit, self.tasks = name, options, unit, tasks

    def prepare(self, spec: "RunSpec", online_workers: int) -> None:
        pass

    def size(self, spec: "RunSpec", workers: int) -> None:
        """Fill in what the pool's size decides (ensemble members by default), for a pool of
        ``workers`` machines: an embedded pool's, known before its agents are all up."""

    def start(self, spec: "RunSpec", store: "Store", board: "RunBoard", allow: Collection[str] = ()) -> None:
        importlib.import_module(self.tasks).start(spec, store, board, allow)

    def resume(self, spec: "RunSpec", store: "Store", board: "RunBoard", allow: Collection[str] = ()) -> str:
        return importlib.import_module(self.tasks).resume(spec, store, board, allow)

    def live_line(self, doc: dict[str, Any], width: int = 80) -> str:
        return ""
