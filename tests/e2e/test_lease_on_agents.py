"""Task leases on real agents: a task far longer than the visibility timeout runs once, one
finishing in its agent's shutdown grace keeps its lease, and copies of a running task's message
begin no attempt."""

import json
import uuid

import redis
from conftest import run_to_end, submit_run, wait_for, wait_for_run

from tensorturn import layout
from tensorturn.layout import UNACKED_INDEX
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import redis_client


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
    running = wait_for(lambda: next((a for a in board.attempts.all(spec.run_id)
                                     if a["task"] == "r0/shard-0" and a["outcome"] == "running"), None),
                       "the shard to start", pause=0.02)
    victim = int(running["worker"].split("@")[0].removeprefix("local")) - 1
    os.killpg(pool.agents[victim].pid, signal.SIGTERM)
    doc = wait_for_run(pool, spec.run_id)
    assert doc["state"] == "succeeded", doc.get("error")
    shard = [a for a in doc["attempts"] if a["task"] == "r0/shard-0"]
    assert [(a["worker"], a["outcome"]) for a in shard] == [(running["worker"], "succeeded")]
    assert not [i for i in doc["incidents"] if i["kind"] in ("requeued", "duplicate_ignored")]


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
                         for a in board.attempts.all(spec.run_id)), "the shard training")
    [(tag, stored)] = r.hgetall(layout.UNACKED).items()  # the one message held: the shard's
    message, _, queue = json.loads(stored)
    copies = [message] * 3
    for _ in range(3):
        copies.append({**message, "properties": {**message["properties"], "delivery_tag": str(uuid.uuid4())}})
    r.lpush(queue, *(json.dumps(c) for c in copies))
    wait_for(lambda: sum(i["kind"] == "duplicate_ignored" for i in board.incidents.all(spec.run_id)) == 6
             or board.runs.is_finished(spec.run_id), "the copies delivered")
    assert r.zscore(UNACKED_INDEX, tag) is not None or board.runs.is_finished(spec.run_id)  # still leased

    doc = wait_for_run(pool, spec.run_id)
    assert doc["state"] == "succeeded", doc.get("error")
    shard = [a for a in doc["attempts"] if a["task"] == "r0/shard-0"]
    assert [a["outcome"] for a in shard] == ["succeeded"]
    ignored = [i for i in doc["incidents"] if i["kind"] == "duplicate_ignored"]
    assert len(ignored) == 6 and all("under a live lease" in i["detail"] for i in ignored), doc["incidents"]
