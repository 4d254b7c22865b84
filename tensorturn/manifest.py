"""A run in the object store: its spec and its manifest (the board's description, saved).

With these and the outputs a run can be rebuilt without Redis (``tensorturn resume``).
"""

from __future__ import annotations

import logging
from typing import Any

from . import layout
from .board import RunBoard
from .errors import StoreError
from .spec import RunSpec
from .store import Store

log = logging.getLogger(__name__)


def load_spec(store: Store, run_id: str) -> RunSpec:
    return RunSpec.from_json(store.get_json(layout.key("spec", run_id)))


def save_spec(store: Store, spec: RunSpec) -> None:
    store.put_json(layout.key("spec", spec.run_id), spec.to_json())


def write_manifest(store: Store, board: RunBoard, run_id: str) -> dict[str, Any]:
    """Save the run's description beside its weights (rebuildable without Redis)."""
    doc = board.describe(run_id)
    store.put_json(layout.key("manifest", run_id), doc)
    return doc


def try_write_manifest(store: Store | None, board: RunBoard, run_id: str) -> None:
    """Write the manifest if the store answers; a store that is down (the reason a run may be
    failing) must not hide the failure, which the board already holds."""
    if store is None:
        return
    try:
        write_manifest(store, board, run_id)
    except StoreError as exc:
        log.warning("run %s: manifest not saved (%s); the broker has the run's state", run_id, exc)
