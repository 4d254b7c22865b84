"""Leases: a live task keeps its broker lease however long it runs, and a copy of its message
(replayed by someone with the Redis password) neither takes that lease nor begins an attempt."""

import json
import uuid

import pytest
import redis
from conftest import run_to_end, submit_run, wait_for, wait_for_run

from tensorturn import layout
from tensorturn.layout import UNACKED_INDEX
from tensorturn.pool.lease import refresh
from tensorturn.state.board import RunBoard
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


def test_a_refresh_stuck_on_the_wire_does_not_hold_up_the_next(redis_server):
    """The first refresh hangs (its packets dropped on a saturated uplink: TCP's back-off); the
    next tick's refresh goes out on a thread and connection of its own and moves the lease
    meanwhile."""
    import threading

    from tensorturn.state.broker import Hedged, lease_client, redis_client

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


@pytest.mark.e2e
def test_a_task_finishing_in_its_agents_shutdown_grace_keeps_its_lease(pool_factory, monkeypatch):
    """The agent running a shard is stopped (SIGTERM: Celery's cold shutdown with a soft grace
    longer than the lease). The shard finishes inside the grace, and its lease is kept all the
    while — by a thread, since the stopping worker sleeps out its grace on the event loop's
    thread — so it is never handed to the other agent: one attempt, on the stopped agent."""
    import os
    import signal

    from conftest import submit_run, wait_for_run

    from tensorturn.state.board import RunBoard

    monkeypatch.setenv("TENSORTURN_VISIBILITY_TIMEOUT_S", "3")
    monkeypatch.setenv("TENSORTURN_SHUTDOWN_GRACE_S", "20")  # the shard ends well inside it
    pool = pool_factory(2, step_s=0.01)  # 600 steps: six seconds of training, two leases
    spec = submit_run(pool, mode="fused", recipe="digits-mlp", rounds=1, shards=1, sync_every=600)
    board = RunBoard(redis.Redis.from_url(pool.broker_url, decode_responses=True))
    running = wait_for(lambda: next((a for a in board.attempts(spec.run_id)
                                     if a["task"] == "r0/shard-0" and a["outcome"] == "running"), None),
                       "the shard to start", pause=0.02)
    victim = int(running["worker"].split("@")[0].removeprefix("local")) - 1
    os.killpg(pool.agents[victim].pid, signal.SIGTERM)
    doc = wait_for_run(pool, spec.run_id)
    assert doc["state"] == "succeeded", doc.get("error")
    shard = [a for a in doc["attempts"] if a["task"] == "r0/shard-0"]
    assert [(a["worker"], a["outcome"]) for a in shard] == [(running["worker"], "succeeded")]
    assert not [i for i in doc["incidents"] if i["kind"] in ("requeued", "duplicate_ignored")]


@pytest.mark.e2e
def test_copies_of_a_running_tasks_message_begin_no_attempt_and_leave_its_lease(pool_factory):
    # Someone with the Redis password pushes copies of a training shard's message back into its
    # queue while it runs: as held (its delivery tag) and with tags of their own. A copy must not
    # begin an attempt (each used to record the running one lost: three failed the run), nor its
    # acknowledgement end the running task's lease (its machine dying would then lose the task).
    pool = pool_factory(3, step_s=0.01)  # ~3 s of training: the copies arrive while it runs
    spec = submit_run(pool, mode="fused", recipe="digits-mlp", rounds=1, shards=1, sync_every=300)
    r = redis_client(pool.broker_url)
    board = RunBoard(r)
    wait_for(lambda: any(a["task"] == "r0/shard-0" and a["outcome"] == "running"
                         for a in board.attempts(spec.run_id)), "the shard training")
    [(tag, stored)] = r.hgetall(layout.UNACKED).items()  # the one message held: the shard's
    message, _, queue = json.loads(stored)
    copies = [message] * 3
    for _ in range(3):
        copies.append({**message, "properties": {**message["properties"], "delivery_tag": str(uuid.uuid4())}})
    r.lpush(queue, *(json.dumps(c) for c in copies))
    wait_for(lambda: sum(i["kind"] == "duplicate_ignored" for i in board.incidents(spec.run_id)) == 6
             or board.is_finished(spec.run_id), "the copies delivered")
    assert r.zscore(UNACKED_INDEX, tag) is not None or board.is_finished(spec.run_id)  # still leased

    doc = wait_for_run(pool, spec.run_id)
    assert doc["state"] == "succeeded", doc.get("error")
    shard = [a for a in doc["attempts"] if a["task"] == "r0/shard-0"]
    assert [a["outcome"] for a in shard] == ["succeeded"]
    ignored = [i for i in doc["incidents"] if i["kind"] == "duplicate_ignored"]
    assert len(ignored) == 6 and all("under a live lease" in i["detail"] for i in ignored), doc["incidents"]
