"""Each task's attempts on the broker (``tt:run:<id>:attempts``: task, number, worker, times,
outcome), and how many attempts each task has had (``attempt_n``) since the run was last started
or resumed (``attempt_base``: the count when it was)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensorturn import layout
from tensorturn.config import mask_text
from tensorturn.spec import Outcome
from tensorturn.state.clock import broker_now
from tensorturn.state.incidents import Incidents
from tensorturn.state.runs import Runs
from tensorturn.state.traffic import Traffic
from tensorturn.state.workers import Workers

# Begin an attempt, in one round trip. KEYS: attempt_n, attempt_base, attempts, the run's hash, the
# worker's hash, kombu's lease index; ARGV: task, the entry's JSON before and after its number,
# now, the task's label, the delivery tag of the message it runs under ('' for none), how long
# a lease lives. A message delivered while the task's latest attempt runs under another message's
# lease that is still fresh is a copy (a replay): nothing is written, and 'held' is returned with
# that attempt's entry. Else: counts the attempt, writes its entry, moves the run queued → running
# and notes its progress (a whole record only), names the task on the worker's hash; returns the
# number, the base, the run's state, the entry as written, then the entries of the task's earlier
# attempts since base.
_BEGIN = """
local last = redis.call('hget', KEYS[1], ARGV[1])
if last and ARGV[6] ~= '' then
  local raw = redis.call('hget', KEYS[3], ARGV[1] .. '#' .. last)
  local e = raw and cjson.decode(raw)
  if e and e['outcome'] == 'running' and type(e['lease']) == 'string' and e['lease'] ~= ARGV[6] then
    local score = redis.call('zscore', KEYS[6], e['lease'])
    if score and tonumber(score) > tonumber(ARGV[4]) - tonumber(ARGV[7]) then return {'held', raw} end
  end
end
local n = redis.call('hincrby', KEYS[1], ARGV[1], 1)
local base = tonumber(redis.call('hget', KEYS[2], ARGV[1]) or '0')
local entry = ARGV[2] .. n .. ARGV[3]
local out = {n, base, false, entry}
for i = base + 1, n - 1 do
  local raw = redis.call('hget', KEYS[3], ARGV[1] .. '#' .. i)
  if raw then out[#out + 1] = raw end
end
redis.call('hset', KEYS[3], ARGV[1] .. '#' .. n, entry)
if redis.call('hget', KEYS[4], 'state') == 'queued' then
  redis.call('hset', KEYS[4], 'state', 'running', 'started_at', ARGV[4])
end
if redis.call('hexists', KEYS[4], 'spec') == 1 then redis.call('hset', KEYS[4], 'progress_at', ARGV[4]) end
redis.call('hset', KEYS[5], 'task', ARGV[5])
redis.call('hdel', KEYS[5], 'progress')
out[3] = redis.call('hget', KEYS[4], 'state')
return out
"""

# Finish an attempt whose entry this process wrote, with its figures, in one round trip. KEYS:
# attempts, succeeded, the run's hash, bytes, store_bytes, the worker's hash. ARGV: 1 key, 2 task,
# 3 the entry as begun, 4 the entry finished, 5-6 the entry finished late, before and after the
# number of the attempt that stored first, 7 succeeded ('1'/'0'), 8 now, 9 the task's bytes
# ('up,down', or '' for none), 10-11 store bytes up and down, 12 worker, 13 the store answered
# ('1'/'0'), 14 the training rate ('' for none), 15-16 a recipe and its step seconds, merged
# into the worker's step_s (16 '' for none: Workers.step_time). Returns 0; 1 when the entry is not the one begun
# (a resume restored it, or another agent marked it lost): nothing is written then, and the
# caller finishes it the long way.
_FINISH = """
local raw = redis.call('hget', KEYS[1], ARGV[1])
if raw and raw ~= ARGV[3] then return 1 end
local late = false
if ARGV[7] == '1' then
  redis.call('hsetnx', KEYS[2], ARGV[2], ARGV[1])
  local first = redis.call('hget', KEYS[2], ARGV[2])
  if first ~= ARGV[1] then late = string.match(first, '#(%d+)$') or '?' end
end
if raw then
  if late then redis.call('hset', KEYS[1], ARGV[1], ARGV[5] .. late .. ARGV[6])
  else redis.call('hset', KEYS[1], ARGV[1], ARGV[4]) end
  if redis.call('hexists', KEYS[3], 'spec') == 1 then redis.call('hset', KEYS[3], 'progress_at', ARGV[8]) end
end
if ARGV[7] == '1' and not late and ARGV[9] ~= '' then redis.call('hsetnx', KEYS[4], ARGV[2], ARGV[9]) end
local up, down, w = tonumber(ARGV[10]), tonumber(ARGV[11]), ARGV[12]
if up ~= 0 or down ~= 0 then
  redis.call('hincrby', KEYS[5], 'up', up)
  redis.call('hincrby', KEYS[5], 'down', down)
  redis.call('hincrby', KEYS[5], 'up@' .. w, up)
  redis.call('hincrby', KEYS[5], 'down@' .. w, down)
end
if ARGV[13] == '1' then redis.call('hdel', KEYS[6], 'store_failures', 'store_failing_since') end
redis.call('hdel', KEYS[6], 'task')
if ARGV[7] == '1' and not late then redis.call('hincrby', KEYS[6], 'tasks_done', 1) end
if ARGV[14] ~= '' then redis.call('hset', KEYS[6], 'last_rate', ARGV[14]) end
if ARGV[16] ~= '' then
  local ok, steps = pcall(cjson.decode, redis.call('hget', KEYS[6], 'step_s') or '{}')
  if not ok or type(steps) ~= 'table' then steps = {} end
  steps[ARGV[15]] = tonumber(ARGV[16])
  redis.call('hset', KEYS[6], 'step_s', cjson.encode(steps))
end
return 0
"""

# The latest attempt's entry of a task (KEYS: attempt_n, attempts; ARGV: the task), or nil.
_LATEST = """
local n = redis.call('hget', KEYS[1], ARGV[1])
if not n then return nil end
return redis.call('hget', KEYS[2], ARGV[1] .. '#' .. n)
"""

NUMBER = "\x00attempt\x00"   # where an entry's number goes, split off before Redis fills it in


def split_at(doc: dict[str, Any], place: str, in_text: bool = False) -> tuple[str, str]:
    """``doc`` as JSON, cut where the string ``place`` stands — a whole value, or with
    ``in_text`` a part of one: the text before it and after it."""
    encoded = json.dumps(place)
    head, found, tail = json.dumps(doc).partition(encoded[1:-1] if in_text else encoded)
    assert found, place
    return head, tail


@dataclass
class Figures:
    """What an attempt's end records besides its outcome, in the same round trip: the task's
    bytes up and down (its output counted once, on success), what the attempt moved through the
    store, whether the store answered (the worker's failures in a row end), and the worker's
    training rate over the task (None: it trained nothing), and when its training began (the
    entry's ``trained_from``: what came before it was fetching the weights and the data)."""

    worker: str
    bytes_up: int = 0
    bytes_down: int = 0
    store_up: int = 0
    store_down: int = 0
    store_ok: bool = True
    rate: float | None = None
    trained_from: float | None = None  # when it began training, on the broker's clock (before: θ and data)
    trained_s: float | None = None  # how long it trained (after: storing its output)
    step: tuple[str, float] | None = None  # (recipe, seconds a step) the worker publishes for plans

    def entry(self) -> dict[str, Any]:
        """What the figures add to the attempt's own entry."""
        out: dict[str, Any] = {} if self.trained_from is None else {"trained_from": self.trained_from}
        if self.trained_s is not None:
            out["trained_s"] = round(self.trained_s, 3)
        return out


class Held(Exception):
    """A task's message is a copy of the one its running attempt holds under a live lease (a
    replayed message): no attempt begins, and the running one goes on. Its text says which."""


class Attempts:
    """A run's attempts. Beginning and finishing one also notes the run's progress
    (:meth:`Runs.touch`) and what was lost on the way (:class:`Incidents`).

    Each takes one round trip (a Lua script): an attempt's begin and end are the protocol every
    task pays, on a home link at its RTT. The entry this process wrote at the begin is kept
    (``begun``) so that the end can write the finished entry without reading it first."""

    def __init__(self, client: Any, runs: Runs, incidents: Incidents):
        self.r, self.runs, self.incidents = client, runs, incidents
        self.begun: dict[tuple[str, str], str] = {}

    def begin(self, run_id: str, task: str, worker: str, max_attempts: int,
              lease: str | None = None, lease_s: float = 0.0) -> tuple[str, int, str | None] | None:
        """Record a new attempt of ``task``; returns its key, its number (1, 2, ...) and the
        run's state as it began (a run cancelled meanwhile: the attempt stops at once).

        ``lease``: the delivery tag of the message the attempt runs under (kombu's lease on it
        lives ``lease_s`` unless refreshed, :mod:`tensorturn.pool.lease`). While the task's
        latest attempt runs under another message whose lease is fresh — its machine is alive
        and holds it — this message is a copy: :class:`Held` is raised and nothing is written.
        Once that lease lapsed (the machine died; its message is delivered again, under its
        own tag), the new attempt takes over and the old one is recorded lost.

        Past ``max_attempts`` (counted since the run was last started or resumed: a task that
        keeps killing its worker is redelivered without end) the attempt is recorded as refused,
        with an incident, and None is returned.
        """
        now = broker_now(self.r)  # every machine's attempts on one clock
        doc = {"task": task, "attempt": NUMBER, "worker": worker, "started_at": now,
               "finished_at": None, "outcome": str(Outcome.RUNNING), **({"lease": lease} if lease else {})}
        head, tail = split_at(doc, NUMBER)
        keys = [layout.run_key(run_id, part) for part in ("attempt_n", "attempt_base", "attempts")]
        keys += [layout.run_key(run_id), layout.worker_key(worker), layout.UNACKED_INDEX]
        n, base, *rest = self.r.eval(_BEGIN, 6, *keys, task, head, tail, now, task, lease or "", lease_s)
        if n == "held":
            running = json.loads(base)
            raise Held(f"a copy of its message, delivered while attempt {running['attempt']} runs on "
                       f"{running['worker']} under a live lease; acknowledged without an attempt")
        state, entry, *earlier = rest
        n, base = int(n), int(base)
        key = f"{task}#{n}"
        self.begun[(run_id, key)] = entry
        for raw in earlier:
            # an earlier attempt still "running" was lost with its machine
            lost = json.loads(raw)
            if lost["outcome"] == Outcome.RUNNING:
                self.finish(run_id, f"{task}#{lost['attempt']}", Outcome.LOST.says("requeued to another attempt"))
                self.incidents.add(run_id, "requeued", task, lost["worker"],
                                   f"attempt {lost['attempt']} was lost (its worker stopped answering); "
                                   f"attempt {n} started on {worker}")
        if n - base <= max_attempts:
            return key, n - base, state
        self.finish(run_id, key, Outcome.REFUSED.says("attempt limit reached"))
        self.incidents.add(run_id, "attempt_limit", task, worker,
                           f"attempt {n - base} refused: the task already had {max_attempts}")
        return None

    def finish(self, run_id: str, key: str, outcome: str,
               also: Callable[[Any], None] | None = None, traceback: str | None = None,
               figures: Figures | None = None) -> None:
        """Record the attempt's outcome (a failure's ``traceback`` with it: its last frames,
        bounded — :func:`tensorturn.tracebacks.tail`) and its ``figures``; ``also(pipeline)``
        adds writes that go with it, in the same round trip, after it.

        The first attempt of a task to succeed is the one recorded as succeeded (a marker set
        once, atomically, in the round trip that reads the entry): another copy that stored the
        same output too — a partitioned machine that healed and finished beside the attempt
        that replaced it — is recorded ``late``, so a task is counted once."""
        begun = self.begun.pop((run_id, key), None)
        if begun is not None:
            figures = figures or Figures(json.loads(begun)["worker"], store_ok=False)
            if also is None and not self._finish_begun(run_id, key, begun, outcome, traceback, figures):
                return
        task = key.rpartition("#")[0]
        marker = layout.run_key(run_id, "succeeded")
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(layout.run_key(run_id, "attempts"), key)
        if outcome == Outcome.SUCCEEDED:
            pipe.hsetnx(marker, task, key)
            pipe.hget(marker, task)
        raw, *first = pipe.execute()
        if first and first[-1] != key:
            outcome = Outcome.LATE.says(late_why(first[-1].rpartition('#')[2]))
        pipe = self.r.pipeline(transaction=False)
        if raw is not None:
            entry = json.loads(raw)
            entry.update(finished_at=broker_now(self.r), outcome=mask_text(str(outcome)),
                         **(figures.entry() if figures is not None else {}))
            if traceback:
                entry["traceback"] = mask_text(traceback)
            pipe.hset(layout.run_key(run_id, "attempts"), key, json.dumps(entry))
            self.runs.touch(run_id, pipe)
        if figures is not None:
            self._figures(run_id, task, outcome, figures, pipe)
        if also is not None:
            also(pipe)
        pipe.execute()

    def _finish_begun(self, run_id: str, key: str, begun: str, outcome: str, traceback: str | None,
                      figures: Figures) -> bool:
        """:meth:`finish` in one round trip, for an entry this process began; False when done,
        True when the entry changed since (the long way is left to do)."""
        task = key.rpartition("#")[0]
        now = broker_now(self.r)
        entry = {**json.loads(begun), "finished_at": now, **figures.entry()}
        finished = {**entry, "outcome": mask_text(str(outcome))}
        if traceback:
            finished["traceback"] = mask_text(traceback)
        late_head, late_tail = split_at({**finished, "outcome": Outcome.LATE.says(late_why(NUMBER))},
                                        NUMBER, in_text=True)
        succeeded = outcome == Outcome.SUCCEEDED
        keys = [layout.run_key(run_id, part) for part in ("attempts", "succeeded")]
        keys += [layout.run_key(run_id), layout.run_key(run_id, "bytes"), layout.run_key(run_id, "store_bytes"),
                 layout.worker_key(figures.worker)]
        changed = self.r.eval(
            _FINISH, 6, *keys, key, task, begun, json.dumps(finished), late_head, late_tail,
            "1" if succeeded else "0", now,
            f"{figures.bytes_up},{figures.bytes_down}" if succeeded else "",
            figures.store_up, figures.store_down, figures.worker, "1" if figures.store_ok else "0",
            "" if figures.rate is None else figures.rate,
            figures.step[0] if figures.step else "", f"{figures.step[1]:.6g}" if figures.step else "")
        return bool(int(changed))

    def _figures(self, run_id: str, task: str, outcome: str, figures: Figures, pipe: Any) -> None:
        """The writes of :class:`Figures`, in ``pipe`` (the long way of :meth:`finish`)."""
        traffic, workers = Traffic(self.r), Workers(self.r)
        if outcome == Outcome.SUCCEEDED:
            traffic.add_bytes(run_id, task, figures.bytes_up, figures.bytes_down, pipe)
        traffic.add_store_bytes(run_id, figures.store_up, figures.store_down, figures.worker, pipe)
        if figures.store_ok:
            workers.store_ok(figures.worker, pipe)
        workers.task_ended(figures.worker, outcome == Outcome.SUCCEEDED, figures.rate, pipe)
        if figures.step:
            workers.step_time(figures.worker, *figures.step, pipe)

    def latest(self, run_id: str, task: str) -> dict[str, Any] | None:
        """The entry of ``task``'s latest attempt, or None before its first (one round trip)."""
        raw = self.r.eval(_LATEST, 2, layout.run_key(run_id, "attempt_n"), layout.run_key(run_id, "attempts"), task)
        return json.loads(raw) if raw else None

    def has_succeeded(self, run_id: str, task: str) -> bool:
        """Whether an attempt of ``task`` is recorded succeeded (since the run last resumed)."""
        return bool(self.r.hexists(layout.run_key(run_id, "succeeded"), task))

    def all(self, run_id: str) -> list[dict[str, Any]]:
        entries = [json.loads(v) for v in self.r.hgetall(layout.run_key(run_id, "attempts")).values()]
        return sorted(entries, key=lambda e: (e["started_at"], e["task"]))

    def give_back(self, run_id: str, task: str) -> None:
        """``task`` gets one attempt back (one its machine, not the task, used up)."""
        self.r.hincrby(layout.run_key(run_id, "attempt_base"), task, 1)

    def restore(self, run_id: str, entries: list[dict[str, Any]], pipe: Any) -> None:
        """Put back a manifest's attempts, each task's allowance counted from its last one (a
        resume), in ``pipe``."""
        pipe.delete(layout.run_key(run_id, "succeeded"))  # a task redone after a resume counts again
        for a in entries:
            pipe.hset(layout.run_key(run_id, "attempts"), f"{a['task']}#{a['attempt']}", json.dumps(a))
            pipe.hset(layout.run_key(run_id, "attempt_n"), a["task"], a["attempt"])
            pipe.hset(layout.run_key(run_id, "attempt_base"), a["task"], a["attempt"])

    def fresh_allowance(self, run_id: str, pipe: Any) -> None:
        """Every task gets its attempts again, counted from now (a resume: the cause of the
        failure was fixed); the counts are read now, the write goes in ``pipe``."""
        counts = self.r.hgetall(layout.run_key(run_id, "attempt_n"))
        pipe.delete(layout.run_key(run_id, "succeeded"))  # a task redone after a resume counts again
        if counts:
            pipe.hset(layout.run_key(run_id, "attempt_base"), mapping=counts)


def late_why(first: str) -> str:
    """Why a successful attempt is recorded late: attempt ``first`` of its task stored first."""
    return f"attempt {first} of this task stored the same output first"
