"""Sealed objects: the pool key's word for the bytes a later task reads.

Whoever can write to the object store could otherwise swap a round's θ, a pseudo-gradient, the
outer state, teacher targets, an ensemble member's segment or an asynchronous version for
anything of the same shape, and the run would end "succeeded" on it. So the task that stores
such an object first stores its *seal* — ``{key, sha256, size}`` signed with the pool key, at
``runs/<id>/seals/<rest of the key>/<sha256>.json`` — and the task that reads it hashes the bytes
it got and looks for the seal of that hash. A swapped, truncated or bit-rotted object fails the
attempt in one line naming it (an attempt, not the machine: every machine would read the same
bytes). The seal names its key, so a sealed object of one run or round never passes for
another's; a store writer can still delete or spoil objects (the run fails, loudly), but cannot
make a run use bytes its own tasks did not store.

A seal per (key, hash) rather than per key: two copies of a unit may store the same key with
different bytes (backup copies, a redelivered outer step), and whichever object stays must find
its own seal. The seal goes first, so an object that exists always has one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tensorturn import layout, trust
from tensorturn.errors import TensorTurnError
from tensorturn.store.objects import ObjectMissing, Store, file_sha256, sha256_hex

PURPOSE = "object"


class TamperedObject(TensorTurnError):
    """An object whose bytes are not those its run stored (or that has no seal)."""

    exit_code = 2


def seal_key(key: str, sha256: str) -> str:
    """Where the seal of ``key`` (a key under ``runs/<id>/``) holding bytes ``sha256`` is stored."""
    run, sep, rest = key.partition("/")[2].partition("/")
    if key.split("/", 1)[0] + "/" != layout.RUNS or not sep:
        raise ValueError(f"only a run's objects are sealed, not {key!r}")
    return f"{layout.RUNS}{run}/seals/{rest}/{sha256}.json"


def describe(key: str) -> str:
    """What ``key`` holds, in words (for the one line a mismatch fails with)."""
    for kind, words in _WORDS.items():
        parts = layout.parse(kind, key)
        if parts is not None:
            return words.format(**parts) + f" ({key})"
    return key


_WORDS = {
    "global": "θ of round {round}",
    "outer": "the outer optimizer's state of round {round}",
    "broadcast": "the broadcast delta of round {round}",
    "shard": "the pseudo-gradient of shard {shard} of round {round}",
    "round": "the record of round {round}",
    "update": "asynchronous update u{update}",
    "version": "asynchronous version v{version}",
    "version_state": "the outer state of asynchronous version v{version}",
    "version_log": "the log entry of asynchronous version v{version}",
    "segment": "segment {segment} of ensemble member {member}",
    "optim": "the optimizer state of segment {segment} of ensemble member {member}",
    "teacher": "teacher targets shard {shard} of {shards} ({tag})",
}


def seal(store: Store, key: str, sha256: str, size: int) -> None:
    """Store the seal of ``key`` holding bytes that hash to ``sha256``."""
    doc = {"key": key, "sha256": sha256, "size": size}
    store.put_json(seal_key(key, sha256), trust.pool_key().sign_doc(PURPOSE, doc))


def check(store: Store, key: str, sha256: str) -> None:
    """TamperedObject unless one of the run's tasks sealed bytes ``sha256`` for ``key``. (A seal
    that is not the pool key's is tampering too — never the reading machine's fault.)"""
    what = describe(key)
    try:
        doc = store.get_json(seal_key(key, sha256))
        body = trust.pool_key().check_doc(PURPOSE, doc, f"the seal of {what}")
    except ObjectMissing:
        raise TamperedObject(f"{what} is not what the run stored (no seal for its bytes, sha256 "
                             f"{sha256[:12]}…): tampered with or corrupted; refused") from None
    except (ValueError, trust.UntrustedError) as exc:  # not JSON, or not signed by the pool key
        raise TamperedObject(f"{what}: its seal is forged or damaged ({exc}); refused") from None
    if body.get("key") != key or body.get("sha256") != sha256:
        raise TamperedObject(f"{what}: its seal is another object's ({body.get('key')!r}); refused")


# ---- storing and reading through seals ---------------------------------------------------------

def put_file(store: Store, key: str, path: Path | str) -> str:
    sha = file_sha256(Path(path))
    seal(store, key, sha, Path(path).stat().st_size)  # first: an object that exists has its seal
    return store.put_file(key, path, sha)


def put_bytes(store: Store, key: str, data: bytes) -> str:
    sha = sha256_hex(data)
    seal(store, key, sha, len(data))
    return store.put_bytes(key, data, sha)


def put_json(store: Store, key: str, obj: Any) -> str:
    return put_bytes(store, key, _json_bytes(obj))


def get_file(store: Store, key: str, path: Path | str) -> str:
    """Download ``key`` to ``path`` and check it against its seal; returns its sha256."""
    store.get_file(key, path)
    sha = file_sha256(Path(path))
    check(store, key, sha)
    return sha


def get_bytes(store: Store, key: str) -> bytes:
    data = store.get_bytes(key)
    check(store, key, sha256_hex(data))
    return data


def get_json(store: Store, key: str) -> Any:
    return json.loads(get_bytes(store, key))


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, indent=2, sort_keys=True).encode()
