"""The broker's clock: the one time every machine of a pool agrees on.

A task's lease is a time one machine writes and another compares against its own clock
(kombu's restore sweep requeues a message whose lease is older than the visibility timeout);
so is a heartbeat's ``last_seen``. With each machine's own ``time.time()`` a laptop whose clock
runs a few seconds behind — after a sleep, before NTP catches up — has its running task's lease
look lapsed to every other machine at once (a 4 s lease), and one whose clock runs ahead keeps a
dead machine's lease alive. So these times are the broker's: each process measures the offset
of the broker's clock (Redis ``TIME``, at the midpoint of the round trip) from its own, and
:meth:`BrokerClock.now` is the local clock plus that offset — the time a refresh was *sent*,
on the broker's scale (a refresh delayed on a congested link still says when the machine was
alive, not when it arrived). The offset is measured again every :data:`MEASURE_EVERY_S`, and at
once when the local clock jumps against the monotonic one (a sleep, a manual change, an NTP
step); a broker that cannot be reached keeps the last offset.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

MEASURE_EVERY_S = 30.0  # how long an offset is trusted
JUMP_S = 0.5            # the local clock moving this much more or less than the monotonic one: measure again
MAX_RTT_S = 0.5         # a measurement whose round trip took longer replaces the offset only after a jump


def _wall() -> float:
    """This machine's clock (a function of its own, so that tests can set it wrong)."""
    return time.time()


class BrokerClock:
    """``now()`` on the broker's clock, for one broker (``client``: a redis-py client of it)."""

    def __init__(self, client: Any):
        self.client = client
        self.measuring = threading.Lock()  # one measurement at a time; nobody waits for it
        self.offset: float | None = None   # broker time − local time
        self.wall = self.mono = 0.0        # both clocks when it was measured

    def now(self) -> float:
        """Never waits on another thread's measurement (a lease refresh stuck behind a slow
        link must not hold up the next one's clock): while one measures, the others use the
        offset they have."""
        wall, mono = _wall(), time.monotonic()
        stale = (self.offset is None or mono - self.mono > MEASURE_EVERY_S
                 or abs((wall - self.wall) - (mono - self.mono)) > JUMP_S)
        if stale and self.measuring.acquire(blocking=False):
            try:
                self._measure()
            finally:
                self.measuring.release()
            wall = _wall()
        return wall + (self.offset or 0.0)

    def _measure(self) -> None:
        try:
            before = _wall()
            seconds, micros = self.client.time()
            after = _wall()
        except Exception as exc:  # noqa: BLE001 - the broker may be restarting: the last offset stands
            log.debug("broker clock not measured: %s", exc)
            return
        offset = seconds + micros / 1e6 - (before + after) / 2
        rtt = after - before
        # a slow round trip errs by up to half of it: keep the offset held unless this one
        # moved by more than that (the local clock jumped)
        if self.offset is None or rtt <= MAX_RTT_S or abs(offset - self.offset) > rtt:
            self.offset = offset
        self.wall, self.mono = _wall(), time.monotonic()


_clocks: dict[tuple, BrokerClock] = {}
_clocks_lock = threading.Lock()


def broker_clock(client: Any) -> BrokerClock:
    """The clock of the broker ``client`` talks to, one per broker address and credentials in
    this process: the clock measures with the client it was made with, so a broker started later
    on a freed port with another password (a second embedded pool in one script, a test) gets a
    clock of its own rather than one whose client no longer logs in."""
    kwargs = client.connection_pool.connection_kwargs
    where = (kwargs.get("host"), kwargs.get("port"), kwargs.get("path"), kwargs.get("username"),
             kwargs.get("password"))
    with _clocks_lock:
        clock = _clocks.get(where)
        if clock is None:
            clock = _clocks[where] = BrokerClock(client)
        return clock


def broker_now(client: Any) -> float:
    """The broker's time now (seconds since the epoch), as :class:`BrokerClock` reckons it."""
    return broker_clock(client).now()
