"""Celery's and kombu's own structures on the broker, where TensorTurn reads or fixes them: the
task queues (Redis lists of messages), and kombu's leases on delivered messages (``unacked``,
``unacked_index``).

kombu's Redis transport emulates acknowledgements: a delivered message sits in the ``unacked``
hash with its delivery time as score in the ``unacked_index`` sorted set, and any worker's
restore sweep puts it back in the queue once that score is older than ``visibility_timeout``
(:mod:`tensorturn.pool.lease` keeps a running task's score fresh).
"""

from __future__ import annotations

from typing import Any

from tensorturn import layout
from tensorturn.state.clock import broker_now


def task_queues(client: Any) -> list[str]:
    """Every TensorTurn task queue that holds messages now (Redis lists)."""
    names = [layout.DEFAULT_QUEUE, *client.scan_iter(match=layout.ANY_QUEUE_PATTERN)]
    return [q for q in names if client.type(q) in ("list", b"list")]


def queued_messages(client: Any) -> list[str]:
    """Every task message waiting in a TensorTurn queue (kombu's envelopes, as stored)."""
    return [m for queue in task_queues(client) for m in client.lrange(queue, 0, -1)]


def drop_queued(client: Any, run_id: str) -> int:
    """Remove the run's task messages waiting in any TensorTurn queue; returns how many. Those
    already handed to an agent are dropped by the agent (a finished run's task does nothing)."""
    dropped = 0
    for queue in task_queues(client):
        for raw in client.lrange(queue, 0, -1):
            if run_id in (layout.task_args(raw) or []):
                dropped += int(client.lrem(queue, 1, raw))
    return dropped


# Move each named lease forward to ARGV[1], never back: refreshes of one lease may be in flight
# on several connections at once (tensorturn.pool.lease), and one that was delayed on a congested
# link must not land after a newer one and age the lease. A tag no longer in the index (acked
# meanwhile) is never re-created. (ZADD's GT flag does this from Redis 6.2; a script works on any.)
_FORWARD = """
local moved = 0
for i = 2, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) < tonumber(ARGV[1]) then
    redis.call('ZADD', KEYS[1], 'XX', ARGV[1], ARGV[i])
    moved = moved + 1
  end
end
return moved
"""
_forward: list[Any] = []  # the registered script (EVALSHA, loaded once per broker on first use)


def refresh_leases(client: Any, tags: list[str], now: float | None = None) -> int:
    """Move the lease of the messages ``tags`` (delivery tags) forward to ``now`` (by default the
    broker's clock, :mod:`tensorturn.state.clock`) — never back;
    only tags still in the index are touched. Returns how many moved."""
    if not tags:
        return 0
    now = broker_now(client) if now is None else now
    if not _forward:
        _forward.append(client.register_script(_FORWARD))
    return int(_forward[0](keys=[layout.UNACKED_INDEX], args=[repr(now), *tags], client=client))


# kombu's two lease transactions as one script each (tensorturn.pool.transport). KEYS:
# unacked_index, unacked; ARGV: delivery time, delivery tag, the message as kombu stores it, how
# long a lease lives ('' for: take it whatever) — or, to give the lease back, the delivery tag
# alone. A lease under the same tag that is still fresh is not taken (0): its holder lives.
_TAKE = """
local held = redis.call('zscore', KEYS[1], ARGV[2])
if held and ARGV[4] ~= '' and tonumber(held) > tonumber(ARGV[1]) - tonumber(ARGV[4]) then return 0 end
redis.call('zadd', KEYS[1], ARGV[1], ARGV[2])
redis.call('hset', KEYS[2], ARGV[2], ARGV[3])
return 1
"""
_GIVE_BACK = """
redis.call('zrem', KEYS[1], ARGV[1])
redis.call('hdel', KEYS[2], ARGV[1])
return 1
"""


def take_lease(client: Any, index_key: str, unacked_key: str, tag: str, stored: str, now: float,
               unless_held_s: float | None = None) -> bool:
    """A message delivered: ``stored`` (kombu's envelope) under its delivery ``tag`` in the
    ``unacked`` hash, delivered ``now`` in the index — atomically, in one command. With
    ``unless_held_s``, a lease under ``tag`` younger than that is left as it is and False is
    returned: another consumer holds that message, alive (this delivery is a copy of it)."""
    return bool(int(client.eval(_TAKE, 2, index_key, unacked_key, now, tag, stored,
                                "" if unless_held_s is None else unless_held_s)))


def give_back_lease(client: Any, index_key: str, unacked_key: str, tag: str) -> None:
    """A message acknowledged (or rejected for good): out of the index and the hash, atomically."""
    client.eval(_GIVE_BACK, 2, index_key, unacked_key, tag)


def lapsed_leases(client: Any, index_key: str, before: float, start: int, num: int) -> list[Any]:
    """Delivery tags of the ``num`` newest leases in ``index_key`` dated before ``before``
    (skipping ``start``), as kombu's restore sweep reads them."""
    found = client.zrange(index_key, before, 0, desc=True, byscore=True, offset=num and start, num=num,
                          withscores=True)
    return [tag for tag, _ in found or []]


def unacked(client: Any) -> int:
    """How many delivered messages are not acknowledged yet (tasks running or held somewhere)."""
    return int(client.hlen(layout.UNACKED))
