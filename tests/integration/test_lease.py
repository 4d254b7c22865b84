"""Leases: a live task keeps its broker lease however long it runs, and a copy of its message
(replayed by someone with the Redis password) neither takes that lease nor begins an attempt."""


import redis
from conftest import wait_for

from tensorturn.layout import UNACKED_INDEX
from tensorturn.pool.lease import refresh
from tensorturn.state.broker import redis_client


def test_refresh_moves_only_leases_still_held(redis_server):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    r.zadd(UNACKED_INDEX, {"held": 100.0, "other": 100.0})
    assert refresh(r, ["held", "gone"], now=500.0) == 1
    assert r.zscore(UNACKED_INDEX, "held") == 500.0
    assert r.zscore(UNACKED_INDEX, "other") == 100.0
    assert r.zscore(UNACKED_INDEX, "gone") is None  # acked meanwhile: never re-created


def test_the_restore_sweeps_lock_lasts_seconds_not_minutes(redis_server):
    """kombu takes a lock for each restore sweep; with its default (300 s), a machine whose link
    went down while it held the lock stopped every requeue for five minutes. The broker
    connection TensorTurn configures takes it for 2 s."""
    from tensorturn.pool.celery_app import app, configure

    configure(redis_server.url)
    with app.connection_for_write() as conn:
        channel = conn.default_channel
        assert channel.unacked_mutex_expire == 2
        lock = channel.client.lock(channel.unacked_mutex_key, timeout=channel.unacked_mutex_expire)
        assert lock.acquire(blocking=False)  # as kombu's sweep does; the holder then vanishes
        assert 0 < channel.client.pttl(channel.unacked_mutex_key) <= 2000


def test_a_refresh_stuck_on_the_wire_does_not_hold_up_the_next(redis_server):
    """The first refresh hangs (its packets dropped on a saturated uplink: TCP's back-off); the
    next tick's refresh goes out on a thread and connection of its own and moves the lease
    meanwhile."""
    import threading

    from tensorturn.state.broker import Hedged, lease_client

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    r.zadd(UNACKED_INDEX, {"held": 100.0})
    client, hedged = lease_client(redis_client(redis_server.url), timeout_s=60), Hedged("lease refresh")
    wire, stuck = threading.Event(), threading.Event()

    def lost_then_sent(tags: list[str]) -> None:
        stuck.set()
        wire.wait()  # until the test lets it through
        refresh(client, tags)

    try:
        assert hedged.send(lost_then_sent, ["held"])
        wait_for(stuck.is_set, "the first refresh to be under way")
        assert hedged.send(refresh, client, ["held"])  # does not wait for the first
        wait_for(lambda: r.zscore(UNACKED_INDEX, "held") > 100.0, "the second refresh to land")
        wait_for(lambda: hedged.out == 1, "the second refresh's thread to end")  # the first is still out
    finally:
        wire.set()
        hedged.close()


def test_a_late_refresh_never_moves_a_lease_back(redis_server):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    r.zadd(UNACKED_INDEX, {"held": 100.0})
    assert refresh(r, ["held"], now=500.0) == 1
    assert refresh(r, ["held"], now=400.0) == 0  # sent earlier, landed later
    assert r.zscore(UNACKED_INDEX, "held") == 500.0


def test_a_refresh_finding_its_limit_still_out_is_skipped():
    """Refreshes that never come back (a link down) do not pile up threads: past ``in_flight``
    a tick is skipped, and once they end the next goes out."""
    import threading

    from tensorturn.state.broker import Hedged

    hedged, wire = Hedged("lease refresh", in_flight=2), threading.Event()
    try:
        assert hedged.send(wire.wait) and hedged.send(wire.wait)
        assert not hedged.send(wire.wait)  # two still out: skipped
        wire.set()
        wait_for(lambda: hedged.out == 0, "the stuck refreshes to end")
        assert hedged.send(wire.wait)
    finally:
        wire.set()
        hedged.close()


