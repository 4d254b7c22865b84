"""Async runs on real agents: an applier killed mid-update loses and double-counts nothing; backup
copies of a round's last shards give the same model."""

from __future__ import annotations

import os
import signal
import time

import redis
from conftest import run_to_end, submit_run

from tensorturn import layout, runs
from tensorturn.state.ledger import AsyncLedger
from tensorturn.store.objects import open_store


def test_an_applier_killed_mid_update_loses_nothing_and_counts_nothing_twice(pool_factory, monkeypatch):
    """Two agents; the one holding the apply lock is frozen there (SIGSTOP, checked to still
    hold it), then killed. The lock runs out and the other agent's tasks, waiting for their
    updates to be applied, take over: every update is applied exactly once, versions 1..R·S each made by
    one update, the rounds' samples add up to R·S·H·batch, and the result is the last version."""
    monkeypatch.setenv("TENSORTURN_VISIBILITY_TIMEOUT_S", "8")  # the lock's time to live too
    rounds, shards, steps = 3, 4, 40
    pool = pool_factory(2, loglevel="INFO")
    store_url = pool.store_url
    spec = submit_run(pool, mode="fused", recipe="digits-mlp", sync="async", rounds=rounds,
                      shards=shards, sync_every=steps, outer="nesterov")
    r = redis.Redis.from_url(pool.broker_url, decode_responses=True)
    book = AsyncLedger(r, spec.run_id)
    lock_key = layout.run_key(spec.run_id, "apply_lock")
    victim = None
    deadline = time.monotonic() + 240
    while victim is None:
        assert time.monotonic() < deadline, "nobody was caught applying an update"
        assert book.r.hget(layout.run_key(spec.run_id), "state") not in ("succeeded", "failed")
        token = r.get(lock_key)
        if not token:
            continue
        index = int(token.split("@")[0].removeprefix("local")) - 1
        group = pool.agents[index].pid
        os.killpg(group, signal.SIGSTOP)
        if r.get(lock_key) == token:  # frozen while applying: kill it there
            os.killpg(group, signal.SIGKILL)
            victim = token.rpartition(":")[0]
        else:
            os.killpg(group, signal.SIGCONT)  # it let go meanwhile: watch the next one
    doc = runs.wait(pool.broker_url, spec.run_id, timeout_s=300)
    latest = book.latest()
    assert doc["state"] == "succeeded", doc.get("error")
    total = rounds * shards
    updates = doc["updates"]
    assert sorted(u["update"] for u in updates) == list(range(total))
    assert [u["version"] for u in updates] == list(range(1, total + 1))
    assert all(u["staleness"] == u["version"] - 1 - u["base_version"] >= 0 for u in updates)
    assert sum(rec["samples"] for rec in doc["rounds"]) == total * steps * 32
    assert [rec["round"] for rec in doc["rounds"]] == list(range(rounds))
    # the victim's attempt never finished: lost if its message came back before the run ended,
    # else still marked running (the waiting tasks on the other agent had taken over)
    assert any(a["worker"] == victim and (a["outcome"] == "running" or a["outcome"].startswith("lost"))
               for a in doc["attempts"])
    store = open_store(store_url)
    logged = store.list(layout.prefix("version_log", spec.run_id))
    assert len(logged) == total
    assert latest["version"] == total and doc["model_sha256"] == latest["sha256"]
    assert all(store.get_json(layout.key("version_log", spec.run_id, u["version"]))["record"]["update"]
               == u["update"] for u in updates)


def test_backup_copies_of_a_rounds_last_shards_give_the_same_model(pool_factory, monkeypatch):
    """``--sync backup`` on a fast and a 10× slower agent (emulated step times), three shards:
    when the fast one has nothing left and, by the two rates, would finish the slow one's shard
    sooner, it trains a backup copy; whichever copy stores the shard first counts, and the model
    is bit for bit the one ``--sync rounds`` trains (the copies are the same computation)."""
    pool = pool_factory(0)
    for i, step_s in enumerate(("0.005", "0.05")):
        monkeypatch.setenv("TESTBED_SIM_STEP_S", step_s)
        pool.start_agent(i)
    monkeypatch.delenv("TESTBED_SIM_STEP_S")
    pool.wait_ready()
    docs = {}
    for sync in ("rounds", "backup"):
        docs[sync] = run_to_end(pool, mode="fused", recipe="digits-mlp", sync=sync, rounds=2, shards=3,
                                sync_every=60, threads_per_task=1)
        assert docs[sync]["state"] == "succeeded", docs[sync].get("error")
    assert docs["backup"]["model_sha256"] == docs["rounds"]["model_sha256"]
    queued = [i for i in docs["backup"]["incidents"] if i["kind"] == "backup_queued"]
    assert queued and all(i["worker"].startswith("local1@") for i in queued)  # the fast one
    assert all(layout.parse_label(i["task"]).kind == "backup" for i in queued)
    ran = [a for a in docs["backup"]["attempts"] if a["task"] in {i["task"] for i in queued}]
    assert ran and all(a["worker"].startswith("local1@") for a in ran)
    assert not [i for i in docs["rounds"]["incidents"] if i["kind"] == "backup_queued"]
