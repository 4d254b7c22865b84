"""Dynamic batching: concurrent requests share one model call on one dedicated thread.

Requests queue; the batcher thread takes the first one and everything queued behind it (while the
previous batch ran), up to ``max_rows`` rows, optionally waiting ``window_s`` for more, runs the
model once on the rows stacked together and hands each request its slice. Only rows of one shape
share a batch. The event loop is
woken once per batch. The model thread sets its own torch thread count, so the model's cost is
fixed and the event loop keeps the rest of the CPU.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

log = logging.getLogger(__name__)

R = TypeVar("R")  # what the model returns for a batch
T = TypeVar("T")  # one request's share of it

_STOP = object()


class Batcher(Generic[R, T]):
    def __init__(self, run: Callable[[np.ndarray], R], share: Callable[[R, int, int], T],
                 max_rows: int = 1024, window_s: float = 0.0,
                 thread_init: Callable[[], None] | None = None):
        self._run, self._share = run, share
        self.max_rows, self.window_s = max_rows, window_s
        self._thread_init = thread_init
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.batches = 0
        self.rows = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._serve, name="tensorturn-model", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(_STOP)
            self._thread.join(10)
            self._thread = None

    async def submit(self, x: np.ndarray) -> T:
        """The model's output for ``x`` (rows on axis 0), computed in some batch."""
        assert self._loop is not None, "the batcher is not started"
        future: asyncio.Future = self._loop.create_future()
        self._queue.put((x, future))
        return await future

    # on the model thread

    def _take(self, first: Any) -> tuple[list[tuple[np.ndarray, asyncio.Future]], Any]:
        """One batch (starting with ``first``, else the next request), and what did not fit in
        it (it starts the next batch), or _STOP."""
        if first is None:
            first = self._queue.get()
        if first is _STOP:
            return [], _STOP
        batch, rows = [first], len(first[0])
        deadline = time.monotonic() + self.window_s if self.window_s > 0 else None
        while rows < self.max_rows:
            try:
                if deadline is None:
                    item = self._queue.get_nowait()
                else:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            # rows of another shape (a text model's shorter window) start the next batch
            if item is _STOP or rows + len(item[0]) > self.max_rows or item[0].shape[1:] != first[0].shape[1:]:
                return batch, item
            batch.append(item)
            rows += len(item[0])
        return batch, None

    def _alone(self, x: np.ndarray) -> Any:
        try:
            return self._share(self._run(x), 0, len(x))
        except Exception as exc:  # noqa: BLE001 - this request's own failure
            return _alone_failed(exc)

    def _serve(self) -> None:
        if self._thread_init is not None:
            self._thread_init()
        carry: Any = None
        while carry is not _STOP:
            batch, carry = self._take(carry)
            if not batch:
                break
            try:
                x = batch[0][0] if len(batch) == 1 else np.concatenate([b[0] for b in batch])
                result = self._run(x)
                shares, at = [], 0
                for item, _ in batch:
                    shares.append(self._share(result, at, at + len(item)))
                    at += len(item)
                outcome: list[Any] = shares
            except Exception as exc:  # noqa: BLE001 - find the request(s) it failed on
                if len(batch) == 1:
                    log.exception("the model failed on a request")
                    outcome = [exc]
                else:  # one request's bad input must not fail the others: each on its own
                    log.warning("the model failed on a batch of %d requests (%s); running them "
                                "one by one", len(batch), exc)
                    outcome = [self._alone(item) for item, _ in batch]
            self.batches += 1
            self.rows += sum(len(item) for item, _ in batch)
            assert self._loop is not None
            try:
                self._loop.call_soon_threadsafe(_deliver, [f for _, f in batch], outcome)
            except RuntimeError:  # the loop is closed: shutting down
                break


def _alone_failed(exc: Exception) -> Exception:
    log.exception("the model failed on a request", exc_info=exc)
    return exc


def _deliver(futures: list[asyncio.Future], outcome: list[Any]) -> None:
    for future, value in zip(futures, outcome):
        if future.done():  # the request was cancelled (client gone)
            continue
        if isinstance(value, Exception):
            future.set_exception(value)
        else:
            future.set_result(value)
