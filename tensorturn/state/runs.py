"""The runs: each run's hash (``tt:run:<id>``: state, mode, spec, figures, times) and the list of
runs (``tt:runs``).

A run's hash is *whole* when it holds every field :meth:`Runs.create` writes
(:data:`tensorturn.layout.RECORD`). One that is not — its keys were deleted or expired while a
task still wrote progress to it — is no record: every reader treats it as lost (``status`` reads
the store's manifest, ``resume`` rebuilds the record from the store, a task does nothing), and no
writer creates or completes one.
"""

from __future__ import annotations

import json
from typing import Any

from tensorturn import layout
from tensorturn.errors import NotFound
from tensorturn.spec import FINISHED, RunSpec, RunState
from tensorturn.state.clock import broker_now

# Writers of the run's hash leave alone a hash without a spec: they must not make one up (a task
# still running when the run's keys were deleted would otherwise leave a partial record behind).
_FINISH_ONCE = ("if redis.call('hexists', KEYS[1], 'spec') == 0 then return 0 end "
                "local s = redis.call('hget', KEYS[1], 'state') "
                "if s == 'succeeded' or s == 'failed' or s == 'cancelled' then return 0 end "
                "redis.call('hset', KEYS[1], unpack(ARGV)) redis.call('del', KEYS[2]) return 1")
_SET_IF_WHOLE = ("if redis.call('hexists', KEYS[1], 'spec') == 1 then "
                 "redis.call('hset', KEYS[1], ARGV[1], ARGV[2]) end")
_QUEUED_TO_RUNNING = ("if redis.call('hget', KEYS[1], 'state') == 'queued' then "
                      "redis.call('hset', KEYS[1], 'state', 'running', 'started_at', ARGV[1]) end")

SMALL = tuple(f for f in layout.RECORD if f != "spec")  # a record's fields besides the spec

# What :func:`state_of` reads, in one command (a running attempt looks often): the record's
# fields, and of the spec only whether it is there (it may be kilobytes). KEYS: the run's hash,
# then optionally a worker's hash (its quarantine mark is read too); ARGV: SMALL.
_READ_STATE = """
local out = {redis.call('hmget', KEYS[1], unpack(ARGV)), redis.call('hexists', KEYS[1], 'spec')}
if KEYS[2] then
  out[3] = redis.call('hget', KEYS[2], 'quarantined')
  out[4] = redis.call('hget', KEYS[2], 'paused')
  out[5] = redis.call('hget', KEYS[2], 'cap_up_bps')
  out[6] = redis.call('hget', KEYS[2], 'cap_down_bps')
end
return out
"""


def whole(h: dict[str, str]) -> bool:
    """Whether a run's hash holds every field of a record (:data:`tensorturn.layout.RECORD`)."""
    return all(h.get(field) is not None for field in layout.RECORD)


def read_state(client: Any, run_id: str, worker: str | None = None) -> Any:
    """Read (with a pipeline: queue) what :func:`state_of` takes, in one command; with a
    ``worker``, its quarantine mark and why it is paused too (the reply's third and fourth
    items: None, or a false value, when it has none), and its owner's caps on the store link
    (fifth and sixth: bytes/s up and down, as its heartbeat says; None before one says)."""
    keys = [layout.run_key(run_id)] + ([layout.worker_key(worker)] if worker is not None else [])
    return client.eval(_READ_STATE, len(keys), *keys, *SMALL)


def state_of(reply: list[Any]) -> str | None:
    """The run's state from :func:`read_state`'s reply; None unless its record is whole."""
    fields, has_spec = reply[0], reply[1]
    return dict(zip(SMALL, fields))["state"] if has_spec and None not in fields else None


def encode(fields: dict[str, Any]) -> dict[str, Any]:
    """Hash fields as stored: dicts and lists as JSON, None left out."""
    return {k: json.dumps(v) if isinstance(v, (dict, list)) else v
            for k, v in fields.items() if v is not None}


class Runs:
    """Each run's hash and the list of runs. ``pipe``: a pipeline of the caller's, so writes of
    several structures go in one round trip (:class:`tensorturn.state.board.RunBoard`)."""

    def __init__(self, client: Any):
        self.r = client

    def create(self, spec: RunSpec, state: str = RunState.QUEUED) -> None:
        pipe = self.r.pipeline()
        pipe.hset(layout.run_key(spec.run_id), mapping={
            "run_id": spec.run_id, "mode": spec.mode, "state": str(state),
            "spec": json.dumps(spec.to_json()), "created_at": spec.created_at,
            "progress_at": broker_now(self.r)})
        pipe.zadd(layout.RUN_INDEX, {spec.run_id: spec.created_at})
        pipe.execute()

    def update_spec(self, spec: RunSpec) -> None:
        self.r.hset(layout.run_key(spec.run_id), "spec", json.dumps(spec.to_json()))

    def max_attempts(self, run_id: str) -> int | None:
        """The run's attempt cap, from the spec the broker keeps beside its state (for a machine
        that cannot read the spec from its own store); None without a record."""
        spec = self.r.hget(layout.run_key(run_id), "spec")
        cap = json.loads(spec).get("max_attempts") if spec else None
        return cap if isinstance(cap, int) else None

    def record(self, run_id: str) -> dict[str, str] | None:
        """The run's hash when it is whole, else None."""
        h = self.r.hgetall(layout.run_key(run_id))
        return h if whole(h) else None

    def exists(self, run_id: str) -> bool:
        """Whether the broker holds the run's record, whole (a partial hash is a lost record)."""
        return self.record(run_id) is not None

    def hash(self, run_id: str) -> dict[str, str]:
        """The run's whole hash; NotFound (saying why) when there is none."""
        h = self.record(run_id)
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

    def state(self, run_id: str) -> str | None:
        """The run's state; None when the broker has no whole record of it."""
        return state_of(read_state(self.r, run_id))

    def is_finished(self, run_id: str) -> bool:
        return self.state(run_id) in FINISHED

    def state_field(self, run_id: str, pipe: Any) -> None:
        """Queue in ``pipe`` a read of the hash's ``state`` field alone (whole or not)."""
        pipe.hget(layout.run_key(run_id), "state")

    def mark_running(self, run_id: str, pipe: Any = None) -> None:
        """queued → running only; never overwrites a finished state (in ``pipe``, when given)."""
        (pipe or self.r).eval(_QUEUED_TO_RUNNING, 1, layout.run_key(run_id), broker_now(self.r))

    def touch(self, run_id: str, pipe: Any = None) -> None:
        """Note that the run made progress now (``status`` reports runs that stop doing so)."""
        (pipe or self.r).eval(_SET_IF_WHOLE, 1, layout.run_key(run_id), "progress_at", broker_now(self.r))

    def finish(self, run_id: str, state: str, pipe: Any = None, **fields: Any) -> bool:
        """Move to a finished state once (its live progress goes); False for a run that had
        finished or has no whole record. ``finished_at`` is now unless ``fields`` say it. In
        ``pipe``, when given: then the answer is not known here (True)."""
        mapping = encode(fields)  # (``finished_at`` among them: a time already written to the store)
        mapping.update(state=str(state))
        mapping.setdefault("finished_at", broker_now(self.r))
        args = [x for kv in mapping.items() for x in kv]
        keys = (layout.run_key(run_id), layout.live_key(run_id))
        if pipe is not None:
            pipe.eval(_FINISH_ONCE, 2, *keys, *args)
            return True
        return bool(self.r.eval(_FINISH_ONCE, 2, *keys, *args))

    def reopen(self, run_id: str, pipe: Any) -> None:
        """Back to running (a resume), its failure and finish cleared, in ``pipe``."""
        pipe.hset(layout.run_key(run_id), mapping={"state": str(RunState.RUNNING),
                                                    "progress_at": broker_now(self.r)})
        pipe.hdel(layout.run_key(run_id), "error", "finished_at", "cancelled_by")

    # -- how long the run's keys live --
    def keys(self, run_id: str) -> list[str]:
        """Every key of the run on the broker: its hash and its sibling records."""
        main = layout.run_key(run_id)
        siblings = list(self.r.scan_iter(match=layout.run_keys_pattern(run_id), count=10000))
        return ([main] if self.r.exists(main) else []) + siblings

    def expire(self, run_id: str, ttl: int) -> None:
        """Let every key of the run expire after ``ttl`` seconds (not ``kept`` any more)."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hdel(layout.run_key(run_id), "kept")
        for key in self.keys(run_id):
            pipe.expire(key, ttl)
        pipe.execute()

    def persist(self, run_id: str) -> None:
        """Keep every key of the run (a run resumed runs again)."""
        pipe = self.r.pipeline(transaction=False)
        for key in self.keys(run_id):
            pipe.persist(key)
        pipe.execute()

    def keep(self, run_id: str) -> None:
        """Keep every key of the run, marked ``kept``: the broker holds its only whole record."""
        self.persist(run_id)
        self.r.eval(_SET_IF_WHOLE, 1, layout.run_key(run_id), "kept", broker_now(self.r))

    def forget(self, run_id: str) -> int:
        """Delete every key of the run, and its place in the list of runs; returns how many."""
        keys = self.keys(run_id)
        pipe = self.r.pipeline()
        if keys:
            pipe.delete(*keys)
        pipe.zrem(layout.RUN_INDEX, run_id)
        pipe.execute()
        return len(keys)

    # -- the answer to a request to start the run (tensorturn.tasks.start.start_run) --
    def answer_start(self, run_id: str, reply: dict[str, Any]) -> None:
        """Leave the agent's ``reply`` for the submitter, who reads it at once; kept an hour."""
        answer = layout.run_key(run_id, "started")
        pipe = self.r.pipeline()
        pipe.rpush(answer, json.dumps(reply))
        pipe.expire(answer, 3600)
        pipe.execute()

    def first_timing(self, run_id: str, worker: str) -> str | None:
        """Mark that ``worker`` times a step of ``run_id``'s θ_0 for its plan (kept an hour).
        None for the first try; for a start delivered again, the worker whose try it was — that
        try's process went away while it trained (out of memory, killed), and so would this one."""
        mark = layout.run_key(run_id, "timing")
        if self.r.set(mark, worker, nx=True, ex=3600):
            return None
        before = self.r.get(mark)
        return before.decode() if isinstance(before, bytes) else str(before)

    def timed(self, run_id: str) -> None:
        """The step :meth:`first_timing` marked has ended, one way or the other: the mark goes."""
        self.r.delete(layout.run_key(run_id, "timing"))

    def start_answer(self, run_id: str, timeout_s: int = 1) -> dict[str, Any] | None:
        """The agent's answer to the request to start ``run_id``, taken off the list; None when
        none came within ``timeout_s``."""
        answer = self.r.blpop([layout.run_key(run_id, "started")], timeout=timeout_s)
        return json.loads(answer[1]) if answer is not None else None

    # -- the list of runs --
    def list_runs(self, limit: int = 50) -> list[dict[str, Any]]:
        """The newest runs with a whole record (a lost one is the store's to list)."""
        out = []
        for run_id in self.r.zrevrange(layout.RUN_INDEX, 0, limit - 1):
            h = self.record(run_id)
            if h is not None:
                out.append(summary(run_id, h))
        return out

    def live_specs(self) -> dict[str, dict[str, Any]]:
        """The spec of every run with a whole record that has not finished, by run id."""
        out = {}
        for run_id in self.r.zrange(layout.RUN_INDEX, 0, -1):
            h = self.record(run_id)
            if h is not None and h["state"] not in FINISHED:
                out[run_id] = json.loads(h["spec"])
        return out


def summary(run_id: str, h: dict[str, str]) -> dict[str, Any]:
    """A line of ``tensorturn runs``: the run's whole hash ``h`` in short."""
    spec = json.loads(h["spec"])
    return {
        "run_id": run_id, "mode": h["mode"], "state": h["state"], "recipe": spec["recipe"],
        "created_at": float(h["created_at"]),
        "finished_at": float(h["finished_at"]) if "finished_at" in h else None,
        "metrics": json.loads(h.get("metrics", "{}")),
        "error": h.get("error"),
    }
