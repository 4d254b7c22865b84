"""Redis clients for TensorTurn's own state (no Celery, no torch)."""

from __future__ import annotations

import redis

from tensorturn.config import mask_text, mask_url
from tensorturn.errors import BrokerError


def redis_client(url: str, patient: bool = True) -> redis.Redis:
    """A client that rides out a broker restart: connection errors are retried with backoff for
    about a minute (``patient=False`` gives up at once, for probing)."""
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    retry = Retry(ExponentialBackoff(cap=4.0, base=0.1), 20 if patient else 0)
    return redis.Redis.from_url(url, socket_connect_timeout=5, socket_keepalive=True,
                                health_check_interval=10, decode_responses=True, retry=retry,
                                retry_on_error=[redis.ConnectionError, redis.TimeoutError])


def check_broker(url: str) -> redis.Redis:
    """A client for ``url`` after a successful PING; BrokerError (URL masked) otherwise."""
    try:
        redis_client(url, patient=False).ping()
    except redis.RedisError as exc:
        raise BrokerError(f"cannot reach broker {mask_url(url)}: {mask_text(str(exc))}") from None
    return redis_client(url)
