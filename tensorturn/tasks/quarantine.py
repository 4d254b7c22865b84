"""Agents that keep failing: a machine whose store calls fail while other machines' succeed (wrong
credentials, say), or that refuses the run's recipe, is taken out of rotation — it stops taking
tasks, and says why — so it cannot burn the run's attempts (:func:`tensorturn.tasks.attempt.execute`
decides, with these)."""

from __future__ import annotations

import time
from typing import Any

from celery import Task

from tensorturn import layout, trust
from tensorturn.config import mask_text
from tensorturn.errors import StoreError
from tensorturn.spec import Outcome
from tensorturn.state.board import RunBoard
from tensorturn.store.objects import ObjectMissing

QUARANTINE_AFTER = 2          # store failures in a row on one agent while others succeed



def machine_fault(exc: BaseException) -> str | None:
    """What a failure says of the machine, when it may be the machine's alone: its store
    unreachable, or it refusing the run's recipe (not on its allowlist). Quarantine decides."""
    if isinstance(exc, StoreError) and not isinstance(exc, ObjectMissing):
        return "on the object store (wrong credentials or endpoint on that machine?)"
    if isinstance(exc, trust.UntrustedError):
        return "refusing the run's recipe or spec (start it with --allow-recipe for this recipe?)"
    return None


def worker_succeeded(board: RunBoard, worker: str, pipe: Any = None) -> None:
    board.workers.store_ok(worker, pipe)


def worker_store_failed(task: Task, board: RunBoard, run_id: str, label: str, worker: str,
                         attempt_key: str, message: str, cause: str) -> bool:
    """Count a store failure of this agent; quarantine it (and say True) when it keeps failing
    and this attempt began *after* another agent's attempt succeeded, itself after this agent's
    failures began: the store demonstrably worked for others while this machine could not reach
    it. In an outage of the store itself nobody succeeds, so nobody is quarantined and the
    attempts run out as they should; an attempt that began during an outage that then ended
    is not held against its machine either."""
    failures, since = board.workers.store_failed(worker)
    attempts = board.attempts.all(run_id)
    began = next((a["started_at"] for a in attempts
                  if f"{a['task']}#{a['attempt']}" == attempt_key), time.time())
    others_ok = any(a["outcome"] == Outcome.SUCCEEDED and a["worker"] != worker
                    and since <= (a["finished_at"] or 0) <= began for a in attempts)
    if failures < QUARANTINE_AFTER or not others_ok:
        return False
    quarantine(task, board, run_id, label, worker,
               f"{worker} failed {failures} tasks in a row {cause} while other machines' tasks "
               f"succeeded; it takes no more tasks until restarted. Last error: {message}")
    for a in attempts:  # its failures were the machine's: the tasks get those attempts back
        if a["worker"] == worker and a["started_at"] >= since and Outcome.of(a["outcome"]) == Outcome.FAILED:
            board.attempts.give_back(run_id, a["task"])
    return True


def quarantine(task: Task, board: RunBoard, run_id: str, label: str, worker: str,
               reason: str) -> None:
    """Take ``worker`` — this task's own agent — out of rotation: it stops consuming every
    queue, and says why. Both are signed with the pool key for this start of the agent (a mark
    or a ``cancel_consumer`` without it is refused: anyone with the Redis password could send
    one), so a restart ends the quarantine."""
    from tensorturn.pool.remote_control import send
    from tensorturn.pool.routing import withdraw
    from tensorturn.pool.telemetry import agent_queues, quarantine_mark

    board.workers.quarantine(worker, quarantine_mark(worker, mask_text(reason)))
    board.incidents.add(run_id, "worker_quarantined", label, worker, reason)
    queues = agent_queues()
    withdraw(board.r, worker, queues)  # the outer steps waiting for it go to the trainers
    for queue in [*queues, layout.agent_queue(worker)]:
        send(task.app, "cancel_consumer", {"queue": queue}, worker=worker)
