"""A run in the object store: its spec and its manifest (the board's description, saved).

With these and the outputs a run can be rebuilt without Redis (``tensorturn resume``).
"""

from __future__ import annotations

import logging
from typing import Any

from . import layout, trust
from .board import RunBoard
from .errors import StoreError
from .spec import RunSpec
from .store import Store

log = logging.getLogger(__name__)


def load_spec(store: Store, run_id: str) -> RunSpec:
    """The run's spec, refused (UntrustedError) unless it is signed by this pool's key: a spec
    names the recipe every agent imports."""
    doc = trust.pool_key().check_doc("spec", store.get_json(layout.key("spec", run_id)),
                                     f"the spec of run {run_id}")
    if doc.get("run_id") != run_id:  # another run's signed spec, copied here
        raise trust.UntrustedError(f"the spec stored for run {run_id} is run {doc.get('run_id')!r}'s; refused")
    return RunSpec.from_json(doc)


def save_spec(store: Store, spec: RunSpec) -> None:
    store.put_json(layout.key("spec", spec.run_id), trust.pool_key().sign_doc("spec", spec.to_json()))


def read_manifest(store: Store, run_id: str, verify: bool = False) -> dict[str, Any]:
    """The run's manifest, without its signature; ``verify``: refused unless signed by this
    pool's key (what a server trusts). ObjectMissing when there is none."""
    doc = store.get_json(layout.key("manifest", run_id))
    if verify:
        checked = trust.pool_key().check_doc("manifest", doc, f"the manifest of run {run_id}")
        if checked.get("run_id") != run_id:  # another run's signed manifest, copied here
            raise trust.UntrustedError(f"the manifest stored for run {run_id} is run "
                                       f"{checked.get('run_id')!r}'s; refused")
        return checked
    return {k: v for k, v in doc.items() if k != trust.SIGNATURE} if isinstance(doc, dict) else doc


def write_manifest(store: Store, board: RunBoard, run_id: str) -> dict[str, Any]:
    """Save the run's description beside its weights (rebuildable without Redis), signed."""
    doc = board.describe(run_id)
    store.put_json(layout.key("manifest", run_id), trust.pool_key().sign_doc("manifest", doc))
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


def finished_ensemble(store: Store, run_id: str, merge: str) -> dict[str, Any]:
    """The signed manifest of ensemble ``run_id``, refused in one line unless it is a finished
    ensemble (what ``merge`` — distill, soup — turns into one model)."""
    from .errors import NotFound, SpecError
    from .store import ObjectMissing

    try:
        manifest = read_manifest(store, run_id, verify=True)
    except ObjectMissing:
        raise NotFound(f"no run {run_id!r} in the store (see `tensorturn runs`)") from None
    if manifest.get("mode") != "ensemble":
        raise SpecError(f"run {run_id} is a {manifest.get('mode')} run, not an ensemble: it is one "
                        f"model already ({merge} turns an ensemble into one model)")
    if manifest.get("state") != "succeeded" or not manifest.get("model_uri"):
        raise SpecError(f"run {run_id} is {manifest.get('state')}, not a finished ensemble: {merge} "
                        f"it once it has succeeded (`tensorturn status {run_id}`)")
    return manifest
