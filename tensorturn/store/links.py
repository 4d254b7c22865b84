"""The link to the store: how fast this process moves bytes to and from it, and how fast and how
much its machine's owner lets it.

A home link is shared with the household: a video call must keep working while the agent
uploads a pseudo-gradient, and a metered line has a monthly allowance. So every object body a
store moves (:mod:`tensorturn.store.objects`) passes through :data:`meter`:

- **caps**: a :class:`TokenBucket` per direction (bytes/s; 0: none) paces the transfer as it goes
  — a file store's pieces; S3's files and bodies over a megabyte through the transfer manager's
  progress callback, on the threads that send and receive the parts; S3's ranges and small
  bodies as a whole.
  The bucket holds :data:`BURST_S` of the rate, so a transfer of N bytes takes at least
  ``(N − burst) / rate``: over 100 MB at 20 Mbit/s the rate is within 0.05 % of the cap;
- **measurement**: every transfer of at least :data:`MEASURE_MIN_BYTES` is timed and folded into
  an exponentially weighted average per direction (:class:`Ewma`), seeded by :func:`probe` when
  an agent starts; where nothing was measured the figure is None — never invented;
- the bytes themselves are counted where they always were (:func:`tensorturn.store.objects.moved`),
  and so against the machine's data budget (:mod:`tensorturn.state.budget`).

A cap holds per process: an agent's tasks run in one pool process by default (``--concurrency
1``); with more, each process has the whole cap. Nothing here knows of the broker.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tensorturn import layout

if TYPE_CHECKING:
    from tensorturn.store.objects import Store

UP, DOWN = "up", "down"
MEASURE_MIN_BYTES = 1 << 20   # transfers smaller than this say more of the round trip than of the link
EWMA_ALPHA = 0.3              # the weight of a new measurement
BURST_S = 0.02                # a bucket holds this much of its rate (and at least one MIN_BURST)
MIN_BURST = 8 * 1024
PIECE = 1 << 20               # the size of the pieces a paced transfer moves
PROBE_BYTES = 4 << 20         # the start's probe moves at most this much each way...
PROBE_S = 2.0                 # ...or for this long, whichever comes first
MBIT = 1_000_000 / 8          # bytes/s in one Mbit/s


class TokenBucket:
    """A rate of ``rate`` bytes/s with a burst of :data:`BURST_S` of it: :meth:`take` waits until
    the bytes may go. A take larger than the burst is allowed and leaves the bucket in debt (a
    transfer moves in pieces of any size): the next take waits until it is paid off, so over a
    transfer the rate never exceeds ``rate`` by more than one burst. Thread-safe; ``rate`` 0
    passes everything at once. ``clock`` and ``sleep`` are the machine's unless a test gives its own."""

    def __init__(self, rate: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.clock, self.sleep = clock, sleep
        self.lock = threading.Lock()
        self.rate = 0.0
        self.tokens = 0.0
        self.at = clock()
        self.set_rate(rate)

    @property
    def burst(self) -> float:
        return max(self.rate * BURST_S, MIN_BURST)

    def set_rate(self, rate: float) -> None:
        """A new rate (bytes/s; 0: none); a change starts from a full bucket of the new rate."""
        rate = max(0.0, float(rate))
        with self.lock:
            if rate != self.rate:
                self.rate, self.at = rate, self.clock()
                self.tokens = self.burst

    def take(self, n: int) -> float:
        """Wait until ``n`` bytes may go; returns the seconds waited."""
        if n <= 0:
            return 0.0
        with self.lock:  # one taker at a time: each waits its turn behind the debt before it
            if not self.rate:
                return 0.0
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate) - n
            self.at = now
            wait = -self.tokens / self.rate if self.tokens < 0 else 0.0
            if wait > 0:
                self.sleep(wait)
            return wait


class Ewma:
    """An exponentially weighted average (``alpha``: the weight of a new value); None before one."""

    def __init__(self, alpha: float = EWMA_ALPHA):
        self.alpha = alpha
        self.value: float | None = None

    def add(self, x: float) -> float:
        self.value = x if self.value is None else self.alpha * x + (1 - self.alpha) * self.value
        return self.value


@dataclass(frozen=True)
class Sample:
    """One timed transfer: ``direction`` (up/down), ``nbytes`` in ``seconds``."""

    direction: str
    nbytes: int
    seconds: float

    @property
    def bps(self) -> float:
        return self.nbytes / max(self.seconds, 1e-9)


class Meter:
    """This process's caps and measurements (one per process: :data:`meter`).

    ``on_sample`` (set by the agent's pool processes) hears of every timed transfer: they hand
    their measurements to the agent's heartbeat through the broker."""

    def __init__(self) -> None:
        self.buckets = {UP: TokenBucket(), DOWN: TokenBucket()}
        self.ewma = {UP: Ewma(), DOWN: Ewma()}
        self.measured_at: dict[str, float] = {}  # direction → time.time() of its last measurement
        self.lock = threading.Lock()
        self.on_sample: Callable[[Sample], None] | None = None

    # -- caps --
    def set_caps(self, up_bps: float, down_bps: float) -> None:
        """The owner's caps in bytes/s (0: none)."""
        self.buckets[UP].set_rate(up_bps)
        self.buckets[DOWN].set_rate(down_bps)

    def cap(self, direction: str) -> float:
        return self.buckets[direction].rate

    def pace(self, direction: str, n: int) -> None:
        """Wait until ``n`` bytes may move ``direction`` under its cap."""
        self.buckets[direction].take(n)

    # -- measurement --
    def add(self, sample: Sample) -> None:
        """Fold a timed transfer into its direction's average (a small one is not a measurement)."""
        if sample.nbytes < MEASURE_MIN_BYTES or sample.seconds <= 0:
            return
        with self.lock:
            self.ewma[sample.direction].add(sample.bps)
            self.measured_at[sample.direction] = time.time()
        hook = self.on_sample
        if hook is not None:
            try:
                hook(sample)
            except Exception:  # noqa: BLE001 - a measurement is never worth a transfer
                pass

    def rate(self, direction: str) -> float | None:
        """The measured bytes/s ``direction``; None: not measured."""
        return self.ewma[direction].value



meter = Meter()
_probing = threading.local()  # a probe times its objects as a whole, not each one


def _after_fork() -> None:
    """A forked pool process gets new locks: one held by another thread of its parent (the
    start's probe pacing its bytes) at the fork would be held in the child for ever."""
    meter.lock = threading.Lock()
    for bucket in meter.buckets.values():
        bucket.lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


class Transfer:
    """A transfer of ``nbytes`` (None: known at its end) ``direction``, timed:
    ``with Transfer(UP, n) as t: ...`` (``t.nbytes = n`` inside when known only then)."""

    def __init__(self, direction: str, nbytes: int | None = None):
        self.direction, self.nbytes = direction, nbytes
        self.t0 = 0.0

    def __enter__(self) -> Transfer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None or not self.nbytes:
            return
        if not getattr(_probing, "on", False):
            meter.add(Sample(self.direction, self.nbytes, time.perf_counter() - self.t0))


@dataclass(frozen=True)
class Probe:
    """What :func:`probe` measured: bytes/s each way (None: nothing moved) and the bytes it moved."""

    up_bps: float | None
    down_bps: float | None
    nbytes: int


def probe(store: Store, name: str, max_bytes: int = PROBE_BYTES, max_s: float = PROBE_S) -> Probe:
    """Measure the link to ``store`` now, at most ``max_bytes`` or ``max_s`` each way, whichever
    comes first: objects of doubling size (256 KiB, 512 KiB, ...) written under
    ``links/<name>/`` and read back, then removed. Each way's figure is its largest object's
    bytes over that object's time (:func:`largest_rate`): what a request costs whatever its
    size — a round trip, the store's own work — is in it, less so the larger the object, so the
    figure is never more than the link carries. The figures are folded into :data:`meter` (and
    heard by its ``on_sample``) as one measurement each way. A store that fails ends the probe
    (a figure it did not reach is None: not measured) and raises."""
    timed: dict[str, list[tuple[int, float]]] = {UP: [], DOWN: []}
    written: list[tuple[str, int]] = []
    _probing.on = True
    try:
        size, moved, spent = 256 * 1024, 0, 0.0
        while moved + size <= max_bytes and spent < max_s:
            key = layout.key("link_probe", name, len(written))
            body = secrets.token_bytes(size)  # incompressible
            t0 = time.perf_counter()
            store.put_bytes(key, body)
            took = time.perf_counter() - t0
            written.append((key, size))
            timed[UP].append((size, took))
            moved, spent = moved + size, spent + took
            # the next object twice as big, or what the time left carries at the rate seen
            size = min(2 * size, max(64 * 1024, int(moved / max(spent, 1e-9) * (max_s - spent))))
        spent = 0.0
        for key, size in written:
            if spent >= max_s:
                break
            t0 = time.perf_counter()
            store.get_bytes(key)
            took = time.perf_counter() - t0
            timed[DOWN].append((size, took))
            spent += took
    finally:
        _probing.on = False
        for key, _ in written:
            try:
                store.delete(key)
            except Exception:  # noqa: BLE001 - a probe object left behind is harmless
                pass
    rates = {direction: largest_rate(timed[direction]) for direction in (UP, DOWN)}
    for direction, rate in rates.items():
        if rate is not None:  # one measurement each way, of the size the average counts
            meter.add(Sample(direction, MEASURE_MIN_BYTES, MEASURE_MIN_BYTES / rate))
    return Probe(rates[UP], rates[DOWN], sum(n for way in timed.values() for n, _ in way))


def largest_rate(timed: list[tuple[int, float]]) -> float | None:
    """Bytes/s of the largest of objects each timed whole ((bytes, seconds); the last of equals:
    a bucket's burst goes to the first); None without one."""
    if not timed:
        return None
    nbytes, seconds = max(reversed(timed), key=lambda t: t[0])
    return nbytes / max(seconds, 1e-9)
