"""The run board: a run's live state in Redis — state, rounds, members, attempts, incidents.

Everything here can be rebuilt from the store (``runs/<id>/manifest.json`` and the outputs), which
is what ``tensorturn resume`` does after Redis lost its data. The JSON that ``tensorturn run
--json`` and ``status --json`` print comes from :meth:`RunBoard.describe`.

A run's hash is *whole* when it holds every field :meth:`RunBoard.create` writes
(:data:`tensorturn.layout.RECORD`). One that is not — its keys were deleted or expired while a
task still wrote progress to it — is no record: every reader treats it as lost (``status`` reads
the store's manifest, ``resume`` rebuilds the record from the store, a task does nothing), and no
writer creates or completes one. A finished run's keys expire after ``TENSORTURN_RUN_TTL_S``
(:meth:`RunBoard.expire`); its manifest in the store keeps its record.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis

from tensorturn import config, layout
from tensorturn.config import mask_text
from tensorturn.errors import NotFound
from tensorturn.spec import FINISHED, RunSpec
from tensorturn.state.live import view as live_view

# Writers of the run's hash leave alone a hash without a spec: they must not make one up (a task
# still running when the run's keys were deleted would otherwise leave a partial record behind).
_FINISH_ONCE = ("if redis.call('hexists', KEYS[1], 'spec') == 0 then return 0 end "
                "local s = redis.call('hget', KEYS[1], 'state') "
                "if s == 'succeeded' or s == 'failed' or s == 'cancelled' then return 0 end "
                "redis.call('hset', KEYS[1], unpack(ARGV)) redis.call('del', KEYS[2]) return 1")
# A round's slot → the shard it trains (see RunBoard.claim_shard). KEYS: the round's slots, the run's
# owners; ARGV: slot, worker, shards, then the shards whose data this worker holds. Preference: a
# shard it trained before (lowest first), else one nobody has whose data it holds, else one nobody
# has, else — work stealing — the last one of the owner with the most left, one whose data it holds
# first. Tiers are B apart, B above any score within a tier.
_CLAIM_SHARD = """
local got = redis.call('hget', KEYS[1], ARGV[1])
if got then
  redis.call('hset', KEYS[2], got, ARGV[2])
  return tonumber(got)
end
local n = tonumber(ARGV[3])
local taken = {}
for _, v in ipairs(redis.call('hvals', KEYS[1])) do taken[tonumber(v)] = true end
local owner = {}
local flat = redis.call('hgetall', KEYS[2])
for i = 1, #flat, 2 do owner[tonumber(flat[i])] = flat[i + 1] end
local held = {}
for i = 4, #ARGV do held[tonumber(ARGV[i])] = true end
local left = {}
for k = 0, n - 1 do
  local o = owner[k]
  if not taken[k] and o then left[o] = (left[o] or 0) + 1 end
end
local best, score, B = -1, -1, 2 * n * n + 1
for k = 0, n - 1 do
  if not taken[k] then
    local o, s = owner[k], 0
    if o == ARGV[2] then s = 4 * B - k
    elseif not o and held[k] then s = 3 * B - k
    elseif not o then s = 2 * B - k
    else
      s = n * left[o] + k
      if held[k] then s = s + B end
    end
    if s > score then best, score = k, s end
  end
end
if best < 0 then return -1 end
redis.call('hset', KEYS[1], ARGV[1], best)
redis.call('hset', KEYS[2], best, ARGV[2])
return best
"""
_SET_IF_WHOLE = ("if redis.call('hexists', KEYS[1], 'spec') == 1 then "
                 "redis.call('hset', KEYS[1], ARGV[1], ARGV[2]) end")
_QUEUED_TO_RUNNING = ("if redis.call('hget', KEYS[1], 'state') == 'queued' then "
                      "redis.call('hset', KEYS[1], 'state', 'running', 'started_at', ARGV[1]) end")


_SMALL = tuple(f for f in layout.RECORD if f != "spec")  # a record's fields besides the spec


def whole(h: dict[str, str]) -> bool:
    """Whether a run's hash holds every field of a record (:data:`tensorturn.layout.RECORD`)."""
    return all(h.get(field) is not None for field in layout.RECORD)


def read_state(pipe: Any, run_id: str) -> None:
    """Queue in ``pipe`` the two replies :func:`state_of` reads: the record's fields, and of
    the spec only whether it is there (it may be kilobytes; running attempts read this often)."""
    pipe.hmget(layout.run_key(run_id), *_SMALL)
    pipe.hexists(layout.run_key(run_id), "spec")


def state_of(fields: list[str | None], has_spec: bool) -> str | None:
    """The run's state from :func:`read_state`'s replies; None unless its record is whole."""
    return dict(zip(_SMALL, fields))["state"] if has_spec and None not in fields else None


def _encode(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: json.dumps(v) if isinstance(v, (dict, list)) else v
            for k, v in fields.items() if v is not None}


class RunBoard:
    """Live run state in Redis (keys from :mod:`tensorturn.layout`)."""

    def __init__(self, client: redis.Redis):
        self.r: Any = client  # decode_responses=True: every reply is str (the stubs cannot say)

    # -- the run --
    def create(self, spec: RunSpec, state: str = "queued") -> None:
        pipe = self.r.pipeline()
        pipe.hset(layout.run_key(spec.run_id), mapping={
            "run_id": spec.run_id, "mode": spec.mode, "state": state,
            "spec": json.dumps(spec.to_json()), "created_at": spec.created_at,
            "progress_at": time.time()})
        pipe.zadd(layout.RUN_INDEX, {spec.run_id: spec.created_at})
        pipe.execute()

    def update_spec(self, spec: RunSpec) -> None:
        self.r.hset(layout.run_key(spec.run_id), "spec", json.dumps(spec.to_json()))

    def exists(self, run_id: str) -> bool:
        """Whether the broker holds the run's record, whole (a partial hash is a lost record)."""
        return self._record(run_id) is not None

    def state(self, run_id: str) -> str | None:
        """The run's state; None when the broker has no whole record of it."""
        pipe = self.r.pipeline(transaction=False)
        read_state(pipe, run_id)
        return state_of(*pipe.execute())

    def is_finished(self, run_id: str) -> bool:
        return self.state(run_id) in FINISHED

    def state_and_quarantine(self, run_id: str, worker: str) -> tuple[str | None, bool]:
        """The run's state and whether ``worker`` is out of rotation, in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        read_state(pipe, run_id)
        pipe.hget(layout.worker_key(worker), "quarantined")
        fields, has_spec, quarantined = pipe.execute()
        return state_of(fields, has_spec), bool(quarantined)

    def mark_running(self, run_id: str, pipe: Any = None) -> None:
        """queued → running only; never overwrites a finished state (in ``pipe``, when given)."""
        (pipe or self.r).eval(_QUEUED_TO_RUNNING, 1, layout.run_key(run_id), time.time())

    def touch(self, run_id: str, pipe: Any = None) -> None:
        """Note that the run made progress now (``status`` reports runs that stop doing so)."""
        (pipe or self.r).eval(_SET_IF_WHOLE, 1, layout.run_key(run_id), "progress_at", time.time())

    def finish(self, run_id: str, state: str, pipe: Any = None, **fields: Any) -> bool:
        """Move to a finished state once; later calls (a duplicate task) change nothing, nor
        does a call for a run without a whole record. Its keys then expire (:meth:`expire`).
        In ``pipe``, when given: then the answer is not known here (True), and the keys expire
        when the manifest holding the final state is saved
        (:func:`tensorturn.state.manifest.write_manifest`)."""
        mapping = _encode(fields)
        mapping.update(state=state, finished_at=time.time())
        args = [x for kv in mapping.items() for x in kv]
        keys = (layout.run_key(run_id), layout.live_key(run_id))  # live progress: gone
        if pipe is not None:
            pipe.eval(_FINISH_ONCE, 2, *keys, *args)
            return True
        finished = bool(self.r.eval(_FINISH_ONCE, 2, *keys, *args))
        if finished:
            self.expire(run_id)
        return finished

    def fail(self, run_id: str, error: str) -> bool:
        return self.finish(run_id, "failed", error=mask_text(error))

    def cancel(self, run_id: str, by: str) -> bool:
        """Cancel a live run (``by``: who asked, for ``status``); False if it had finished. No
        task of it starts afterwards, and running ones stop at their next look
        (:meth:`tensorturn.tasks.attempt.Attempt.check_cancelled`)."""
        return self.finish(run_id, "cancelled", cancelled_by=mask_text(by))

    # -- how long the run's keys live --
    def keys(self, run_id: str) -> list[str]:
        """Every key of the run on the broker: its hash and its sibling records."""
        main = layout.run_key(run_id)
        siblings = list(self.r.scan_iter(match=layout.run_keys_pattern(run_id), count=10000))
        return ([main] if self.r.exists(main) else []) + siblings

    def expire(self, run_id: str) -> None:
        """Let every key of the finished run expire after ``TENSORTURN_RUN_TTL_S``: its record
        stays in the store's manifest, where ``status``, ``runs`` and ``report`` read it after.
        A run finishing is also when the pool's other leftovers are pruned, at most once an
        hour (:func:`tensorturn.state.housekeeping.maybe_prune`)."""
        from tensorturn.state.housekeeping import maybe_prune

        ttl = max(1, int(config.current().run_ttl_s))
        pipe = self.r.pipeline(transaction=False)
        pipe.hdel(layout.run_key(run_id), "kept")  # the store has its record now (:meth:`keep`)
        for key in self.keys(run_id):
            pipe.expire(key, ttl)
        pipe.execute()
        maybe_prune(self.r)

    def persist(self, run_id: str) -> None:
        """Keep every key of the run (a run resumed runs again)."""
        pipe = self.r.pipeline(transaction=False)
        for key in self.keys(run_id):
            pipe.persist(key)
        pipe.execute()

    def keep(self, run_id: str) -> None:
        """Keep every key of the run, marked ``kept``: its final manifest could not be saved,
        so the broker holds its only whole record (the prune leaves such a record alone,
        until a manifest is saved — :func:`tensorturn.state.manifest.write_manifest` — or `runs rm`)."""
        self.persist(run_id)
        self.r.eval(_SET_IF_WHOLE, 1, layout.run_key(run_id), "kept", time.time())

    def forget(self, run_id: str) -> int:
        """Delete every key of the run, and its place in the list of runs; returns how many."""
        keys = self.keys(run_id)
        pipe = self.r.pipeline()
        if keys:
            pipe.delete(*keys)
        pipe.zrem(layout.RUN_INDEX, run_id)
        pipe.execute()
        return len(keys)

    def claim(self, run_id: str, what: str) -> bool:
        """True the first time ``what`` is claimed for this run (guards one-time dispatches)."""
        return bool(self.r.hsetnx(layout.run_key(run_id, "claims"), what, time.time()))

    def release(self, run_id: str, what: str) -> None:
        self.r.hdel(layout.run_key(run_id, "claims"), what)

    def once(self, run_id: str, what: str, dispatch: Callable[[], Any]) -> bool:
        """Run ``dispatch`` if this is the first claim of ``what``; a dispatch that fails gives
        the claim back, so the retry that follows can queue it (nothing is lost between)."""
        if not self.claim(run_id, what):
            return False
        try:
            dispatch()
        except BaseException:
            self.release(run_id, what)
            raise
        return True

    def claim_shard(self, run_id: str, r: int, slot: int, worker: str, shards: int,
                    held: Iterable[int] = ()) -> int:
        """The shard that slot ``slot`` of round ``r`` trains, decided by the first worker to run
        the slot and fixed from then on (a redelivered or duplicate slot trains the same shard).
        A worker takes the shards it trained before first — their chunks are in its cache — then
        shards nobody had, then steals from the worker with the most shards left; among new or
        stolen shards, those whose data it ``held`` (in its cache: an earlier run's, or one it
        stole before) first. Which machine trains a shard never
        changes the result, only what it downloads."""
        k = int(self.r.eval(_CLAIM_SHARD, 2, layout.run_key(run_id, f"slots-r{r}"),
                            layout.run_key(run_id, "owners"), slot, worker, shards, *held))
        if k < 0:
            raise RuntimeError(f"round {r} of run {run_id} has no shard left for slot {slot}")
        return k

    def shard_owners(self, run_id: str) -> dict[int, str]:
        """Which worker last trained each shard."""
        return {int(k): w for k, w in self.r.hgetall(layout.run_key(run_id, "owners")).items()}

    def unclaimed_shards(self, run_id: str, r: int, shards: int) -> list[int]:
        taken = {int(v) for v in self.r.hvals(layout.run_key(run_id, f"slots-r{r}"))}
        return [k for k in range(shards) if k not in taken]

    # -- rounds --
    def record_round(self, run_id: str, round_: int, info: dict[str, Any]) -> None:
        """Record round ``round_``; its outer step's live phase goes with it (one round trip)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(layout.run_key(run_id, "rounds"), str(round_), json.dumps(info))
        pipe.hdel(layout.live_key(run_id), str(layout.outer_label(round_)))
        self.touch(run_id, pipe)
        pipe.execute()

    # -- what running tasks report (tensorturn.state.live reads it) --
    def mark_phase(self, run_id: str, label: str, phase: str, worker: str) -> None:
        """Say what the task ``label`` is doing now (an outer step: averaging, evaluating)."""
        self.r.hset(layout.live_key(run_id), label, json.dumps(
            {"label": label, "phase": phase, "worker": worker, "at": time.time()}))

    def live(self, run_id: str) -> dict[str, dict[str, Any]]:
        return {k: json.loads(v) for k, v in self.r.hgetall(layout.live_key(run_id)).items()}

    def has_round(self, run_id: str, round_: int) -> bool:
        return bool(self.r.hexists(layout.run_key(run_id, "rounds"), str(round_)))

    def rounds(self, run_id: str) -> list[dict[str, Any]]:
        raw = self.r.hgetall(layout.run_key(run_id, "rounds"))
        return [json.loads(raw[k]) for k in sorted(raw, key=int)]

    # -- ensemble members --
    def record_member(self, run_id: str, member: int, info: dict[str, Any]) -> None:
        self.r.hset(layout.run_key(run_id, "members"), str(member), json.dumps(info))

    def update_member(self, run_id: str, member: int, **fields: Any) -> dict[str, Any]:
        info = self.member(run_id, member)
        info.update(fields)
        self.record_member(run_id, member, info)
        return info

    def member(self, run_id: str, member: int) -> dict[str, Any]:
        raw = self.r.hget(layout.run_key(run_id, "members"), str(member))
        return json.loads(raw) if raw else {}

    def members(self, run_id: str) -> list[dict[str, Any]]:
        raw = self.r.hgetall(layout.run_key(run_id, "members"))
        return [json.loads(raw[k]) for k in sorted(raw, key=int)]

    def member_done(self, run_id: str, member: int) -> int:
        """Mark a member finished (succeeded or dropped) once; returns how many are finished."""
        self.r.hsetnx(layout.run_key(run_id, "members_done"), str(member), time.time())
        self.touch(run_id)
        return int(self.r.hlen(layout.run_key(run_id, "members_done")))

    # -- bytes moved, counted once per task --
    def add_bytes(self, run_id: str, task: str, up: int, down: int, pipe: Any = None) -> None:
        (pipe or self.r).hsetnx(layout.run_key(run_id, "bytes"), task, f"{up},{down}")

    def add_store_bytes(self, run_id: str, up: int, down: int, worker: str, pipe: Any = None) -> None:
        """Add what one attempt (or a run's start) on ``worker`` stored and fetched, every object
        included (in ``pipe``, when given): for the run, and for that machine."""
        if up or down:
            own = pipe is None
            pipe = self.r.pipeline() if own else pipe
            key = layout.run_key(run_id, "store_bytes")
            for field, value in (("up", up), ("down", down), (f"up@{worker}", up), (f"down@{worker}", down)):
                pipe.hincrby(key, field, value)
            if own:
                pipe.execute()

    def store_bytes(self, run_id: str) -> tuple[int, int]:
        h = self.r.hgetall(layout.run_key(run_id, "store_bytes"))
        return int(h.get("up", 0)), int(h.get("down", 0))

    def store_bytes_by_worker(self, run_id: str) -> dict[str, dict[str, int]]:
        """What each machine's tasks moved through the store for the run: {worker: {up, down}}."""
        out: dict[str, dict[str, int]] = {}
        for field, value in self.r.hgetall(layout.run_key(run_id, "store_bytes")).items():
            way, at, worker = field.partition("@")
            if at:
                out.setdefault(worker, {"up": 0, "down": 0})[way] = int(value)
        return out

    def bytes_moved(self, run_id: str) -> tuple[int, int]:
        up = down = 0
        for v in self.r.hvals(layout.run_key(run_id, "bytes")):
            u, d = v.split(",")
            up, down = up + int(u), down + int(d)
        return up, down

    # -- attempts --
    def begin_attempt(self, run_id: str, task: str, worker: str,
                      max_attempts: int) -> tuple[str, int, str | None] | None:
        """Record a new attempt of ``task``; returns its key, its number (1, 2, ...) and the
        run's state as it began (a run cancelled meanwhile: the attempt stops at once).

        Past ``max_attempts`` (counted since the run was last started or resumed: a task that
        keeps killing its worker is redelivered without end) the attempt is recorded as refused,
        with an incident, and None is returned.
        """
        # three round trips whatever the history: on a home link each one costs the RTT
        pipe = self.r.pipeline(transaction=False)
        pipe.hincrby(layout.run_key(run_id, "attempt_n"), task, 1)
        pipe.hget(layout.run_key(run_id, "attempt_base"), task)
        n, base = (int(v or 0) for v in pipe.execute())
        key = f"{task}#{n}"
        earlier = [f"{task}#{i}" for i in range(base + 1, n)]
        for i, raw in zip(range(base + 1, n), self.r.hmget(layout.run_key(run_id, "attempts"), earlier)
                          if earlier else []):
            # an earlier attempt still "running" was lost with its machine
            if raw and json.loads(raw)["outcome"] == "running":
                self.finish_attempt(run_id, f"{task}#{i}", "lost: requeued to another attempt")
                self.incident(run_id, "requeued", task, json.loads(raw)["worker"],
                              f"attempt {i} was lost (its worker stopped answering); attempt {n} "
                              f"started on {worker}")
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(layout.run_key(run_id, "attempts"), key, json.dumps({
            "task": task, "attempt": n, "worker": worker, "started_at": time.time(),
            "finished_at": None, "outcome": "running"}))
        self.mark_running(run_id, pipe)
        self.touch(run_id, pipe)
        pipe.hget(layout.run_key(run_id), "state")
        state = pipe.execute()[-1]
        if n - base <= max_attempts:
            return key, n - base, state
        self.finish_attempt(run_id, key, "refused: attempt limit reached")
        self.incident(run_id, "attempt_limit", task, worker,
                      f"attempt {n - base} refused: the task already had {max_attempts}")
        return None

    def finish_attempt(self, run_id: str, key: str, outcome: str,
                       also: Callable[[Any], None] | None = None,
                       traceback: str | None = None) -> None:
        """Record the attempt's outcome (a failure's ``traceback`` with it: its last frames,
        bounded — :func:`tensorturn.tracebacks.tail`); ``also(pipeline)`` adds writes that go
        with it, in the same round trip."""
        raw = self.r.hget(layout.run_key(run_id, "attempts"), key)
        pipe = self.r.pipeline(transaction=False)
        if raw is not None:
            entry = json.loads(raw)
            entry.update(finished_at=time.time(), outcome=mask_text(outcome))
            if traceback:
                entry["traceback"] = mask_text(traceback)
            pipe.hset(layout.run_key(run_id, "attempts"), key, json.dumps(entry))
            self.touch(run_id, pipe)
        if also is not None:
            also(pipe)
        pipe.execute()

    def attempts(self, run_id: str) -> list[dict[str, Any]]:
        entries = [json.loads(v) for v in self.r.hgetall(layout.run_key(run_id, "attempts")).values()]
        return sorted(entries, key=lambda e: (e["started_at"], e["task"]))

    # -- incidents: requeued, duplicate or late attempts ignored, updates rejected, ... --
    def incident(self, run_id: str, kind: str, task: str, worker: str | None, detail: str) -> None:
        self.r.rpush(layout.run_key(run_id, "incidents"), json.dumps({
            "kind": kind, "task": task, "worker": worker, "at": time.time(),
            "detail": mask_text(detail)}))

    def add_data_bytes(self, run_id: str, worker: str, downloaded: int, read: int = 0) -> None:
        """Dataset bytes ``worker`` downloaded for the run (chunks not already in its cache), and
        the bytes of the chunks its tasks read (from its cache or not)."""
        if downloaded:
            self.r.hincrby(layout.run_key(run_id, "data_bytes"), worker, downloaded)
        if read:
            self.r.hincrby(layout.run_key(run_id, "data_read"), worker, read)

    def data_bytes(self, run_id: str, part: str = "data_bytes") -> dict[str, int]:
        """Per worker: bytes downloaded (``data_bytes``) or read by its tasks (``data_read``)."""
        return {w: int(n) for w, n in self.r.hgetall(layout.run_key(run_id, part)).items()}

    def warn(self, run_id: str, text: str) -> None:
        """A warning about how the run was set up (not a fault): `run` prints it at the start."""
        self.r.rpush(layout.run_key(run_id, "warnings"), mask_text(text))

    def warnings(self, run_id: str) -> list[str]:
        return list(self.r.lrange(layout.run_key(run_id, "warnings"), 0, -1))

    def incidents(self, run_id: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.r.lrange(layout.run_key(run_id, "incidents"), 0, -1)]

    # -- resuming --
    def restore(self, spec: RunSpec, doc: dict[str, Any] | None) -> None:
        """Re-create a run's records from its last manifest (or from the spec alone), in place
        of whatever is left of them (the keys a task still wrote after the record was lost)."""
        self.forget(spec.run_id)
        self.create(spec, state="running")
        if not doc:
            return
        pipe = self.r.pipeline()
        for r in doc.get("rounds", []):
            pipe.hset(layout.run_key(spec.run_id, "rounds"), str(r["round"]), json.dumps(r))
        for a in doc.get("attempts", []):
            pipe.hset(layout.run_key(spec.run_id, "attempts"), f"{a['task']}#{a['attempt']}",
                      json.dumps(a))
            pipe.hset(layout.run_key(spec.run_id, "attempt_n"), a["task"], a["attempt"])
            pipe.hset(layout.run_key(spec.run_id, "attempt_base"), a["task"], a["attempt"])
        for i in doc.get("incidents", []):
            pipe.rpush(layout.run_key(spec.run_id, "incidents"), json.dumps(i))
        for m in doc.get("members", []):
            pipe.hset(layout.run_key(spec.run_id, "members"), str(m["member"]), json.dumps(m))
        pipe.execute()

    def reopen(self, run_id: str) -> None:
        """Back to running for a resume: clear the one-time claims and any failure, and give
        every task a fresh allowance of attempts (the cause of the failure was fixed). Its keys
        no longer expire."""
        self.persist(run_id)
        counts = self.r.hgetall(layout.run_key(run_id, "attempt_n"))
        pipe = self.r.pipeline()
        pipe.delete(layout.run_key(run_id, "claims"), layout.live_key(run_id))
        if counts:
            pipe.hset(layout.run_key(run_id, "attempt_base"), mapping=counts)
        pipe.hset(layout.run_key(run_id), mapping={"state": "running", "progress_at": time.time()})
        pipe.hdel(layout.run_key(run_id), "error", "finished_at", "cancelled_by")
        pipe.execute()

    # -- reading --
    def list_runs(self, limit: int = 50) -> list[dict[str, Any]]:
        """The newest runs with a whole record (a lost one is the store's to list)."""
        out = []
        for run_id in self.r.zrevrange(layout.RUN_INDEX, 0, limit - 1):
            h = self._record(run_id)
            if h is not None:
                out.append(self._summary(run_id, h))
        return out

    def live_specs(self) -> dict[str, dict[str, Any]]:
        """The spec of every run with a whole record that has not finished, by run id."""
        out = {}
        for run_id in self.r.zrange(layout.RUN_INDEX, 0, -1):
            h = self._record(run_id)
            if h is not None and h["state"] not in FINISHED:
                out[run_id] = json.loads(h["spec"])
        return out

    def _record(self, run_id: str) -> dict[str, str] | None:
        h = self.r.hgetall(layout.run_key(run_id))
        return h if whole(h) else None

    def _hash(self, run_id: str) -> dict[str, str]:
        h = self._record(run_id)
        if h is None:
            raise NotFound(self.absent(run_id))
        return h

    def absent(self, run_id: str) -> str:
        """Why the broker cannot describe the run, in one line."""
        if self.r.exists(layout.run_key(run_id)):
            return (f"the broker's record of run {run_id!r} is incomplete (its keys were deleted?); "
                    f"`tensorturn status {run_id}` reads its manifest in the store and "
                    f"`tensorturn resume {run_id}` rebuilds the record from the store")
        return f"no run {run_id!r} on this broker (see `tensorturn runs`)"

    @staticmethod
    def _summary(run_id: str, h: dict[str, str]) -> dict[str, Any]:
        spec = json.loads(h["spec"])
        return {
            "run_id": run_id, "mode": h["mode"], "state": h["state"], "recipe": spec["recipe"],
            "created_at": float(h["created_at"]),
            "finished_at": float(h["finished_at"]) if "finished_at" in h else None,
            "metrics": json.loads(h.get("metrics", "{}")),
            "error": h.get("error"),
        }

    def describe(self, run_id: str) -> dict[str, Any]:
        """The run as the CLI/JSON contract shows it."""
        h = self._hash(run_id)
        spec = json.loads(h["spec"])
        bytes_up, bytes_down = self.bytes_moved(run_id)
        out: dict[str, Any] = {
            "run_id": run_id,
            "mode": h["mode"],
            "state": h["state"],
            "recipe": spec["recipe"],
            "metrics": json.loads(h.get("metrics", "{}")),
            "model_uri": h.get("model_uri"),
            "model_sha256": h.get("model_sha256"),
            "rounds": self.rounds(run_id),
            "attempts": self.attempts(run_id),
            "incidents": self.incidents(run_id),
            "warnings": self.warnings(run_id),
            "data_bytes": self.data_bytes(run_id),
            "data_read_bytes": self.data_bytes(run_id, "data_read"),
            "bytes_up": bytes_up,
            "bytes_down": bytes_down,
            # every object body the run's tasks stored and fetched (θ, outer state, evaluation
            # and dataset reads, retries, its start): what its agents moved through the store
            "store_bytes_up": self.store_bytes(run_id)[0],
            "store_bytes_down": self.store_bytes(run_id)[1],
            "store_bytes_by_worker": self.store_bytes_by_worker(run_id),
            "created_at": float(h["created_at"]),
            "started_at": float(h["started_at"]) if "started_at" in h else None,
            "finished_at": float(h["finished_at"]) if "finished_at" in h else None,
            "progress_at": float(h["progress_at"]) if "progress_at" in h else None,
            "error": h.get("error"),
            "spec": spec,
        }
        if h["state"] == "cancelled":
            out["cancelled"] = {"at": out["finished_at"], "by": h.get("cancelled_by")}
        if h["mode"] == "ensemble":
            out["members"] = self.members(run_id)
        if h["state"] not in FINISHED:  # what its running tasks are doing now
            out.update(live_view(out, self.live(run_id)))
        if spec["recipe"] == "distill":  # a student of an ensemble: where it came from
            o = spec.get("recipe_options") or {}
            out["lineage"] = {"distilled_from": o.get("teacher"), "recipe": o.get("recipe"),
                              "temperature": o.get("temperature"), "alpha": o.get("alpha"),
                              "top_k": o.get("top_k"), "mixup": o.get("mixup", 0),
                              "student": o.get("student") or {}}
        applied = self.r.hvals(layout.run_key(run_id, "applied"))
        if applied:  # an asynchronous fused run: every update, with its staleness
            out["updates"] = sorted((json.loads(v) for v in applied), key=lambda u: u["version"])
        return out
