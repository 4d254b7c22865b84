"""``--sync async``: the versions of the weights, and how far the broker's word on them is trusted.

The ledger (:class:`~tensorturn.state.ledger.AsyncLedger`) lives on the broker; the store holds
a sealed log of every version committed. Whoever can edit the broker's hashes but lacks the pool
key cannot point a run at another run's weights, nor at bytes no task stored: every key the
ledger names is checked to be this run's for that version, and its bytes against their seal.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

from tensorturn import layout
from tensorturn.modes.fused.options import options
from tensorturn.modes.fused.weights import cache, fetch_global
from tensorturn.recipes import Recipe
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.ledger import AsyncLedger
from tensorturn.store import seals
from tensorturn.store.objects import ObjectMissing, Store
from tensorturn.store.tensorfile import TensorReader
from tensorturn.store.tensors import StateDict

log = logging.getLogger(__name__)


def ledger(board: RunBoard, run_id: str) -> AsyncLedger:
    """The run's ledger on the board's broker."""
    return AsyncLedger(board.r, run_id)


def total_updates(spec: RunSpec) -> int:
    """R·S: the synchronous run's work, one update per shard and round."""
    return options(spec).rounds * options(spec).shards


def read_log(spec: RunSpec, store: Store
             ) -> tuple[dict[str, Any], dict[int, str], dict[int, dict[str, Any]]]:
    """The versions committed, from the store's sealed log (read up to its first gap): (the
    latest, version → key, update → its record)."""
    entries = {}
    for key in store.list(layout.prefix("version_log", spec.run_id)):
        parts = layout.parse("version_log", key)
        if parts:
            entries[parts["version"]] = seals.get_json(store, key)
    versions = {0: layout.key("global", spec.run_id, 0)}
    applied: dict[int, dict[str, Any]] = {}
    latest = {"version": 0, "key": versions[0], "state_key": "", "sha256": options(spec).init_sha256}
    v = 1
    while v in entries:
        entry = entries[v]
        versions[v] = entry["key"]
        applied[entry["record"]["update"]] = entry["record"]
        latest = {"version": v, "key": entry["key"], "state_key": entry["state_key"],
                  "sha256": entry["sha256"]}
        v += 1
    return latest, versions, applied


def fetch_version(spec: RunSpec, recipe: Recipe, store: Store, latest: dict[str, Any]
                  ) -> tuple[StateDict, int]:
    """The weights of ``latest`` (a version, checked by :func:`trusted_latest`), reusing those
    this process holds (:data:`~tensorturn.modes.fused.weights.cache`); (θ, bytes)."""
    held = cache.get(spec.run_id)
    if held and held[1] == latest["sha256"]:
        return held[2], 0
    if latest["version"] == 0:  # θ_0: rebuilt from the seed where it can be
        theta, moved = fetch_global(spec, recipe, store, 0)
    else:
        with tempfile.TemporaryDirectory(prefix="tt-version-") as tmp:
            path = Path(tmp) / "theta"
            get_version(spec, store, latest, path)
            with TensorReader(path) as f:
                theta = f.all()
            moved = path.stat().st_size
    cache.put(spec.run_id, latest["version"], latest["sha256"], theta)
    return theta, moved


def trusted_latest(spec: RunSpec, store: Store, board: RunBoard, book: AsyncLedger, worker: str
                   ) -> dict[str, Any]:
    """The ledger's latest version once it checks out (:func:`check_version_key`, and the seal of
    its key vouching for its sha256). One that does not was written by someone with the broker's
    password but not the pool key: the ledger is put back from the store's sealed log, and the
    run carries on from there (an update in flight may be applied again: a lost update, never a
    foreign one)."""
    try:
        latest = book.latest()
        v = int(latest["version"])
        key = check_version_key(spec, "version", latest["key"], v)
        if key != layout.key("global", spec.run_id, 0):
            seals.check(store, key, latest["sha256"])  # a seal for that key and that hash
        if latest["state_key"]:
            check_version_key(spec, "version_state", latest["state_key"], v)
        if store.exists(layout.key("version_log", spec.run_id, v + 1)):  # rolled back
            raise seals.TamperedObject(f"the broker's latest version, v{v}, is older than the store's log")
        return latest
    except (seals.TamperedObject, ObjectMissing, RuntimeError, KeyError, ValueError) as exc:
        log_latest, versions, applied = read_log(spec, store)
        book.repair(log_latest, versions, applied)
        board.incidents.add(spec.run_id, "ledger_repaired", "async", worker,
                            f"the broker's record of the latest weights did not check out ({exc}); "
                            f"put back from the store's log at version {log_latest['version']}")
        return log_latest


def get_version(spec: RunSpec, store: Store, latest: dict[str, Any], path: Path) -> None:
    """Download the weights of ``latest`` (the ledger's word, which lives on the broker) to
    ``path``, checked three ways: the key is this run's for that version, its bytes are the
    ones sealed under that key, and they hash to the ledger's sha256."""
    v = int(latest["version"])
    key = check_version_key(spec, "version", latest["key"], v)
    if seals.get_file(store, key, path) != latest["sha256"]:
        raise seals.TamperedObject(f"{seals.describe(key)}: the broker's record of it names "
                                   f"another sha256; refused")


def version_key(spec: RunSpec, store: Store, book: AsyncLedger, version: int) -> str:
    """The key of ``version``'s weights: the ledger's, if it is that version of this run, else
    the store's sealed log's (the ledger's was written by someone without the pool key)."""
    try:
        return check_version_key(spec, "version", book.version_key(version), version)
    except (seals.TamperedObject, RuntimeError):
        return str(seals.get_json(store, layout.key("version_log", spec.run_id, version))["key"])


def check_version_key(spec: RunSpec, kind: str, key: str, version: int) -> str:
    """``key``, if it is a key of ``kind`` of this run for ``version`` (version 0 is θ_0)."""
    if version == 0 and kind == "version" and key == layout.key("global", spec.run_id, 0):
        return key
    parts = layout.parse(kind, str(key))
    if parts is None or parts["run_id"] != spec.run_id or parts["version"] != version:
        raise seals.TamperedObject(f"run {spec.run_id}: the broker names {key!r} as version "
                                   f"{version}'s weights, which is not that version of this run; refused")
    return key
