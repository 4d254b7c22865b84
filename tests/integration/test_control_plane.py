"""What someone with only the Redis password can no longer do to the pool's control plane: drain a
training queue through a routing entry, get a model past the memory check with a forged
heartbeat, take an agent out of rotation, or stop, starve or redirect agents through Celery's
remote control. Unit tests against a real redis-server, and the attacks on real pools."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import redis
from celery.worker.control import Panel
from conftest import tt_here

from tensorturn import config, layout, runs, trust
from tensorturn.layout import worker_key
from tensorturn.pool import capacity, remote_control, routing
from tensorturn.pool.telemetry import INCARNATION, Heartbeat
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.roster import list_workers

TB = 1024 ** 4
FORGED_INVENTORY = json.dumps({"device": "cuda", "device_name": "8x H100", "cpu_count": 128,
                               "device_memory_gb": 4096.0, "role": "train"})


def beat(r, name: str) -> Heartbeat:
    """An agent's heartbeat bootstep, without a worker around it; it beats once."""
    hb = Heartbeat.__new__(Heartbeat)
    hb.client, hb.node, hb.tref, hb.outer = r, name, None, []
    hb.beat(first=True)
    return hb


def forge_worker(r, name: str, inventory: str = FORGED_INVENTORY) -> None:
    """What someone with the Redis password writes: a heartbeat with a date to come, so it
    looks live for as long as they like."""
    r.hset(worker_key(name), mapping={"name": name, "inventory": inventory,
                                      "last_seen": time.time() + 86400, "tasks_done": 0})


# ---- routing entries ---------------------------------------------------------------------------

def test_the_mover_takes_only_entries_naming_an_outer_queue_and_removes_the_others(redis_server):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    r.lpush("tt.fits.64MB", "slot-1", "slot-2")
    r.lpush("tt.agent.a@h", "backup")
    r.zadd(layout.ADVERTISED, {"tt.fits.64MB|ghost@h": 0,            # a training queue
                                "tt.outer.tt.agent.a@h|ghost@h": 0,   # an agent's own queue
                                "tt.outer.elsewhere|ghost@h": 0,      # no capacity queue
                                "tt.outer.tt.fits.64MB|ghost@h": 0,   # valid: stale, queue empty
                                # valid name, dated to come: it would keep the queue "served"
                                "tt.outer.celery|future@h": time.time() + 86400})
    assert routing.queue_for_outer(r, "celery") == "celery"
    assert routing.reroute(r) == 0
    assert r.lrange("tt.fits.64MB", 0, -1) == ["slot-2", "slot-1"]
    assert r.lrange("tt.agent.a@h", 0, -1) == ["backup"]
    assert not r.exists("MB") and not r.exists("a@h") and not r.exists("elsewhere")
    assert r.zrange(layout.ADVERTISED, 0, -1) == []  # the valid stale one: a day old, queue empty

    # nor does Python name anything else: an agent advertises only outer queues
    routing.advertise(r, "b@h", ["tt.fits.64MB", "tt.outer.bogus", "tt.outer.tt.fits.64MB"])
    assert [e.split("|")[0] for e in r.zrange(layout.ADVERTISED, 0, -1)] == ["tt.outer.tt.fits.64MB"]
    assert routing.queue_for_outer(r, "tt.fits.64MB") == "tt.outer.tt.fits.64MB"
    assert routing.queue_for_outer(r, "tt.fits.63MB") == "tt.fits.63MB"


# ---- heartbeats --------------------------------------------------------------------------------

def test_heartbeats_keep_the_brokers_clock_whatever_the_machines_clocks(redis_server, monkeypatch):
    """An agent whose clock is two hours behind beats on the broker's clock, and a `workers`
    run on a machine two hours ahead still sees it live (each measured its offset to Redis)."""
    from tensorturn.state import clock

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    for by_s, who in ((-7200, "agent"), (+7200, "reader")):
        monkeypatch.setattr(clock, "_wall", lambda by_s=by_s: time.time() + by_s)
        clock._clocks.clear()
        if who == "agent":
            beat(r, "behind@h")
    (seen,) = list_workers(r)
    assert seen["name"] == "behind@h" and seen["state"] == "idle" and abs(seen["last_seen_s"]) < 5


def test_a_forged_heartbeat_is_unverified_and_counts_for_nothing(redis_server):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    real = beat(r, "real@h")
    forge_worker(r, "forged@gpu")
    # a copy of the real agent's signed beat, with more memory: the signature no longer holds
    copied = r.hgetall(worker_key("real@h"))
    inventory = {**json.loads(copied["inventory"]), "device_memory_gb": 4096.0}
    r.hset(worker_key("copy@h"), mapping={**copied, "name": "copy@h"})
    r.hset(worker_key("real@h"), "inventory", json.dumps(inventory))
    r.hset(worker_key("junk@h"), mapping={"inventory": "[1", "last_seen": "soon", "live": "7",
                                          "tasks_done": "many"})  # no crash on junk either
    workers = {w["name"]: w for w in list_workers(r)}
    assert {n: (w["state"], w["verified"]) for n, w in workers.items()} == {
        "real@h": ("unverified", False), "forged@gpu": ("unverified", False),
        "copy@h": ("unverified", False), "tt:worker:junk@h": ("offline", False)}
    real.beat()  # the agent's next beat: itself again
    workers = {w["name"]: w for w in list_workers(r)}
    assert workers["real@h"]["state"] == "idle" and workers["real@h"]["verified"] is True
    assert "celery" in workers["real@h"]["queues"]
    offered = workers["real@h"]["device_memory_gb"]

    need = {"total_bytes": int((offered + 1) * capacity.GB)}  # more than the real machine has
    with pytest.raises(capacity.DoesNotFit) as refused:
        capacity.check_fits(need, list(workers.values()))
    assert "no live machine can hold it" in str(refused.value)
    assert "real@h" in str(refused.value) and "forged@gpu" not in str(refused.value)
    assert "not counted: 2 machine(s) whose heartbeat is not signed with this pool's key" in str(refused.value)
    capacity.check_fits({"total_bytes": 1024}, list(workers.values()))  # what it can hold passes

    shown = tt_here("workers", "--broker", redis_server.url)
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line.split()[1] for line in shown.stdout.splitlines()[1:]}
    assert rows["forged@gpu"] == "unverified" and rows["real@h"] == "idle"


def test_a_quarantine_mark_not_signed_for_this_start_of_the_agent_is_removed(redis_server):
    from tensorturn.pool.telemetry import quarantine_mark

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    hb = beat(r, "w@h")
    r.hset(worker_key("w@h"), "quarantined", "by someone with the Redis password")
    assert [w["state"] for w in list_workers(r)] == ["idle"]
    hb.beat()
    assert not r.hexists(worker_key("w@h"), "quarantined")
    # a signed mark of an earlier start of the agent (replayed after its restart) is removed too
    key = trust.pool_key()
    old = {"quarantined": "an old reason", "quarantined_sig": key.sign(
        "quarantine", {"worker": "w@h", "reason": "an old reason", "incarnation": "0" * 16})}
    r.hset(worker_key("w@h"), mapping=old)
    assert [w["state"] for w in list_workers(r)] == ["idle"]
    hb.beat()
    assert not r.hexists(worker_key("w@h"), "quarantined")
    # the agent's own tasks' mark holds
    r.hset(worker_key("w@h"), mapping=quarantine_mark("w@h", "store failures"))
    hb.beat()
    assert [(w["state"], w["quarantined"]) for w in list_workers(r)] == [("quarantined", "store failures")]


def test_a_run_no_live_machine_can_hold_says_so(redis_server, tmp_path):
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    board = RunBoard(r)
    spec = RunSpec.create(store_url=(tmp_path / "store").as_uri(), mode="fused",
                          recipe="digits-mlp", rounds=1, shards=2, sync_every=10)
    spec.memory_needed_bytes = 2 * TB  # the class of the largest models
    board.runs.create(spec)
    beat(r, "small@h")
    forge_worker(r, "forged@gpu")
    config.use(config.current().with_(stall_s=0.0))
    doc = runs.annotate(board.describe(spec.run_id), board)
    assert doc["note"].startswith("no progress for")
    assert "no live machine can hold it: its tasks need about 2048.00 GB" in doc["note"]
    assert "not counted: 1 machine(s)" in doc["note"]
    r.delete(worker_key("small@h"))  # only the forged one left
    doc = runs.annotate(board.describe(spec.run_id), board)
    assert "no live machine can hold it: every agent is offline, quarantined or unverified" in doc["note"]


# ---- remote control ----------------------------------------------------------------------------

def test_an_outer_only_agent_holds_no_shard():
    """An agent started with --role outer takes only outer steps: however large, it is not a
    machine a run's shards can wait for."""
    big = {"name": "coordinator", "state": "idle", "device_memory_gb": 64.0, "role": "outer"}
    small = {"name": "laptop", "state": "idle", "device_memory_gb": 1.0, "role": "train"}
    need = 4 * 1024 ** 3
    assert capacity.holders(need, [big, small]) == []
    assert "no live machine can hold it" in (capacity.why_unheld(need, [big, small]) or "")
    assert capacity.holders(need, [{**big, "role": "both"}]) != []


def test_remote_control_answers_monitoring_and_signed_commands_only(redis_server):
    from flower.inspector import Inspector

    # what `celery inspect` and Flower send stays as Celery has it
    assert set(Inspector.inspect_methods) | {"ping", "enable_events"} <= remote_control.MONITORING
    panel = dict(Panel.data)
    remote_control.guard(panel)
    remote_control.guard(panel)  # once is enough, twice the same
    assert all(panel[name] is Panel.data[name] for name in remote_control.MONITORING)
    changed = {name for name in panel if panel[name] is not Panel.data[name]}
    assert changed == set(Panel.data) - remote_control.MONITORING
    assert {"shutdown", "pool_restart", "time_limit", "rate_limit", "add_consumer", "autoscale",
            "pool_shrink", "pool_grow", "hello", "terminate", "disable_events"} <= changed

    cancelled: list[str] = []
    state = SimpleNamespace(hostname="a@h", app=SimpleNamespace(conf=SimpleNamespace(broker_url=redis_server.url)),
                            consumer=SimpleNamespace(call_soon=lambda f, q: cancelled.append(q),
                                                     cancel_task_queue=None))
    answer = panel["shutdown"](state, msg="bye")
    assert "refused by a@h: not allowed" in answer["error"]
    assert "refused" in panel["cancel_consumer"](state, queue="celery")["error"]

    def signed(worker: str, incarnation: str, queue: str) -> str:
        doc = {"command": "cancel_consumer", "arguments": {"queue": queue}, "worker": worker,
               "incarnation": incarnation}
        return trust.pool_key().sign(remote_control.PURPOSE, doc)

    cancel = panel["cancel_consumer"]
    for queue, sig in [("celery", signed("b@h", INCARNATION, "celery")),   # another agent's
                       ("celery", signed("a@h", "0" * 16, "celery")),      # its earlier start's
                       ("tt.fits.1MB", signed("a@h", INCARNATION, "celery"))]:  # another queue's
        assert "bad signature" in cancel(state, queue=queue, sig=sig)["error"]
    assert cancelled == []
    assert "ok" in cancel(state, queue="celery", sig=signed("a@h", INCARNATION, "celery"))
    assert cancelled == ["celery"]
    refused = [json.loads(x) for x in redis.Redis.from_url(redis_server.url).lrange(layout.REFUSED, 0, -1)]
    assert refused[-1]["task"] == "remote control: shutdown" and refused[-1]["worker"] == "a@h"
    assert len(refused) == 5


# ---- the attacks on real pools ---------------------------------------------------------------


