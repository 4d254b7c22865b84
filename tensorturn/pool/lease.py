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

A refresh must get through when the machine's uplink is saturated — by this very task uploading
its result over a home link, where the router's queue is full and drops packets. On one
connection a lost refresh waits for TCP's retransmission back-off (0.2 s doubling), and every
later refresh waits behind it: three losses in a row and the lease has lapsed on a live machine
(seen on an emulated 1 Mbit/s uplink). So refreshes are *hedged*: each tick sends its refresh on
a connection of its own, from a thread, without waiting for the last one; a delayed refresh does
not hold up the next, and the lease lapses only if every refresh sent within a lease is lost
several times over. The refreshes only move a lease forward, so one that lands late cannot age it.
"""

from __future__ import annotations

import logging

from celery import bootsteps
from celery.worker import state as worker_state

from tensorturn import config
from tensorturn.state.broker import Hedged, lease_client
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
    """Move the lease of ``tags`` forward to ``now``; only tags still in the index are touched
    (:func:`tensorturn.state.queues.refresh_leases`)."""
    return refresh_leases(client, tags, now)


class LeaseKeeper(bootsteps.StartStopStep):
    """Worker bootstep: refresh this worker's leases four times per visibility timeout, hedged."""

    requires = {"celery.worker.components:Timer"}

    def __init__(self, worker, **kwargs):
        super().__init__(worker, **kwargs)
        self.tref = None
        self.client = None
        self.hedged: Hedged | None = None

    def start(self, worker):
        settings = config.current()
        # a refresh older than a lease is worth nothing: its connection gives up then
        self.client = lease_client(worker.app.conf.broker_url, settings.visibility_timeout_s)
        self.hedged = Hedged("lease refresh")
        self.tref = worker.timer.call_repeatedly(settings.lease_refresh_s, self.tick, priority=10)

    def tick(self):
        tags = held_delivery_tags()
        if self.hedged is not None and tags:
            self.hedged.send(refresh, self.client, tags)  # the time is taken as it is sent

    def stop(self, worker):
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None
        if self.hedged is not None:
            self.hedged.close()
            self.hedged = None
