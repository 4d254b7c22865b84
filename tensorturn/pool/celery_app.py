"""The Celery app — the only place Celery is configured.

``celery -A tensorturn.pool.celery_app worker|flower|inspect ...`` work as usual; the broker comes from
``TENSORTURN_BROKER_URL``; there is no result backend (nothing reads a Celery result).

Choices, each against a known hazard of Celery on Redis (DESIGN.md, "Known hazards"):

* JSON only, in both directions: nothing is ever unpickled, and tensors never travel through the
  broker (tasks carry object-store keys and small JSON).
* ``acks_late`` + ``reject_on_worker_lost`` + prefetch 1: a task is acknowledged only when it is
  done, and each worker process holds one task at a time — that is the work stealing: a faster
  machine comes back for the next task sooner.
* A short visibility timeout with a fast restore sweep, so a dead machine's task is back in the
  queue within seconds; a live task keeps its lease through :mod:`tensorturn.pool.lease`, so it is never
  handed to a second machine however long it runs. The sweep's lock expires in 2 s, not kombu's
  300: a machine cut off while holding it must not stop every requeue.
* A message's lease (kombu's ``unacked`` entries) is taken and given back in one command each
  (:mod:`tensorturn.pool.transport`) rather than a transaction of four.
* Remote control answers monitoring (ping, inspect, what Flower uses) and TensorTurn's own
  commands signed with the pool key, nothing else (:mod:`tensorturn.pool.remote_control`): anyone
  with the Redis password can broadcast ``shutdown``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

from celery import Celery
from celery.signals import worker_init
from celery.worker.control import Panel
from kombu.connection import resolve_aliases

from tensorturn import config
from tensorturn.pool import remote_control, transport
from tensorturn.pool.lease import LeaseKeeper
from tensorturn.pool.owner import OwnerWatch
from tensorturn.pool.telemetry import Heartbeat
from tensorturn.registry import task_modules

log = logging.getLogger(__name__)

RESTORE_INTERVAL_S = 1
UNACKED_MUTEX_EXPIRE_S = 2
DEFAULT_BROKER = "redis://127.0.0.1:6379/0"

app = Celery("tensorturn", include=["tensorturn.tasks.attempt", "tensorturn.tasks.start", *task_modules()])
app.steps["worker"].add(LeaseKeeper)  # keeps running tasks' leases alive
app.steps["worker"].add(Heartbeat)    # inventory and live figures for `tensorturn workers`
app.steps["worker"].add(OwnerWatch)   # steps aside while the machine's owner needs it


@worker_init.connect
def _guard_remote_control(**_: object) -> None:
    """In an agent's main process, before it listens: remote control cut to monitoring."""
    remote_control.guard(Panel.data)


def transport_options(settings: config.Settings) -> dict:
    return {
        "visibility_timeout": settings.visibility_timeout_s,
        "unacked_restore_interval": RESTORE_INTERVAL_S,
        "unacked_restore_throttle": 1,
        # the sweep's lock: kombu's default (300 s) let a machine whose link went down while it
        # held the lock stop every requeue for five minutes (seen on the emulated links); a sweep
        # takes a few round trips, and two overlapping ones cannot restore a message twice (each
        # restore is a transaction watching the unacked hash)
        "unacked_mutex_expire": UNACKED_MUTEX_EXPIRE_S,
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "health_check_interval": 10,
    }


# A connection's URL, as Flower and ``celery inspect`` read it back (``Connection.as_uri``), names
# this transport by its scheme, as kombu names pyamqp's ``amqp``: Flower picks its broker client
# (the queues' lengths) by that scheme, and knows ``redis`` but no class path.
resolve_aliases.setdefault(transport.NAME, "redis")


def transport_for(broker_url: str) -> str | None:
    """kombu's transport for ``broker_url``: TensorTurn's (:mod:`tensorturn.pool.transport`: a
    message's lease in one command each way) for ``redis://``; None — the scheme's own — else."""
    return transport.NAME if broker_url.startswith("redis://") else None


def settings_for(settings: config.Settings) -> dict:
    """Celery's configuration for these settings (``app.conf.update`` takes it as is)."""
    broker = settings.broker_url or DEFAULT_BROKER
    return dict(
        broker_url=broker,
        broker_transport=transport_for(broker),
        # No result backend: nothing in TensorTurn reads a Celery result (attempts, progress and
        # a round's barrier live on the run board), and each stored result cost a shard task
        # six broker commands, a chord's counter about seventeen (benchmarks/broker_commands.py).
        result_backend=None,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        event_serializer="json",
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options=transport_options(settings),
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # an agent reconnects forever
        # Each of these is a broker command (a round trip on a home link) per task. Nothing in
        # TensorTurn reads them — attempts, progress and heartbeats live on the run board — so
        # task events start only when a monitor asks (Flower sends ``enable_events`` every few
        # seconds, which the agents' remote-control guard lets through), and no STARTED state
        # or task-sent event is written (benchmarks/broker_commands.py).
        task_track_started=False,
        worker_send_task_events=False,
        task_send_sent_event=False,
        worker_hijack_root_logger=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        # SIGTERM: give running tasks a few seconds, then stop them and put their messages back
        # in the queue at once (another machine takes them) instead of waiting out a long task.
        worker_soft_shutdown_timeout=settings.shutdown_grace_s,
        worker_enable_soft_shutdown_on_idle=True,
        broker_channel_error_retry=True,
    )


app.conf.update(settings_for(config.current()))


def configure(broker_url: str) -> None:
    """Point the app at the broker ``broker_url``; call before first use."""
    if app.conf.broker_url == broker_url:
        return
    app.conf.broker_url = broker_url
    app.conf.broker_transport = transport_for(broker_url)
    # Drop connections cached for the previous URL (one process may follow several pools:
    # tests, or an embedded pool after a remote one). Celery has no public call for this; these
    # are the caches ``Celery.close`` fills.
    app._pool = None
    amqp = app.__dict__.get("amqp")
    if amqp is not None:
        amqp._producer_pool = None


@contextmanager
def publishing() -> Iterator[Any]:
    """A producer whose messages (``apply_async(..., producer=it)``) reach the broker together,
    in one round trip when the block ends — kombu's publish batch (kombu ≥ 5.7; one round trip
    a message with an older kombu). On a home link a round of S shards is then queued in one
    round trip, not S. Nothing is queued if the block raises, or if the batch's pipeline
    fails (its error is raised)."""
    with app.producer_or_acquire() as producer:
        batch = getattr(producer, "batch", None)
        with batch() if batch is not None else nullcontext():
            yield producer
