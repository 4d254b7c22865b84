"""Keeping the broker's visibility lease alive for running tasks.

kombu's Redis transport emulates acknowledgements: a delivered message sits in the ``unacked``
hash with its delivery time as score in the ``unacked_index`` sorted set, and any worker's restore
sweep puts it back in the queue once that score is older than ``visibility_timeout``. With a short
timeout a dead machine's task comes back fast — but a live task running longer than the timeout
would be handed out a second time while it still runs.

The :class:`LeaseKeeper` bootstep re-scores the messages this worker holds (running or reserved)
every few seconds, so their score never ages past the timeout while the worker is alive. When the
machine dies, its refreshes stop and the sweep restores the task ``visibility_timeout`` seconds
later (plus at most one sweep interval).
"""

from __future__ import annotations

import logging

from celery import bootsteps
from celery.worker import state as worker_state

from tensorturn import config
from tensorturn.state.broker import redis_client
from tensorturn.state.queues import refresh_leases

log = logging.getLogger(__name__)


def held_delivery_tags() -> list[str]:
    """Delivery tags of every message this worker process holds: running or reserved."""
    tags = []
    for request in list(worker_state.active_requests) + list(worker_state.reserved_requests):
        message = getattr(request, "message", None)
        tag = getattr(message, "delivery_tag", None)
        if tag:
            tags.append(tag)
    return tags


def refresh(client, tags: list[str], now: float | None = None) -> int:
    """Move the lease of ``tags`` to ``now``; only tags still in the index (XX) are touched
    (:func:`tensorturn.state.queues.refresh_leases`)."""
    return refresh_leases(client, tags, now)


class LeaseKeeper(bootsteps.StartStopStep):
    """Worker bootstep: refresh this worker's leases four times per visibility timeout."""

    requires = {"celery.worker.components:Timer"}

    def __init__(self, worker, **kwargs):
        super().__init__(worker, **kwargs)
        self.tref = None
        self.client = None

    def start(self, worker):
        self.client = redis_client(worker.app.conf.broker_url)
        self.tref = worker.timer.call_repeatedly(config.current().lease_refresh_s, self.tick,
                                                 priority=10)

    def tick(self):
        try:
            refresh(self.client, held_delivery_tags())
        except Exception as exc:  # noqa: BLE001 - the broker may be restarting; try next tick
            log.warning("lease refresh failed: %s", exc)

    def stop(self, worker):
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None
