"""API tokens: shown once at creation, stored only as a hash, in the object store.

An API instance then needs nothing but the store to check a token. Tokens are 256-bit random
strings, so a plain SHA-256 is a sound hash for them (no password stretching is needed); checks
compare digests in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import Any

from .errors import NotFound
from .store import Store

PREFIX = "auth/tokens/"


def _digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create(store: Store, name: str | None = None) -> tuple[str, dict[str, Any]]:
    """A new token (returned once, never stored) and its stored record."""
    token = "tt_" + secrets.token_urlsafe(32)
    token_id = secrets.token_hex(4)
    record = {"id": token_id, "name": name or token_id, "sha256": _digest(token),
              "created_at": time.time(), "revoked_at": None}
    store.put_json(f"{PREFIX}{token_id}.json", record)
    return token, record


def records(store: Store) -> list[dict[str, Any]]:
    out = [store.get_json(k) for k in store.list(PREFIX) if k.endswith(".json")]
    return sorted(out, key=lambda r: r["created_at"])


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
            store.put_json(f"{PREFIX}{record['id']}.json", record)
    return matches[0]


class TokenChecker:
    """Checks bearer tokens against the store, re-reading it at most every ``ttl_s`` seconds
    (a revoked token stops working within that time)."""

    def __init__(self, store: Store, ttl_s: float = 2.0):
        self.store, self.ttl_s = store, ttl_s
        self._digests: list[str] = []
        self._loaded = 0.0

    def _active(self, max_age_s: float) -> list[str]:
        if time.monotonic() - self._loaded > max_age_s:
            self._digests = [r["sha256"] for r in records(self.store) if r["revoked_at"] is None]
            self._loaded = time.monotonic()
        return self._digests

    def _known(self, digest: str, max_age_s: float) -> bool:
        found = False
        for known in self._active(max_age_s):  # every digest, without stopping early
            found |= hmac.compare_digest(digest, known)
        return found

    def __call__(self, token: str | None) -> bool:
        if not token:
            return False
        digest = _digest(token)
        # an unknown token re-reads the list (a token created a moment ago works at once),
        # at most twice a second so that guessing cannot hammer the store
        return self._known(digest, self.ttl_s) or self._known(digest, 0.5)
