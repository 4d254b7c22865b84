"""Each task's attempts on the broker (``tt:run:<id>:attempts``: task, number, worker, times,
outcome), and how many attempts each task has had (``attempt_n``) since the run was last started
or resumed (``attempt_base``: the count when it was)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from tensorturn import layout
from tensorturn.config import mask_text
from tensorturn.spec import Outcome
from tensorturn.state.incidents import Incidents
from tensorturn.state.runs import Runs


class Attempts:
    """A run's attempts. Beginning and finishing one also notes the run's progress
    (:meth:`Runs.touch`) and what was lost on the way (:class:`Incidents`)."""

    def __init__(self, client: Any, runs: Runs, incidents: Incidents):
        self.r, self.runs, self.incidents = client, runs, incidents

    def begin(self, run_id: str, task: str, worker: str,
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
            if raw and json.loads(raw)["outcome"] == Outcome.RUNNING:
                self.finish(run_id, f"{task}#{i}", Outcome.LOST.says("requeued to another attempt"))
                self.incidents.add(run_id, "requeued", task, json.loads(raw)["worker"],
                                   f"attempt {i} was lost (its worker stopped answering); attempt {n} "
                                   f"started on {worker}")
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(layout.run_key(run_id, "attempts"), key, json.dumps({
            "task": task, "attempt": n, "worker": worker, "started_at": time.time(),
            "finished_at": None, "outcome": str(Outcome.RUNNING)}))
        self.runs.mark_running(run_id, pipe)
        self.runs.touch(run_id, pipe)
        self.runs.state_field(run_id, pipe)
        state = pipe.execute()[-1]
        if n - base <= max_attempts:
            return key, n - base, state
        self.finish(run_id, key, Outcome.REFUSED.says("attempt limit reached"))
        self.incidents.add(run_id, "attempt_limit", task, worker,
                           f"attempt {n - base} refused: the task already had {max_attempts}")
        return None

    def finish(self, run_id: str, key: str, outcome: str,
               also: Callable[[Any], None] | None = None, traceback: str | None = None) -> None:
        """Record the attempt's outcome (a failure's ``traceback`` with it: its last frames,
        bounded — :func:`tensorturn.tracebacks.tail`); ``also(pipeline)`` adds writes that go
        with it, in the same round trip.

        The first attempt of a task to succeed is the one recorded as succeeded (a marker set
        once, atomically, in the round trip that reads the entry): another copy that stored the
        same output too — a partitioned machine that healed and finished beside the attempt
        that replaced it — is recorded ``late``, so a task is counted once."""
        task = key.rpartition("#")[0]
        marker = layout.run_key(run_id, "succeeded")
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(layout.run_key(run_id, "attempts"), key)
        if outcome == Outcome.SUCCEEDED:
            pipe.hsetnx(marker, task, key)
            pipe.hget(marker, task)
        raw, *first = pipe.execute()
        if first and first[-1] != key:
            outcome = Outcome.LATE.says(f"attempt {first[-1].rpartition('#')[2]} of this task "
                                        "stored the same output first")
        pipe = self.r.pipeline(transaction=False)
        if raw is not None:
            entry = json.loads(raw)
            entry.update(finished_at=time.time(), outcome=mask_text(str(outcome)))
            if traceback:
                entry["traceback"] = mask_text(traceback)
            pipe.hset(layout.run_key(run_id, "attempts"), key, json.dumps(entry))
            self.runs.touch(run_id, pipe)
        if also is not None:
            also(pipe)
        pipe.execute()

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
