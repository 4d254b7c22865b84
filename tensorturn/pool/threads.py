"""The agent where it does not fork: tasks on a thread of the agent's own process.

Celery's prefork pool does not run on Windows, and on macOS a process forked from one that
loaded torch (Apple's frameworks, MPS) is not safe to use. There the agent runs its tasks on
threads (``--pool threads``, the default on those systems; any system can choose it), and
keeps every guarantee of the prefork pool:

* leases, heartbeats, the owner's policy and quarantine run in the agent's process anyway;
* a stop hands the running task back: Celery's cold shutdown (SIGTERM, Ctrl-C, Ctrl-Break)
  cancels a running task by *terminating its job*, which a thread cannot be; here that sets
  :data:`stopping`, which a training task reads at its next step (a round's slot waiting for
  its weights, within a second) and hands itself back
  (:class:`tensorturn.pool.owner.HandedBack`: its message goes back to the queue, and the
  attempt costs the run nothing). A task that trains no steps (an outer step) finishes first.
* a killed agent is a killed task: its lease lapses and another machine takes it, as ever.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from celery.concurrency.thread import TaskPool as CeleryThreads

from tensorturn import config, platforms
from tensorturn.errors import SpecError

POOLS = ("prefork", "threads")
CLASS = "tensorturn.pool.threads:TaskPool"

stopping = threading.Event()  # the agent is stopping: a running task hands itself back


class TaskPool(CeleryThreads):
    """Celery's thread pool, whose jobs are stopped by asking them to hand themselves back."""

    def on_start(self) -> None:
        stopping.clear()
        super().on_start()

    def terminate_job(self, pid: Any, signal: Any = None) -> None:
        # reached only by a stop's cancel of running tasks (revoke is refused by the agents'
        # remote-control guard, and a lost connection cancels nothing: celery_app), so the
        # flag holds until the agent has stopped; a new start clears it (on_start)
        stopping.set()


def pool_of(settings: config.Settings) -> str:
    """The pool an agent runs its tasks in: ``--pool``/``TENSORTURN_AGENT_POOL``, else the
    platform's (:func:`tensorturn.platforms.default_pool`)."""
    pool = settings.agent_pool or platforms.default_pool(sys.platform)
    if pool not in POOLS:
        raise SpecError(f"TENSORTURN_AGENT_POOL must be one of {', '.join(POOLS)} (got {pool!r})")
    return pool
