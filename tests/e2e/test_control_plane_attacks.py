"""Someone with the Redis password against real agents: a stale routing entry, a forged 4 TB
heartbeat and remote control move, admit and stop nothing."""

from __future__ import annotations

import json
import time

import pytest
import redis
from conftest import start_pool, submit_run, tt, wait_for

from tensorturn import config, layout, runs
from tensorturn.layout import worker_key
from tensorturn.pool import capacity
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import check_broker
from tensorturn.state.queues import task_queues

FORGED_INVENTORY = json.dumps({"device": "cuda", "device_name": "8x H100", "cpu_count": 128,
                               "device_memory_gb": 4096.0, "role": "train"})


TB = 1024 ** 4

def forge_worker(r, name: str, inventory: str = FORGED_INVENTORY) -> None:
    """What someone with the Redis password writes: a heartbeat with a date to come, so it
    looks live for as long as they like."""
    r.hset(worker_key(name), mapping={"name": name, "inventory": inventory,
                                      "last_seen": time.time() + 86400, "tasks_done": 0})



pytestmark = pytest.mark.long  # minutes of agents: scheduled first (conftest)


@pytest.fixture(scope="module")
def paced(tmp_path_factory):
    """Two agents whose every training step lasts 10 ms, shared by the attacks below: a run's
    slots wait queued as long as each test needs, however loaded the machine is."""
    pool = start_pool(tmp_path_factory.mktemp("paced"), 2, step_s=0.01)
    yield pool
    pool.stop(grace=1.0)


def test_a_stale_routing_entry_naming_the_training_queue_moves_nothing(paced):
    # every step lasts 10 ms: four shards of 200 steps on two agents, so two slots wait queued
    # while the entry is there
    pool = paced
    r = redis.Redis.from_url(pool.broker_url, decode_responses=True)
    spec = submit_run(pool, mode="fused", recipe="digits-mlp", rounds=2, shards=4, sync_every=200)
    board = RunBoard(check_broker(pool.broker_url))
    queue = capacity.queue_for(board.describe(spec.run_id)["spec"]["memory_needed_bytes"])
    wait_for(lambda: r.llen(queue) > 0, "slot messages waiting in the training queue")
    entry = f"{queue}|gone@h"
    r.zadd(layout.ADVERTISED, {entry: 0})  # "tt.outer." is 9 characters: the target was "MB"
    wait_for(lambda: r.zscore(layout.ADVERTISED, entry) is None, "a heartbeat to remove the entry")
    assert not r.exists(queue[len(layout.OUTER_PREFIX):]) and not r.exists("MB")
    doc = runs.wait(pool.broker_url, spec.run_id, timeout_s=600)
    assert doc["state"] == "succeeded", doc.get("error") or doc.get("note")


def test_a_forged_heartbeat_claiming_4_tb_admits_nothing(pool_factory, monkeypatch):
    # the real agent offers 1 MB: digits-mlp (about 2 MB, memory class 4 MB) fits it not
    monkeypatch.setenv("TENSORTURN_DEVICE_MEMORY_GB", "0.001")
    config.reload()
    pool = pool_factory(1)
    r = redis.Redis.from_url(pool.broker_url, decode_responses=True)
    forge_worker(r, "big@gpu")
    proc = tt("run", "--broker", pool.broker_url, "--recipe", "digits-mlp", "--store",
              pool.store_url, "--detach")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert "no live machine can hold it" in line and "big@gpu" not in line.split(";")[0]
    assert "memory class 4 MB" in line and "offers 1.0 MB (cpu)" in line
    assert "not counted: 1 machine(s) whose heartbeat is not signed" in line
    assert not [q for q in r.scan_iter("tt.fits.*") if r.llen(q)] and r.zcard("tt:runs") == 0
    shown = tt("workers", "--broker", pool.broker_url)
    assert any(row.split()[:2] == ["big@gpu", "unverified"] for row in shown.stdout.splitlines())


def test_remote_control_cannot_stop_starve_or_redirect_the_agents(paced):
    # every step lasts 10 ms: four shards of 100 steps on two agents, so two wait queued
    attack_with_remote_control(paced)


def attack_with_remote_control(attacked_pool) -> None:
    """Everything below comes from someone with the Redis password only: the agents stay up and
    consuming, answer ping and inspect, and a run finishes while its tasks are being revoked."""
    from tensorturn.pool.celery_app import app, configure

    configure(attacked_pool.broker_url)
    r = redis.Redis.from_url(attacked_pool.broker_url, decode_responses=True)
    before = {w: sorted(q["name"] for q in qs) for w, qs in app.control.inspect(timeout=5).active_queues().items()}
    assert len(before) == 2
    control = app.control
    replies = []
    for command, arguments in [
            ("pool_restart", {}), ("time_limit", {"task_name": "tensorturn.fused.train_slot", "hard": 1}),
            ("rate_limit", {"task_name": "tensorturn.fused.train_slot", "rate_limit": "1/h"}),
            ("pool_shrink", {"n": 1}), ("autoscale", {"max": 0, "min": 0}),
            ("add_consumer", {"queue": capacity.queue_for(TB)}), ("disable_events", {}),
            ("hello", {"from_node": "x@y", "revoked": ["nothing"]})]:
        replies += control.broadcast(command, arguments=arguments, reply=True, timeout=10, limit=2)
    for queues in before.values():
        for queue in queues:
            replies += control.cancel_consumer(queue, reply=True, timeout=10, limit=2)
    assert replies and all("refused" in next(iter(x.values())).get("error", "") for x in replies), replies
    control.shutdown()
    for w in r.scan_iter("tt:worker:*"):  # out of rotation, says an unsigned mark
        r.hset(w, "quarantined", "forged")
    pongs = control.ping(timeout=10)  # after the shutdown: each agent takes commands in order
    assert len(pongs) == 2 and all(proc.poll() is None for proc in attacked_pool.agents)
    after = {w: sorted(q["name"] for q in qs) for w, qs in app.control.inspect(timeout=5).active_queues().items()}
    assert after == before
    refused = [json.loads(x)["task"] for x in r.lrange(layout.REFUSED, 0, -1)]
    assert "remote control: shutdown" in refused and "remote control: cancel_consumer" in refused

    spec = RunSpec.create(store_url=attacked_pool.store_url, mode="fused", recipe="digits-mlp",
                          rounds=2, shards=4, sync_every=100)
    runs.submit(spec, attacked_pool.broker_url)
    board = RunBoard(r)

    def revoke_every_task() -> bool:  # an agent that took these would discard the messages
        ids = [m["headers"]["id"] for m in task_messages(r)]
        if ids:
            control.revoke(ids)
        return board.runs.state(spec.run_id) in ("succeeded", "failed", "cancelled")

    wait_for(revoke_every_task, "the run to finish", timeout=600, pause=0.2)
    assert board.runs.state(spec.run_id) == "succeeded", board.describe(spec.run_id).get("error")
    assert len(app.control.inspect(timeout=5).active()) == 2
    assert not [w for w in r.scan_iter("tt:worker:*") if r.hexists(w, "quarantined")]


def task_messages(r) -> list[dict]:
    """Every task message waiting in a queue, or delivered and not yet acknowledged."""
    waiting = [json.loads(m) for q in task_queues(r) for m in r.lrange(q, 0, -1)]
    return waiting + [json.loads(v)[0] for v in r.hvals(layout.UNACKED)]
