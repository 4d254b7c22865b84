"""Leftovers on the broker, pruned in one place: what finished runs, lost records and agents that
are gone leave in Redis.

- Every key of a finished run expires ``TENSORTURN_RUN_TTL_S`` after it finished
  (:meth:`tensorturn.state.board.RunBoard.expire`); its record stays in the store's manifest. A key
  written after that (an attempt that was still running reports once more) gets the same end.
- What is left of a lost record — keys a task wrote after the run's hash was deleted or lost,
  which ``resume`` replaces with a record rebuilt from the store — expires after the same time.
- The list of runs (``tt:runs``) forgets runs whose record is gone.
- An agent stopped, or silent, for ``TENSORTURN_AGENT_TTL_S`` is no longer listed, and is
  forgotten here: its heartbeat hash, its own queue (backup copies only it would take), kombu's
  bindings of that queue and of its control mailbox (kombu keeps both forever; a clean stop
  removes only the mailbox's).

:func:`prune` does all of it: when a run finishes, at most once an hour for the whole pool
(:func:`maybe_prune`), and on demand (``tensorturn workers --prune``). The refusals
(``tt:refused`` and its total) are never pruned.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from tensorturn import config, layout
from tensorturn.spec import FINISHED
from tensorturn.state.clock import broker_now
from tensorturn.state.roster import WorkerState
from tensorturn.state.runs import read_state, state_of

log = logging.getLogger(__name__)

PRUNE_EVERY_S = 3600
# kombu's Redis transport: the binding tables of an exchange (one per queue, for Celery's
# direct routing) and the members of the control mailboxes' fanout table
KOMBU_BINDING = "_kombu.binding.{}"
KOMBU_PERMANENT = "_kombu.binding_permanent.{}"
KOMBU_SEP = "\x06\x16"
MAILBOXES = "celery.pidbox"


def maybe_prune(client: Any) -> None:
    """:func:`prune`, unless it ran in the last hour anywhere in the pool (a lock in Redis).
    Never raises: what is left now is pruned next time."""
    try:
        if client.set(layout.PRUNE_LOCK, time.time(), nx=True, ex=PRUNE_EVERY_S):
            log.info("pruned the broker's leftovers: %s", prune(client))
    except Exception as exc:  # noqa: BLE001 - housekeeping must never fail what called it
        log.warning("pruning the broker's leftovers failed (%s); next time", exc)


def prune(client: Any) -> dict[str, Any]:
    """Prune every leftover listed above; says what it did."""
    expiring, unlisted = _runs(client)
    return {"run_keys_expiring": expiring, "runs_unlisted": unlisted,
            "agents_forgotten": _agents(client)}


# ---- runs -----------------------------------------------------------------------------------------

def _runs(client: Any) -> tuple[int, int]:
    """(keys given an expiry, runs taken off the list of runs), in a few round trips whatever
    the number of runs: an agent far from the broker may be the one that prunes."""
    by_run: dict[str, list[str]] = {}
    for key in client.scan_iter(match=layout.run_key("*"), count=10000):
        run_id = layout.parse_run_key(key)
        if run_id:
            by_run.setdefault(run_id, []).append(key)
    pipe = client.pipeline(transaction=False)
    for run_id, keys in by_run.items():
        read_state(pipe, run_id)
        pipe.hexists(layout.run_key(run_id), "kept")
        for key in keys:
            pipe.ttl(key)
    replies = iter(pipe.execute())
    expiring = 0
    for run_id, keys in by_run.items():
        state, kept = state_of(next(replies)), next(replies)
        ttls = {key: next(replies) for key in keys}  # the run's hash among them, if it is there
        ttl = _leftovers_ttl(state, kept, ttls.get(layout.run_key(run_id), -2))
        forever = [key for key, t in ttls.items() if t == -1] if ttl else []
        for key in forever:
            pipe.expire(key, ttl)
        expiring += len(forever)
    gone = [run_id for run_id in client.zrange(layout.RUN_INDEX, 0, -1) if run_id not in by_run]
    if gone:
        pipe.zrem(layout.RUN_INDEX, *gone)
    pipe.execute()
    return expiring, len(gone)


def _leftovers_ttl(state: str | None, kept: bool, main_ttl: int) -> int | None:
    """The expiry for a run's keys that have none; None to leave them: a live run's, and a
    finished record kept on purpose (:meth:`tensorturn.state.runs.Runs.keep`). A finished run's
    get what is left of its hash's (all of it when the hash has none: a run that finished before
    its keys were given one); a lost record's (no whole hash: ``state`` None) all of it."""
    if state is not None and (state not in FINISHED or kept):
        return None
    return main_ttl if state is not None and main_ttl > 0 else max(1, int(config.current().run_ttl_s))


# ---- agents -------------------------------------------------------------------------------------

def forgotten(worker: dict[str, Any]) -> bool:
    """Whether a listed agent (:func:`tensorturn.state.roster.list_workers`) has been offline — since
    its clean stop, or since it was last heard of — longer than ``TENSORTURN_AGENT_TTL_S``."""
    since = worker["stopped_s"] if worker.get("stopped_s") is not None else worker["last_seen_s"]
    return worker["state"] == WorkerState.OFFLINE and since > config.current().agent_ttl_s


def _silent_s(h: dict[str, str], now: float) -> float:
    """The same for a heartbeat hash as stored (its clean stop, else its last beat)."""
    try:
        return now - float(h.get("stopped_at") or h.get("last_seen") or 0)
    except ValueError:
        return now  # not what an agent writes: nothing to keep


def _agents(client: Any) -> list[str]:
    """Forget the agents offline too long, and the queues of agents with no heartbeat left;
    returns their names. A heartbeat hash with no expiry (a field written after it was gone)
    gets one."""
    now, ttl = broker_now(client), max(1, int(config.current().agent_ttl_s))  # the heartbeats' clock
    head = layout.worker_key("")
    names = []
    for key in client.scan_iter(match=layout.WORKER_PATTERN, count=1000):
        if _silent_s(client.hgetall(key), now) > ttl:
            names.append(key[len(head):])
        elif client.ttl(key) == -1:
            client.expire(key, ttl)
    prefix = KOMBU_BINDING.format(layout.agent_queue(""))
    for table in client.scan_iter(match=prefix + "*", count=1000):
        node = table[len(prefix):]
        if node not in names and not client.exists(layout.worker_key(node)):
            names.append(node)  # its heartbeat expired: only its queue is left
    pipe = client.pipeline(transaction=False)
    for node in names:
        queue = layout.agent_queue(node)
        pipe.delete(layout.worker_key(node), layout.owner_key(node), layout.links_key(node), queue,
                    KOMBU_BINDING.format(queue), KOMBU_PERMANENT.format(queue))
        pipe.srem(KOMBU_BINDING.format(MAILBOXES), KOMBU_SEP * 2 + f"{node}.{MAILBOXES}")
    pipe.execute()
    return sorted(names)
