"""The Redis side of asynchronous fused runs (no torch): the latest version of the weights, the
updates stored and not yet applied, the one applier at a time, and what each update did.

Keys (``tt:run:<id>:<part>``): ``async`` (hash: version, key, state_key, sha256 of the latest
weights), ``versions`` (version → its key), ``pending`` (sorted set: updates stored, not yet
applied, by arrival), ``trainers`` (update → the worker that trained it), ``begun`` (updates
handed out → the version their first copy trains from), ``applied`` (update → its record: the
version it made, its base, its staleness ...), ``apply_lock`` (the applier's token, with a time
to live the applier keeps refreshing).

An applier commits a version with :meth:`AsyncLedger.commit`, one Redis script that checks that
it still holds the lock, that the latest version is the one it stepped from and that the update
was not applied yet. An applier that lost the lock (stopped past its time to live, say) cannot
commit: its weights sit under a key with its own token and are never pointed at.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
from collections.abc import Iterator
from typing import Any

import redis

from tensorturn import layout
from tensorturn.state.broker import Hedged, lease_client

_COMMIT = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return -1 end
if tonumber(redis.call('hget', KEYS[2], 'version') or '-1') ~= tonumber(ARGV[2]) then return -2 end
if redis.call('hexists', KEYS[3], ARGV[7]) == 1 then return -3 end
redis.call('hset', KEYS[2], 'version', ARGV[3], 'key', ARGV[4], 'state_key', ARGV[5], 'sha256', ARGV[6])
redis.call('hset', KEYS[3], ARGV[7], ARGV[8])
redis.call('hset', KEYS[5], ARGV[3], ARGV[4])
redis.call('zrem', KEYS[4], ARGV[7])
return 1
"""
_REFRESH = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0")
_RELEASE = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('del', KEYS[1]) end return 0")
REFUSALS = {-1: "it no longer holds the apply lock", -2: "the weights moved on meanwhile",
            -3: "the update was applied already"}


class Fenced(Exception):
    """An applier's commit of update ``j`` was refused (:data:`REFUSALS` says why); it stops
    applying."""

    def __init__(self, j: int, message: str):
        super().__init__(message)
        self.j = j


class AsyncLedger:
    """The async ledger of one run (keys above)."""

    def __init__(self, client: redis.Redis, run_id: str):
        self.r: Any = client  # decode_responses=True: strings come back
        self.run_id = run_id
        self.k = {part: layout.run_key(run_id, part)
                  for part in ("async", "versions", "pending", "trainers", "applied", "apply_lock",
                               "begun", "eval_lock")}

    # -- the latest weights --
    def init(self, key: str, sha256: str) -> None:
        """Version 0 (θ_0), once: a second start or a resume keeps what is there."""
        if self.r.hsetnx(self.k["async"], "version", 0):
            self.r.hset(self.k["async"], mapping={"key": key, "state_key": "", "sha256": sha256})
            self.r.hset(self.k["versions"], 0, key)

    def restore(self, latest: dict[str, Any], versions: dict[int, str],
                applied: dict[int, dict[str, Any]]) -> None:
        """Put back what the store's log says (``tensorturn resume`` after Redis lost it)."""
        pipe = self.r.pipeline()
        pipe.delete(*(self.k[part] for part in ("async", "versions", "applied", "pending",
                                                "trainers", "begun")))
        pipe.hset(self.k["async"], mapping={k: latest[k] for k in ("version", "key", "state_key", "sha256")})
        pipe.hset(self.k["versions"], mapping={str(v): key for v, key in versions.items()})
        if applied:
            pipe.hset(self.k["applied"], mapping={str(j): json.dumps(rec) for j, rec in applied.items()})
        pipe.execute()

    def repair(self, latest: dict[str, Any], versions: dict[int, str],
               applied: dict[int, dict[str, Any]]) -> None:
        """Put back the latest weights, the versions and the applied updates from the store's log
        while the run goes on: an update stored but not in the log is applied (again), so a
        ledger rolled back loses no update; the begun ones are kept."""
        stored = [int(j) for j in self.r.hkeys(self.k["trainers"])]
        pipe = self.r.pipeline()
        pipe.delete(self.k["async"], self.k["versions"], self.k["applied"])
        pipe.hset(self.k["async"], mapping={k: latest[k] for k in ("version", "key", "state_key", "sha256")})
        pipe.hset(self.k["versions"], mapping={str(v): key for v, key in versions.items()})
        if applied:
            pipe.hset(self.k["applied"], mapping={str(j): json.dumps(rec) for j, rec in applied.items()})
        again = {str(j): 0 for j in stored if j not in applied}
        if again:
            pipe.zadd(self.k["pending"], again)
        pipe.execute()

    def latest(self) -> dict[str, Any]:
        h = self.r.hgetall(self.k["async"])
        if not h:
            raise RuntimeError(f"run {self.run_id} has no asynchronous weights on this broker")
        return {"version": int(h["version"]), "key": h["key"], "state_key": h.get("state_key", ""),
                "sha256": h.get("sha256", "")}

    def version_key(self, version: int) -> str:
        key = self.r.hget(self.k["versions"], str(version))
        if key is None:
            raise RuntimeError(f"run {self.run_id}: no version {version} of the weights recorded")
        return key

    # -- updates --
    def push(self, j: int, worker: str, at: float) -> None:
        """Update j is stored: queue it to be applied (once; a second push changes nothing)."""
        pipe = self.r.pipeline()
        pipe.hsetnx(self.k["trainers"], str(j), worker)
        pipe.zadd(self.k["pending"], {str(j): at}, nx=True)
        pipe.execute()

    def start(self, j: int, base_version: int) -> int:
        """Update j began training somewhere, from ``base_version`` (its first copy's is kept);
        returns how many updates have begun."""
        pipe = self.r.pipeline()
        pipe.hsetnx(self.k["begun"], str(j), base_version)
        pipe.hlen(self.k["begun"])
        return int(pipe.execute()[1])

    def begun(self) -> int:
        return int(self.r.hlen(self.k["begun"]))

    def bases(self) -> dict[int, int]:
        """Each update begun → the version its first copy trains from."""
        return {int(j): int(v) for j, v in self.r.hgetall(self.k["begun"]).items()}

    def stored(self, j: int) -> bool:
        """Whether some copy of update j has stored and queued it."""
        return bool(self.r.hexists(self.k["trainers"], str(j)))

    def trainer(self, j: int) -> str | None:
        return self.r.hget(self.k["trainers"], str(j))

    def pending(self) -> list[int]:
        return [int(j) for j in self.r.zrange(self.k["pending"], 0, -1)]

    def next_pending(self) -> int | None:
        """The earliest stored update not applied yet (one applied meanwhile is dropped)."""
        while True:
            first = self.r.zrange(self.k["pending"], 0, 0)
            if not first:
                return None
            if not self.is_applied(int(first[0])):
                return int(first[0])
            self.r.zrem(self.k["pending"], first[0])

    def is_applied(self, j: int) -> bool:
        return bool(self.r.hexists(self.k["applied"], str(j)))

    def applied(self) -> list[dict[str, Any]]:
        """Every applied update's record, in the order they were applied."""
        return sorted((json.loads(v) for v in self.r.hvals(self.k["applied"])),
                      key=lambda rec: rec["version"])

    # -- the applier --
    @contextlib.contextmanager
    def lock(self, worker: str, ttl_s: float, refresh_s: float,
             part: str = "apply_lock") -> Iterator[str | None]:
        """Be the one applier (or, with ``part="eval_lock"``, the one evaluating the rounds due):
        yields a token (``<worker>:<random>``) while this process holds the lock, kept alive by
        a thread every ``refresh_s``, or None when another holds it. A holder that dies lets go
        when the time to live runs out."""
        token = f"{worker}:{secrets.token_hex(6)}"
        ttl_ms = max(1000, int(ttl_s * 1000))
        key = self.k[part]
        if not self.r.set(key, token, nx=True, px=ttl_ms):
            yield None
            return
        stop, lost = threading.Event(), threading.Event()
        # the applier uploads while it holds the lock: refreshes are hedged (tensorturn.pool.lease),
        # on connections that give up after the lock's time to live
        hedged, quick = Hedged(f"run {self.run_id}: the {part} refresh"), lease_client(self.r, ttl_s)

        def refresh() -> None:
            if not quick.eval(_REFRESH, 1, key, token, ttl_ms):
                lost.set()  # expired while this process was stopped: commits will say so

        def keep() -> None:
            while not stop.wait(refresh_s) and not lost.is_set():
                hedged.send(refresh)  # one that fails: the time to live covers a few misses
            hedged.close()

        keeper = threading.Thread(target=keep, name=f"{part}-{self.run_id}", daemon=True)
        keeper.start()
        try:
            yield token
        finally:
            stop.set()
            keeper.join()
            with contextlib.suppress(redis.RedisError):  # it expires on its own
                self.r.eval(_RELEASE, 1, key, token)

    def holder(self) -> str | None:
        """The worker applying updates now, if any."""
        token = self.r.get(self.k["apply_lock"])
        return token.rpartition(":")[0] if token else None

    def commit(self, token: str, base_version: int, key: str, state_key: str, sha256: str,
               j: int, record: dict[str, Any]) -> None:
        """Make ``key`` version base_version + 1, made by update j; raises :class:`Fenced` when
        this applier may not (the store's objects under its token are then its to remove)."""
        got = int(self.r.eval(_COMMIT, 5, self.k["apply_lock"], self.k["async"], self.k["applied"],
                              self.k["pending"], self.k["versions"], token, base_version,
                              base_version + 1, key, state_key, sha256, j, json.dumps(record)))
        if got != 1:
            raise Fenced(j, f"update u{j} not committed as version {base_version + 1}: "
                         f"{REFUSALS.get(got, got)}")
