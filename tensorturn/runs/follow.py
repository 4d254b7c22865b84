"""Following a run to its end: polling its description until it finishes (and its records are
complete), and the note that says why a live run makes no progress.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tensorturn import config, layout
from tensorturn.errors import BrokerError, NotFound
from tensorturn.spec import FINISHED, Outcome, RunState
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import check_broker
from tensorturn.state.clock import broker_now
from tensorturn.state.roster import TAKES_TASKS, WorkerState

Update = Callable[[dict[str, Any]], None]


SETTLE_S = 10.0  # how long a finished run's attempts still running on live machines are awaited


def wait(broker_url: str, run_id: str, on_update: Update | None = None,
         poll_s: float = 0.5, timeout_s: float | None = None) -> dict[str, Any]:
    """Poll the run until it finishes (or ``timeout_s`` passes); returns its description.

    A finished run is returned once its records are complete: the task that finishes a run
    records its own attempt and figures with the state, but others can still be running then
    (a backup copy stopping, an asynchronous update's task, a cancelled run's attempts), and
    are awaited up to SETTLE_S while their machines are live. A failed run is returned at once:
    its error matters more than shards that may train on for minutes."""
    board = RunBoard(check_broker(broker_url))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    settle_by = None
    while True:
        try:
            if on_update is None and settle_by is None and not past(deadline):
                # nobody shows progress: one command a poll until the run finishes
                if board.runs.state(run_id) not in (*FINISHED, None):
                    time.sleep(poll_s)
                    continue
            doc = annotate(board.describe(run_id), board)
        except NotFound:
            raise BrokerError(f"the broker lost run {run_id}'s records while it ran (Redis "
                              f"restarted without its data, or its keys were deleted?); the "
                              f"finished work is in the store: continue with `tensorturn "
                              f"resume {run_id}`") from None
        if on_update:
            on_update(doc)
        if doc["state"] in FINISHED:
            settle_by = settle_by or time.monotonic() + SETTLE_S
            if (doc["state"] == RunState.FAILED or time.monotonic() >= settle_by
                    or not running_on_live_workers(doc, board)):
                return doc
        elif past(deadline):
            return doc
        time.sleep(poll_s)


def past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def running_on_live_workers(doc: dict[str, Any], board: RunBoard) -> list[dict[str, Any]]:
    """The run's attempts still running on an agent that is online (one on a machine that
    stopped answering was lost with it)."""
    running = [a for a in doc.get("attempts", []) if a["outcome"] == Outcome.RUNNING]
    if not running:
        return []
    live = board.workers.online()
    return [a for a in running if a["worker"] in live]


def annotate(doc: dict[str, Any], board: RunBoard | None = None) -> dict[str, Any]:
    """Add ``note`` to a live run that has made no progress for ``TENSORTURN_STALL_S``
    seconds, saying what it waits for. A run with an attempt running on a live agent is not
    stalled: the note then says which outer step (or the vote) is doing what, and for how long."""
    from tensorturn.pool.capacity import why_unheld

    if doc.get("state") in FINISHED or not doc.get("progress_at"):
        return doc
    now = broker_now(board.r) if board is not None else time.time()  # progress_at's clock
    doc["as_of"] = now  # the broker's time of this reading: ages shown are reckoned from it
    idle = now - float(doc["progress_at"])
    if idle < config.current().stall_s:
        return doc
    why = "its tasks are queued but no attempt started or finished"
    if board is not None:
        running = running_on_live_workers(doc, board)
        silent = silent_training(running, board.progress.entries(doc["run_id"]), now) if running else []
        if running and not silent:  # work goes on, only nothing started or finished lately
            for o in doc.get("outer_steps") or []:
                doc["note"] = (f"round {o['round']}'s {o.get('what', 'outer step')} is {o['phase']} on {o['worker']} "
                               f"({now - o['since']:.0f}s)")
            for a in running:
                if a["task"] == str(layout.vote_label()):
                    doc["note"] = f"the vote is running on {a['worker']} ({now - a['started_at']:.0f}s)"
            return doc
        if silent:
            task, worker, quiet = silent[0]
            doc["note"] = (f"no progress for {idle:.0f}s: {task} on {worker} has reported no "
                           f"training step for {quiet:.0f}s (a slow download, or stuck?)")
            return doc
        pool = board.workers.all()
        paused = [w for w in pool if w["state"] == WorkerState.PAUSED]
        if not pool:
            why = "no agent is online to take its tasks"
        elif paused and not [w for w in pool if w["state"] in TAKES_TASKS]:  # paused, not lost
            why = "every machine is paused by its owner: " + ", ".join(
                f"{w['name']} ({w['paused']})" for w in paused) + "; they resume by themselves"
        else:  # a machine that could hold it may join: the run waits, and says so
            why = why_unheld((doc.get("spec") or {}).get("memory_needed_bytes"), pool) or why
    failed = [a for a in doc.get("attempts", []) if Outcome.of(a["outcome"]) == Outcome.FAILED]
    if failed:
        why += f"; the last failure: {failed[-1]['task']} {failed[-1]['outcome']}"
    doc["note"] = f"no progress for {idle:.0f}s: {why}"
    return doc


TRAINING_KINDS = ("shard", "backup", "update", "update_backup", "segment")  # they report steps


def silent_training(running: list[dict[str, Any]], entries: dict[str, dict[str, Any]],
                     now: float) -> list[tuple[str, str, float]]:
    """(task, worker, seconds) of the running training attempts that reported no step for
    ``stall_s``: a training task reports at least once a second while it steps (outer steps
    and the vote report phases, not steps, and are not judged here)."""
    stall = config.current().stall_s
    out = []
    for a in running:
        named = layout.parse_label(a["task"])
        if named is None or named.kind not in TRAINING_KINDS:
            continue
        last = max([float(e.get("at") or 0) for e in entries.values()
                    if e.get("label") == a["task"] and e.get("worker") == a["worker"]]
                   + [float(a["started_at"])])
        if now - last >= stall:
            out.append((a["task"], a["worker"], now - last))
    return out
