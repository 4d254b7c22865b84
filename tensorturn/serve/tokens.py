"""API tokens: shown once at creation, stored only as a hash, in the object store.

An API instance then needs nothing but the store (and the pool key) to check a token. Records are
signed with the pool key, so write access to the store is not enough to mint a token: a record
that is not signed is ignored. Tokens are 256-bit random strings, so a plain SHA-256 is a sound
hash for them (no password stretching is needed), and a server can look a presented token's
digest up in a set: how long a lookup takes tells a guesser only about the digest of its own
guess. The server's cache of these digests is :mod:`tensorturn.serve.auth`.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any

from tensorturn import layout, trust
from tensorturn.errors import NotFound
from tensorturn.store.objects import Store

PREFIX = layout.TOKENS


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create(store: Store, name: str | None = None) -> tuple[str, dict[str, Any]]:
    """A new token (returned once, never stored) and its stored record."""
    token = "tt_" + secrets.token_urlsafe(32)
    token_id = secrets.token_hex(4)
    record = {"id": token_id, "name": name or token_id, "sha256": _digest(token),
              "created_at": time.time(), "revoked_at": None}
    _save(store, record)
    return token, record


def _save(store: Store, record: dict[str, Any]) -> None:
    store.put_json(layout.key("token", record["id"]), trust.pool_key().sign_doc("token", record))


def records(store: Store) -> list[dict[str, Any]]:
    """Every token record signed by the pool key (others are ignored: see the module's doc)."""
    key = trust.pool_key()
    out = []
    for k in store.list(PREFIX):
        if not k.endswith(".json"):
            continue
        try:
            record = key.check_doc("token", store.get_json(k), f"token record {k}")
        except (trust.UntrustedError, ValueError):  # not signed, or not even JSON: not a token
            continue
        if isinstance(record.get("sha256"), str) and isinstance(record.get("created_at"), (int, float)):
            out.append(record)
    return sorted(out, key=lambda r: r["created_at"])


def active_digests(store: Store) -> set[str]:
    """The SHA-256 digests of every token that is signed and not revoked."""
    return {r["sha256"] for r in records(store) if r["revoked_at"] is None}


def public(record: dict[str, Any]) -> dict[str, Any]:
    """A record as `token list` shows it (the hash stays out of sight)."""
    return {k: v for k, v in record.items() if k != "sha256"}


def revoke(store: Store, id_or_name: str) -> dict[str, Any]:
    matches = [r for r in records(store) if id_or_name in (r["id"], r["name"])]
    if not matches:
        raise NotFound(f"no token with id or name {id_or_name!r} (see `tensorturn token list`)")
    for record in matches:
        if record["revoked_at"] is None:
            record["revoked_at"] = time.time()
            _save(store, record)
    return matches[0]
