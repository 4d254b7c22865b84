"""Keeping the broker's visibility lease alive for running tasks.

kombu's Redis transport emulates acknowledgements: a delivered message sits in the ``unacked``
hash with its delivery time as score in the ``unacked_index`` sorted set, and any worker's restore
sweep puts it back in the queue once that score is older than ``visibility_timeout``. With a short
timeout a dead machine's task comes back fast — but a live task running longer than the timeout
would be handed out a second time while it still runs.

The :class:`LeaseKeeper` bootstep re-scores the messages this worker holds (running, reserved, or
waiting out a retry's countdown) every second (four times per timeout), so their score never ages
past the timeout while the worker is alive. It ticks on a thread of its own, not on the worker's
event loop: a stopping worker sleeps out its shutdown grace (5 s) in a signal handler on that
loop's thread, and the task it lets finish meanwhile must keep its lease. When the
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
import threading

from celery import bootsteps
from celery.worker import state as worker_state

from tensorturn import config
from tensorturn.state.broker import Hedged, lease_client, redis_client
from tensorturn.state.queues import refresh_leases

log = logging.getLogger(__name__)


def held_delivery_tags() -> list[str]:
    """Delivery tags of every message this worker process holds: running, reserved, or waiting
    for a retry's countdown (kombu scored it when it was delivered)."""
    tags = []
    held = (*worker_state.active_requests, *worker_state.reserved_requests,
            *getattr(worker_state, "scheduled_requests", ()))
    for request in held:
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
    """Worker bootstep: refresh this worker's leases four times per visibility timeout, hedged,
    from a thread of its own."""

    def __init__(self, worker, **kwargs):
        super().__init__(worker, **kwargs)
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self, worker):
        settings = config.current()
        # a refresh older than a lease is worth nothing: its connection gives up then
        client = lease_client(redis_client(worker.app.conf.broker_url), settings.visibility_timeout_s)
        self.stopping.clear()
        self.thread = threading.Thread(target=self.keep, args=(client, settings.lease_refresh_s),
                                       name="tt-lease-keeper", daemon=True)
        self.thread.start()

    def keep(self, client, every_s: float) -> None:
        hedged = Hedged("lease refresh")
        try:
            while not self.stopping.wait(every_s):
                try:
                    tags = held_delivery_tags()
                except RuntimeError:  # the worker changed its sets as they were read: next tick
                    continue
                if tags:  # the time is taken when the refresh goes out, on its thread
                    hedged.send(refresh, client, tags)
        finally:
            hedged.close()

    def stop(self, worker):
        self.stopping.set()
