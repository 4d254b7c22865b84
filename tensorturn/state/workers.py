"""The pool's machines on the broker: one hash per agent (``tt:worker:<name>``), the one owner of
every write to it.

What goes in it: the agent's signed heartbeat and live figures (:mod:`tensorturn.pool.telemetry`),
the task it trains and its progress, its training rate over its last task (backup copies weigh it),
its store failures in a row and a signed quarantine mark (:mod:`tensorturn.tasks.attempt`), and
when it stopped cleanly. An attempt's begin and end write its ``task``, ``tasks_done``,
``last_rate`` and store-failure fields from the attempt's own script
(:mod:`tensorturn.state.attempts`), so the task's protocol stays one round trip each way; the
fields mean what :meth:`Workers.task_ended` and :meth:`Workers.store_ok` write.
:func:`tensorturn.state.roster.list_workers` reads them back, verified.
"""

from __future__ import annotations

import json
import time
from typing import Any

from tensorturn import layout
from tensorturn.state import roster
from tensorturn.state.clock import broker_now
from tensorturn.state.live import Progress
from tensorturn.state.runs import Runs
from tensorturn.store.links import meter

KEEP_S = 7 * 24 * 3600  # a heartbeat hash outlives its agent this long, unless pruned sooner
SAMPLES_KEPT = 100      # timed transfers waiting for the next heartbeat, at most


def take_caps(up: Any, down: Any) -> None:
    """Hand the owner's caps (bytes/s, as a heartbeat stores them; None: no heartbeat says)
    to this process's store (:data:`tensorturn.store.links.meter`)."""
    if up is None and down is None:
        return
    meter.set_caps(roster.number(up), roster.number(down))


def _sample(s: Any) -> bool:
    return (isinstance(s, list) and len(s) == 3 and s[0] in ("up", "down")
            and all(isinstance(x, (int, float)) and x > 0 for x in s[1:]))


# a recipe's figure merged into a worker's JSON field of them (KEYS: its hash; ARGV: recipe, seconds, the field)
_PER_RECIPE = """
if redis.call('exists', KEYS[1]) == 0 then return 0 end
local ok, figures = pcall(cjson.decode, redis.call('hget', KEYS[1], ARGV[3]) or '{}')
if not ok or type(figures) ~= 'table' then figures = {} end
figures[ARGV[1]] = tonumber(ARGV[2])
redis.call('hset', KEYS[1], ARGV[3], cjson.encode(figures))
return 1
"""


class Workers:
    """Every agent's hash."""

    def __init__(self, client: Any):
        self.r = client

    def all(self, **options: Any) -> list[dict[str, Any]]:
        """Every agent with its state (:func:`tensorturn.state.roster.list_workers`)."""
        return roster.list_workers(self.r, **options)

    def online(self) -> set[str]:
        """The names of the agents that take tasks now (verified, online, not quarantined)."""
        return {w["name"] for w in self.all() if w["state"] in roster.TAKES_TASKS}

    def not_offline(self) -> set[str]:
        """The names of the agents whose heartbeat goes on (paused or quarantined ones too: a
        task they run still runs)."""
        return {w["name"] for w in self.all() if w["state"] != roster.WorkerState.OFFLINE}

    # -- the agent's own heartbeat --
    def beat(self, node: str, fields: dict[str, Any], first: bool, idle: bool
             ) -> tuple[str | None, str | None, list[list[Any]]]:
        """Write one heartbeat of ``node`` (``fields``: signed inventory, live figures, pid), in
        one round trip; ``first`` starts its hash afresh, ``idle`` clears a task a killed pool
        child left behind. Returns its quarantine mark, the mark's signature, and the timed
        store transfers of ``node``'s processes since the last beat (:meth:`link_sample`), oldest
        first: [direction, bytes, seconds] each (anything else in the list is dropped)."""
        key = layout.worker_key(node)
        pipe = self.r.pipeline(transaction=False)  # one writer of these fields: no MULTI/EXEC
        if first:
            pipe.delete(key)
            pipe.hset(key, mapping={"started_at": broker_now(self.r), "tasks_done": 0})
        pipe.hset(key, mapping=fields)
        if idle:
            pipe.hdel(key, "task", "progress")
        pipe.expire(key, KEEP_S)
        pipe.hmget(key, "quarantined", roster.QUARANTINE_SIGNATURE)
        pipe.lpop(layout.links_key(node), SAMPLES_KEPT)
        *_, (mark, sig), samples = pipe.execute()
        return mark, sig, [s for s in map(roster.json_value, samples or []) if _sample(s)]

    def round_trips(self, n: int) -> list[float]:
        """The seconds each of ``n`` PINGs to the broker took, one after the other."""
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.r.ping()
            out.append(time.perf_counter() - t0)
        return out

    def link_sample(self, node: str, direction: str, nbytes: int, seconds: float) -> None:
        """A timed store transfer of one of ``node``'s processes, for its next heartbeat
        (:meth:`beat` takes them)."""
        key = layout.links_key(node)
        pipe = self.r.pipeline(transaction=False)
        pipe.rpush(key, json.dumps([direction, int(nbytes), float(seconds)]))
        pipe.ltrim(key, -SAMPLES_KEPT, -1)
        pipe.expire(key, KEEP_S)
        pipe.execute()

    def unquarantine(self, node: str) -> None:
        """Remove ``node``'s quarantine mark (one its own tasks did not sign)."""
        self.r.hdel(layout.worker_key(node), "quarantined", roster.QUARANTINE_SIGNATURE)

    def stopped(self, node: str) -> None:
        """``node`` stopped cleanly: offline at once, not after three missed heartbeats."""
        self.r.hset(layout.worker_key(node), "stopped_at", broker_now(self.r))

    # -- the task it trains --
    def report(self, worker: str, label: str, progress: dict[str, Any],
               live: tuple[str, str, dict[str, Any]] | None = None) -> tuple[str | None, str | None]:
        """Say which task ``worker`` trains and how far it is, in one round trip; with ``live``
        (run id, field, entry) the same report goes to the run's live hash
        (:class:`tensorturn.state.live.Progress`) and the run's state is read back (a training
        loop learns of a cancel from its report). Returns that state (None without ``live``)
        and why ``worker`` is paused (None when it is not: :mod:`tensorturn.pool.owner`)."""
        key = layout.worker_key(worker)
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(key, mapping={"task": label, "progress": json.dumps(progress)})
        pipe.hmget(key, "paused", "cap_up_bps", "cap_down_bps")
        if live is not None:
            run_id, field, entry = live
            Progress(self.r).write(run_id, field, entry, pipe)
            Runs(self.r).state_field(run_id, pipe)
        replies = pipe.execute()
        paused, up, down = replies[1]
        take_caps(up, down)  # a rules change holds for the task's next transfer
        return (replies[-1] if live is not None else None), (paused or None)

    def task_ended(self, worker: str, done: bool, rate: float | None, pipe: Any) -> None:
        """``worker``'s task ended, in ``pipe``: ``done`` when its output is the one recorded
        (any task counts — an outer step or an evaluation as much as a shard; a late copy does
        not); with a ``rate`` it trained, at that many samples/s over the whole of it."""
        key = layout.worker_key(worker)
        pipe.hdel(key, "task")
        if done:
            pipe.hincrby(key, "tasks_done", 1)
        if rate is not None:
            pipe.hset(key, "last_rate", rate)

    def step_time(self, worker: str, recipe: str, seconds: float, pipe: Any) -> None:
        """``worker`` steps ``recipe`` in ``seconds`` (its ``step_s``: JSON, recipe → seconds,
        read by a fused run's plan), in ``pipe``."""
        pipe.eval(_PER_RECIPE, 1, layout.worker_key(worker), recipe, f"{seconds:.6g}", "step_s")

    def eval_time(self, worker: str, recipe: str, seconds: float) -> None:
        """``worker`` evaluated a round of ``recipe`` in ``seconds``, θ's download included (its
        ``eval_s``: JSON, recipe → seconds; an agent that takes the outer steps takes the
        evaluations too, one after the other, and a fused run's plan counts both)."""
        self.r.eval(_PER_RECIPE, 1, layout.worker_key(worker), recipe, f"{seconds:.6g}", "eval_s")

    def outer_rate(self, worker: str, seconds_per_unit: float) -> None:
        """``worker``'s outer step took ``seconds_per_unit`` a unit of its work
        (:func:`tensorturn.modes.fused.plan.outer_units`; its ``outer_s_unit``, read by a fused
        run's plan)."""
        self.r.hset(layout.worker_key(worker), "outer_s_unit", f"{seconds_per_unit:.6g}")

    def last_rate(self, worker: str) -> float | None:
        """``worker``'s training rate over its last whole task (samples/s); None before one."""
        raw = self.r.hget(layout.worker_key(worker), "last_rate")
        try:
            return float(raw) if raw is not None else None
        except ValueError:
            return None

    # -- store failures and quarantine --
    def store_ok(self, worker: str, pipe: Any = None) -> None:
        """``worker`` reached the store: its failures in a row start again from none."""
        (pipe or self.r).hdel(layout.worker_key(worker), "store_failures", "store_failing_since")

    def store_failed(self, worker: str) -> tuple[int, float]:
        """Count a store failure of ``worker``; returns its failures in a row and since when."""
        key = layout.worker_key(worker)
        self.r.hsetnx(key, "store_failing_since", broker_now(self.r))
        failures = int(self.r.hincrby(key, "store_failures", 1))
        since = float(self.r.hget(key, "store_failing_since") or broker_now(self.r))
        return failures, since

    def quarantine(self, worker: str, mark: dict[str, str]) -> None:
        """Write ``worker``'s signed quarantine ``mark`` (:func:`tensorturn.pool.telemetry.quarantine_mark`)."""
        self.r.hset(layout.worker_key(worker), mapping=mark)
