"""Leases: a live task keeps its broker lease however long it runs."""


import pytest
import redis
from conftest import run_to_end, wait_for

from tensorturn.layout import UNACKED_INDEX
from tensorturn.pool.lease import refresh


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


@pytest.mark.e2e
def test_a_task_far_longer_than_the_visibility_timeout_runs_once(pool_factory, monkeypatch):
    # A 3 s visibility timeout; one shard that trains for ~10x that. Without the lease keeper
    # the idle second agent's restore sweep would hand the shard out again after 3 s.
    monkeypatch.setenv("TENSORTURN_VISIBILITY_TIMEOUT_S", "3")
    pool = pool_factory(2)
    doc = run_to_end(pool, mode="fused", recipe="digits-mlp", rounds=1, shards=1, sync_every=12000)
    assert doc["state"] == "succeeded", doc.get("error")
    shard = [a for a in doc["attempts"] if a["task"] == "r0/shard-0"]
    assert len(shard) == 1 and shard[0]["outcome"] == "succeeded"
    assert doc["incidents"] == []
    ran_for = shard[0]["finished_at"] - shard[0]["started_at"]
    print(f"the shard ran {ran_for:.0f}s under a 3s visibility timeout, once")
    assert ran_for > 3  # the premise: it really outlived the visibility timeout


class FirstConnectionLost:
    """A TCP forwarder to Redis whose first connection is a black hole (what a refresh whose
    packets are being dropped looks like from the sender); later connections reach Redis."""

    def __init__(self, target_port: int):
        import socket
        import threading

        self.target = ("127.0.0.1", target_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.held: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            if not self.held:
                self.held.append(conn)  # read nothing, answer nothing
                continue
            upstream = socket.create_connection(self.target)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a, b) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            b.close()

    def close(self) -> None:
        self.server.close()
        for conn in self.held:
            conn.close()


def test_a_refresh_lost_on_the_wire_does_not_hold_up_the_next(redis_server):
    """The first refresh's connection goes silent (its packets dropped on a saturated uplink);
    the next tick's refresh goes out on a connection of its own and moves the lease meanwhile."""
    from urllib.parse import urlsplit

    from tensorturn.state.broker import Hedged, lease_client

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    r.zadd(UNACKED_INDEX, {"held": 100.0})
    proxy = FirstConnectionLost(urlsplit(redis_server.url).port)
    url = redis_server.url.replace(f":{urlsplit(redis_server.url).port}/", f":{proxy.port}/")
    client, hedged = lease_client(url, timeout_s=60), Hedged("lease refresh")
    try:
        assert hedged.send(refresh, client, ["held"])
        wait_for(lambda: proxy.held, "the first refresh's connection")
        assert hedged.send(refresh, client, ["held"])  # does not wait for the first
        wait_for(lambda: r.zscore(UNACKED_INDEX, "held") > 100.0, "the second refresh to land")
        assert hedged.out == 1  # the first is still unanswered
    finally:
        proxy.close()
        hedged.close()


def test_a_late_refresh_never_moves_a_lease_back(redis_server):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    r.zadd(UNACKED_INDEX, {"held": 100.0})
    assert refresh(r, ["held"], now=500.0) == 1
    assert refresh(r, ["held"], now=400.0) == 0  # sent earlier, landed later
    assert r.zscore(UNACKED_INDEX, "held") == 500.0
