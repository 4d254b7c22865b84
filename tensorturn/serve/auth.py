"""Bearer-token checks for the inference API that never block the event loop.

* The valid tokens' SHA-256 digests live in memory and are re-read from the store in the
  background (an asyncio task, the read itself on a thread) every ``refresh_s`` seconds, so a
  revoked token stops working within a few seconds. A valid token is one set lookup: it never
  waits.
* A token not in the set may have been created a moment ago, so a miss awaits one *shared*
  early re-read, at most one every ``min_refresh_s`` (≈ 2 per second however many misses come):
  a new token works on its first request, and guessing cannot hammer the store.
* A wrong token is answered 401 only after a tarpit (``await asyncio.sleep``: it holds no thread
  and does not block the loop), and a client (IP address) that keeps failing is answered 429 with
  ``Retry-After`` until its window ends. Neither applies to a valid token, from any address.

Digests are compared by set lookup. That is not constant time, but what it could leak is the
SHA-256 of a guess, which says nothing useful about a 256-bit random token.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class AuthError(Exception):
    def __init__(self, status: int, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def bearer_token(header: str | None) -> str | None:
    """The token in an ``Authorization: Bearer <token>`` header, else None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class TokenCache:
    """The set of valid token digests, refreshed in the background and, on a miss, early."""

    def __init__(self, load: Callable[[], set[str]], refresh_s: float = 2.0,
                 min_refresh_s: float = 0.5):
        self._load = load
        self.refresh_s, self.min_refresh_s = refresh_s, min_refresh_s
        self._digests: frozenset[str] = frozenset()
        self._tried_at = float("-inf")      # when the latest read (done, ok or not) began
        self._pending: asyncio.Task | None = None
        self._pending_began: float | None = None
        self._task: asyncio.Task | None = None
        self.reads = 0

    def load_now(self) -> None:
        """A first, synchronous read (before the server starts: a broken store fails early)."""
        began = time.monotonic()
        self._digests = frozenset(self._load())
        self._tried_at = began
        self.reads += 1

    def __contains__(self, token_digest: str) -> bool:
        return token_digest in self._digests

    async def refresh(self) -> None:
        """Re-read the set now (on a thread); a failed read keeps the previous set."""
        began = time.monotonic()
        try:
            digests = await asyncio.to_thread(self._load)
        except Exception:  # noqa: BLE001 - a store hiccup must not take the API down
            log.warning("could not re-read the API tokens; keeping the previous list", exc_info=True)
        else:
            self._digests = frozenset(digests)
            self.reads += 1
        finally:
            self._tried_at = max(self._tried_at, began)

    async def _early_refresh(self) -> None:
        try:
            wait = self._tried_at + self.min_refresh_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._pending_began = time.monotonic()
            await self.refresh()
        finally:
            self._pending, self._pending_began = None, None

    async def check_fresh(self, token_digest: str, arrived: float) -> bool:
        """Whether the digest is valid in a list read after ``arrived`` (awaits a shared,
        rate-limited re-read when the current list is older)."""
        while token_digest not in self._digests and self._tried_at < arrived:
            # the pending read, or a new one; when the pending read began before this request
            # came, its list may lack the token: wait for it, then loop to the next one
            task = self._pending
            if task is None:
                task = self._pending = asyncio.create_task(self._early_refresh())
            await asyncio.shield(task)
        return token_digest in self._digests

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(max(0.0, self._tried_at + self.refresh_s - time.monotonic()))
            await self.refresh()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        for task in (self._task, self._pending):
            if task is not None:
                task.cancel()
        self._task = None


class FailureCounter:
    """Failed authentications per client address in fixed windows."""

    def __init__(self, limit: int = 20, window_s: float = 60.0, max_clients: int = 100_000):
        self.limit, self.window_s, self.max_clients = limit, window_s, max_clients
        self._windows: dict[str, list[float]] = {}  # client → [window start, failures]

    def retry_after(self, client: str, now: float) -> int | None:
        """Seconds until ``client`` may try again, or None when it is not over its limit."""
        entry = self._windows.get(client)
        if entry is None or now - entry[0] >= self.window_s or entry[1] < self.limit:
            return None
        return max(1, math.ceil(entry[0] + self.window_s - now))

    def fail(self, client: str, now: float) -> None:
        entry = self._windows.get(client)
        if entry is None or now - entry[0] >= self.window_s:
            if len(self._windows) >= self.max_clients:
                self._prune(now)
            self._windows[client] = [now, 1.0]
        else:
            entry[1] += 1

    def _prune(self, now: float) -> None:
        self._windows = {c: e for c, e in self._windows.items() if now - e[0] < self.window_s}
        if len(self._windows) >= self.max_clients:  # a botnet's worth of addresses: start over
            self._windows.clear()


class Authenticator:
    """``await check(header, client)``: returns for a valid token, raises AuthError otherwise."""

    def __init__(self, cache: TokenCache, tarpit_s: float = 0.5,
                 failures: FailureCounter | None = None):
        self.cache, self.tarpit_s = cache, tarpit_s
        self.failures = failures or FailureCounter()

    def valid_now(self, header: str | None) -> bool:
        """The fast path: the token is in the cached set (no await, no wait)."""
        token = bearer_token(header)
        return token is not None and digest(token) in self.cache

    async def check(self, header: str | None, client: str | None) -> None:
        if self.valid_now(header):
            return
        arrived = time.monotonic()
        token = bearer_token(header)
        if token is not None and await self.cache.check_fresh(digest(token), arrived):
            return
        who = client or "?"
        now = time.monotonic()
        retry = self.failures.retry_after(who, now)
        if retry is None:
            self.failures.fail(who, now)
        delay = arrived + self.tarpit_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if retry is not None:
            raise AuthError(429, f"too many failed authentications from this address; retry in "
                                 f"{retry} s", retry)
        raise AuthError(401, "missing or invalid bearer token")
