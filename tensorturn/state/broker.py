"""Redis clients for TensorTurn's own state (no Celery, no torch)."""

from __future__ import annotations

import logging
from typing import Any

import redis

from tensorturn.config import mask_text, mask_url
from tensorturn.errors import BrokerError

log = logging.getLogger(__name__)


def redis_client(url: str, patient: bool = True) -> redis.Redis:
    """A client that rides out a broker restart: connection errors are retried with backoff for
    about a minute (``patient=False`` gives up at once, for probing)."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    retry = Retry(ExponentialBackoff(cap=4.0, base=0.1), 20 if patient else 0)
    return redis.Redis.from_url(url, socket_connect_timeout=5, socket_keepalive=True,
                                health_check_interval=10, decode_responses=True, retry=retry,
                                retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def lease_client(client: redis.Redis, timeout_s: float) -> redis.Redis:
    """A client of the broker ``client`` talks to (same address, credentials, TLS), on
    connections of its own, for refreshes that are worthless after ``timeout_s``: no retries,
    and a command unanswered by then gives up (its connection is dropped). Each thread using it
    at once gets a connection of its own (redis-py's pool opens one when none is free)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    pool = client.connection_pool
    kwargs = {**pool.connection_kwargs, "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
              "retry": Retry(NoBackoff(), 0)}
    return redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))


class Hedged:
    """Calls sent without waiting for each other — lease refreshes over a link that may be
    saturated: each on a thread (and so a connection) of its own, at most ``in_flight`` at once; a
    call finding that many still out is skipped, logged. One whose packets are being dropped does
    not hold up the next (see :mod:`tensorturn.pool.lease`). Give it a client that gives up
    (:func:`lease_client`): a call that never returns holds its place for good."""

    def __init__(self, what: str, in_flight: int = 4):
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self.what = what
        self.limit = in_flight
        self.out = 0
        self.closed = False
        self.lock = threading.Lock()
        self.threads = ThreadPoolExecutor(in_flight, thread_name_prefix="tt-hedged")

    def send(self, fn: Any, *args: Any) -> bool:
        """Start ``fn(*args)``; False when ``in_flight`` calls are still out, or once closed."""
        with self.lock:
            if self.closed:
                return False
            if self.out >= self.limit:
                log.warning("%s: %d still unanswered; skipping this one", self.what, self.out)
                return False
            self.out += 1
            self.threads.submit(self._call, fn, *args)  # under the lock: close() cannot come between
        return True

    def _call(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - the broker may be restarting; the next call tries
            log.warning("%s failed: %s", self.what, mask_text(str(exc)))
        finally:
            with self.lock:
                self.out -= 1

    def close(self) -> None:
        """No more calls; those out finish on their own (their client gives up in time)."""
        with self.lock:
            self.closed = True
        self.threads.shutdown(wait=False, cancel_futures=True)


def check_broker(url: str) -> redis.Redis:
    """A client for ``url`` after a successful PING; BrokerError (URL masked) otherwise."""
    try:
        redis_client(url, patient=False).ping()
    except redis.RedisError as exc:
        raise BrokerError(f"cannot reach broker {mask_url(url)}: {mask_text(str(exc))}") from None
    return redis_client(url)
