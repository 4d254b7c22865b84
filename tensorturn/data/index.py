"""A dataset's versioned index in the store (``datasets/<name>/v<NNNN>.json``): naming, listing,
showing and removing versions — a removed version's chunks go with it unless another uses them.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from tensorturn import layout
from tensorturn.errors import NotFound, SpecError

if TYPE_CHECKING:
    from tensorturn.store.objects import Store

FORMAT = "tensorturn-dataset-1"
NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")


def check_name(name: str) -> None:
    """SpecError unless ``name`` can name a dataset (it is a folder of the store's keys)."""
    if not NAME.fullmatch(name) or name == "chunks":
        raise SpecError(f"invalid dataset name {name!r}: use lowercase letters, digits, '.', '_' "
                        f"and '-' (not 'chunks')")


def versions(store: Store, name: str) -> list[dict[str, Any]]:
    """The stored versions of ``name`` (parsed keys: name and version), oldest first."""
    found = [layout.parse("dataset", k) for k in store.list(layout.prefix("dataset", name))]
    return sorted((f for f in found if f), key=lambda f: f["version"])


def names(store: Store) -> list[str]:
    """Every dataset with at least one version in the store, sorted."""
    out = set()
    for k in store.list(layout.DATASETS):
        parts = layout.parse("dataset", k)
        if parts:
            out.add(parts["name"])
    return sorted(out)


def show(store: Store, name: str, version: int | None = None) -> dict[str, Any]:
    """The index of ``name`` (its latest version unless ``version``); NotFound names what exists."""
    return read(store, name, version)[0]


def read(store: Store, name: str, version: int | None = None) -> tuple[dict[str, Any], str, str]:
    """(index, its store key, the sha256 of its bytes) of ``name`` (its latest version unless
    ``version``): what :func:`show` returns, and what a run pins of it. The key is built from
    ``name`` and the version, never from the index's fields; an index that names another dataset
    or version than its key is refused (TamperedObject): a store writer's copy, or a hand edit.
    NotFound names what exists."""
    from tensorturn.store.objects import ObjectMissing, sha256_hex
    from tensorturn.store.seals import TamperedObject

    check_name(name)
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 1):
        raise SpecError(f"dataset {name!r}: version {version!r} is not a version number (1, 2, ...)")
    known = versions(store, name)
    if not known:
        have = ", ".join(names(store)) or "none"
        raise NotFound(f"no dataset {name!r} in the store (datasets: {have}; see `tensorturn data push`)")
    version = version or known[-1]["version"]
    key = layout.key("dataset", name, version)
    try:
        data = store.get_bytes(key)
    except ObjectMissing:
        raise NotFound(f"dataset {name!r} has no version {version} "
                       f"(versions: {', '.join(str(v['version']) for v in known)})") from None
    try:
        index = json.loads(data)
    except ValueError:
        index = None
    if not isinstance(index, dict) or not isinstance(index.get("splits"), dict):
        raise TamperedObject(f"the index of dataset {name!r} version {version} ({key}) is not a dataset "
                             f"index: damaged or tampered with; refused")
    if index.get("name") != name or index.get("version") != version:
        raise TamperedObject(f"the index of dataset {name!r} version {version} ({key}) names dataset "
                             f"{index.get('name')!r} version {index.get('version')!r}: tampered with; refused")
    return index, key, sha256_hex(data)


def summary(index: dict[str, Any]) -> dict[str, Any]:
    """An index without its chunk list: what ``tensorturn data push`` and ``data list`` print of a version."""
    return {k: index.get(k) for k in ("name", "version", "kind", "label", "rows", "bytes", "created_at",
                                     "source", "split_by", "files", "links")} | {
        "chunks": sum(len(c) for c in index["splits"].values())}


def remove(store: Store, name: str, version: int | None = None) -> list[int]:
    """Remove a version (or every version) of ``name``, and the chunks no other version uses."""
    show(store, name, version)  # NotFound unless it exists
    targets = ([show(store, name, version)] if version else
               [show(store, name, v["version"]) for v in versions(store, name)])
    dropping = {c["sha256"] for t in targets for s in t["splits"].values() for c in s}
    for t in targets:
        store.delete(layout.key("dataset", name, t["version"]))
    still = set()
    for other in names(store):
        for v in versions(store, other):
            idx = store.get_json(layout.key("dataset", other, v["version"]))
            still |= {c["sha256"] for s in idx["splits"].values() for c in s}
    for sha in dropping - still:
        store.delete(layout.key("chunk", sha))
    return [t["version"] for t in targets]
