"""TensorTurn's kombu transport (``tensorturn.pool.transport``): a delivered message's lease is
taken and given back in one command each, leaving on the broker exactly what kombu's own
transport leaves, so kombu's restore sweep requeues it the same way."""

from __future__ import annotations

import json
import time

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


def test_leases_and_the_restore_sweep_keep_the_brokers_time_whatever_this_machines_clock(
        redis_server, monkeypatch):
    """A machine whose clock is two hours off (a laptop just awake) writes its leases, and
    sweeps for lapsed ones, on the broker's clock: its own lease is fresh to everyone, another
    machine's fresh lease is not requeued by it, and a lease lapsed on the broker is."""
    from tensorturn.state import clock, queues

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)

    def broker() -> float:
        seconds, micros = r.time()
        return seconds + micros / 1e6

    def skewed(by_s: float) -> None:
        monkeypatch.setattr(clock, "_wall", lambda: time.time() + by_s)
        clock._clocks.clear()  # measured afresh, as by a process started now

    skewed(+7200)  # ahead by more than the test's 3600 s visibility timeout
    conn, message = deliver(redis_server.url, transport.NAME, {"n": 4})
    (tag, score), = r.zrange(layout.UNACKED_INDEX, 0, -1, withscores=True)
    assert abs(score - broker()) < 5  # not two hours ahead
    message.channel.qos.restore_visible(interval=1)  # kombu's sweep, from the machine ahead
    assert r.zscore(layout.UNACKED_INDEX, tag) is not None and r.llen(QUEUE) == 0  # not requeued

    skewed(-7200)  # behind: a refresh still moves the lease to the broker's now
    r.zadd(layout.UNACKED_INDEX, {tag: broker() - 100})
    assert queues.refresh_leases(r, [tag]) == 1
    assert abs(r.zscore(layout.UNACKED_INDEX, tag) - broker()) < 5

    r.zadd(layout.UNACKED_INDEX, {tag: broker() - 4000})  # lapsed on the broker's clock
    message.channel.qos.restore_visible(interval=1)
    assert r.zscore(layout.UNACKED_INDEX, tag) is None and r.llen(QUEUE) == 1  # back in its queue
    conn.release()


def test_the_broker_clock_measures_again_when_this_machines_clock_jumps(redis_server, monkeypatch):
    from tensorturn.state import clock

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    jump = [0.0]
    monkeypatch.setattr(clock, "_wall", lambda: time.time() + jump[0])
    seconds, _ = r.time()
    measured = clock.BrokerClock(r)
    assert abs(measured.now() - seconds) < 5
    jump[0] = 120.0  # a two-minute sleep the monotonic clock did not see, or a manual change
    assert abs(measured.now() - r.time()[0]) < 5


def test_the_broker_clock_never_waits_for_another_threads_measurement():
    """A lease refresh whose clock measurement is stuck on a slow link does not hold up the
    next refresh's clock: that one uses the offset already held."""
    import threading

    from tensorturn.state import clock

    release, asked = threading.Event(), threading.Event()

    class SlowBroker:
        answers = [(1000, 0)]

        def time(self):
            if not self.answers:
                asked.set()
                release.wait(30)  # stuck behind a saturated uplink
                return (2000, 0)
            return self.answers.pop()

    measured = clock.BrokerClock(SlowBroker())
    first = measured.now()  # measured at once: the broker says 1000
    assert abs(first - 1000) < 5
    measured.mono -= clock.MEASURE_EVERY_S + 1  # the offset is old now: the next call measures
    stuck = threading.Thread(target=measured.now)
    stuck.start()
    assert asked.wait(30)
    assert abs(measured.now() - 1000) < 5  # answered with the held offset, without waiting
    release.set()
    stuck.join(30)


def test_a_broker_clock_is_one_per_address_and_credentials():
    """A clock measures with the client it was made with: a broker started later on the same
    port with another password (a second embedded pool in one script) gets a clock of its own,
    not one whose client no longer logs in (it would retry its login for a minute a measure)."""
    import redis

    from tensorturn.state import clock

    first = redis.Redis(host="127.0.0.1", port=6390, password="one")
    assert clock.broker_clock(first) is clock.broker_clock(redis.Redis(host="127.0.0.1", port=6390, password="one"))
    assert clock.broker_clock(first) is not clock.broker_clock(redis.Redis(host="127.0.0.1", port=6390, password="two"))
    assert clock.broker_clock(first) is not clock.broker_clock(redis.Redis(host="127.0.0.1", port=6390))


def test_messages_published_together_reach_the_broker_at_the_blocks_end_or_not_at_all(world):
    """A round's slots are queued in one round trip (kombu's publish batch): none is queued
    before the block ends, all are after it, and none when the block raises."""
    import pytest

    from tensorturn.modes.fused.driver import train_slot
    from tensorturn.pool.celery_app import publishing
    from tensorturn.tasks.attempt import signed

    r = world.board.r

    def queue(producer, i: int) -> None:
        train_slot.s("run", 1, i, **signed("run", f"r1/slot-{i}")).apply_async(queue="tt.test", producer=producer)

    with publishing() as producer:
        for i in range(3):
            queue(producer, i)
        assert r.llen("tt.test") == 0
    assert r.llen("tt.test") == 3
    with pytest.raises(RuntimeError), publishing() as producer:
        queue(producer, 3)
        raise RuntimeError("the dispatch failed half way")
    assert r.llen("tt.test") == 3
