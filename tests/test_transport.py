"""TensorTurn's kombu transport (``tensorturn.pool.transport``): a delivered message's lease is
taken and given back in one command each, leaving on the broker exactly what kombu's own
transport leaves, so kombu's restore sweep requeues it the same way."""

from __future__ import annotations

import json

import redis
from kombu import Connection, Exchange, Queue

from tensorturn import layout
from tensorturn.pool import transport

QUEUE = "tt.transport-test"


def deliver(url: str, transport_name: str | None, body: dict) -> tuple[Connection, object]:
    """Publish ``body`` and take it (unacknowledged) through ``transport_name``."""
    conn = Connection(url, transport=transport_name, transport_options={"visibility_timeout": 3600})
    queue = Queue(QUEUE, Exchange(QUEUE), routing_key=QUEUE)
    with conn.Producer() as producer:
        producer.publish(body, exchange=queue.exchange, routing_key=QUEUE, declare=[queue], serializer="json")
    message = conn.SimpleQueue(queue, no_ack=False).get(timeout=5)
    return conn, message


def lease(r: redis.Redis) -> tuple[list[str], list[list]]:
    """The unacked index's tags, and the unacked hash's entries as kombu stores them (JSON)."""
    return r.zrange(layout.UNACKED_INDEX, 0, -1), [json.loads(v) for v in r.hvals(layout.UNACKED)]


def test_a_lease_is_what_kombus_transport_leaves_and_goes_with_the_ack(redis_server, monkeypatch):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    seen = []
    original = r.__class__.execute_command

    conn, message = deliver(redis_server.url, None, {"n": 1})  # kombu's own transport
    theirs = lease(r)
    message.ack()
    conn.release()
    assert lease(r) == ([], [])

    def counted(self, *args, **kwargs):
        seen.append(args[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "execute_command", counted)
    conn, message = deliver(redis_server.url, transport.NAME, {"n": 1})
    ours = lease(r)
    assert len(ours[0]) == 1 and ours[0][0] != theirs[0][0]  # a new delivery tag
    envelope, their_envelope = ours[1][0], theirs[1][0]
    assert envelope[1:] == their_envelope[1:]  # exchange and routing key
    assert envelope[0]["body"] == their_envelope[0]["body"]  # its message, as kombu encoded it
    assert set(envelope[0]) == set(their_envelope[0])
    seen.clear()
    message.ack()
    assert lease(r) == ([], [])
    assert "MULTI" not in seen and seen.count("EVAL") == 1  # one command, no transaction
    conn.release()


def test_a_message_rejected_for_good_leaves_no_lease_and_a_requeued_one_goes_back(redis_server):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    conn, message = deliver(redis_server.url, transport.NAME, {"n": 2})
    message.reject(requeue=False)
    assert lease(r) == ([], []) and r.llen(QUEUE) == 0  # gone for good
    conn.release()
    conn, message = deliver(redis_server.url, transport.NAME, {"n": 3})
    message.requeue()
    assert lease(r) == ([], []) and r.llen(QUEUE) == 1
    conn.release()
