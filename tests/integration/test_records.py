"""A run's records on the broker: a partial record is a lost one, a finished run's keys expire,
leftovers are pruned, refusals are counted, and `runs rm` deletes a run that nothing uses.

Redis is the pool's live board, not its archive: the store keeps every run's signed spec and
manifest. So a record whose keys were deleted (with the Redis password only) ends in one clear
line and a `resume` that finishes the run, never in a traceback; and what a finished run, a
lost record or a machine gone for good leaves in Redis does not stay there forever.
"""

from __future__ import annotations

import json
import os
import time

import pytest
from conftest import run_outer, tt_here

from tensorturn import config, layout, runs
from tensorturn.errors import NotFound, StoreError
from tensorturn.modes.fused import driver as fused
from tensorturn.spec import RunSpec
from tensorturn.state import housekeeping, manifest
from tensorturn.store.objects import open_store
from tensorturn.tasks.attempt import refuse, signed
from tensorturn.tasks.start import start_run
from tensorturn.trust import pool_key

FUSED = dict(mode="fused", recipe="digits-mlp", rounds=2, shards=2, sync_every=5)


@pytest.fixture
def world(world):
    """The in-process world (conftest) whose runs store in one folder: this process plays the
    agent of that store."""
    world.store_url = (world.tmp / "store").as_uri()
    config.use(config.current().with_(store_url=world.store_url))  # the agent's own store
    world.store, world.r = open_store(world.store_url), world.board.r
    return world


def submit(world, **options) -> RunSpec:
    spec = RunSpec.create(store_url=world.store_url, **{**FUSED, **options})
    runs.submit(spec, world.broker)
    return spec


def shard(spec: RunSpec, r: int, k: int) -> None:
    fused.train_shard.apply(args=(spec.run_id, r, k), kwargs=signed(spec.run_id, f"r{r}/shard-{k}")).get()


def outer(spec: RunSpec, r: int) -> None:
    run_outer(spec, r)  # and the round's evaluation, as a pool runs it next


def drive(spec: RunSpec, start: int = 0) -> None:
    for r in range(start, spec.options.rounds):  # type: ignore[attr-defined]
        for k in range(spec.options.shards):  # type: ignore[attr-defined]
            shard(spec, r, k)
        outer(spec, r)


def run_keys(r, run_id: str) -> dict[str, int]:
    """Every key of the run on the broker, with its time to live (-1: none)."""
    keys = [layout.run_key(run_id), *r.scan_iter(match=layout.run_keys_pattern(run_id))]
    return {k: r.ttl(k) for k in keys if r.exists(k)}


def delete_run_keys(r, run_id: str) -> None:
    """What someone with the Redis password does: `DEL tt:run:<id>*`, the queues left alone."""
    r.delete(*run_keys(r, run_id))


# ---- a partial record is a lost record ------------------------------------------------------------

def test_a_hash_without_its_spec_is_no_record(world):
    spec = submit(world)
    world.r.hdel(layout.run_key(spec.run_id), "spec")   # what is left once a task wrote to a deleted record
    board = world.board
    assert not board.runs.exists(spec.run_id) and board.runs.state(spec.run_id) is None
    assert board.state_and_standing(spec.run_id, "w1@host") == (None, False, None)
    assert board.runs.list_runs() == []
    with pytest.raises(NotFound, match="record of run .* is incomplete.*tensorturn resume"):
        board.describe(spec.run_id)
    doc = runs.describe(spec.run_id, world.broker, world.store_url)  # from the store, with why
    assert doc["state"] == "queued" and "the broker has no record of the run" in doc["note"]
    with pytest.raises(NotFound, match="incomplete"):
        runs.cancel(spec.run_id, world.broker, world.store_url, by="test")


def test_no_writer_makes_up_a_record_that_was_deleted(world):
    spec = submit(world)
    delete_run_keys(world.r, spec.run_id)
    board = world.board
    board.runs.touch(spec.run_id)
    board.runs.mark_running(spec.run_id)
    board.record_round(spec.run_id, 0, {"round": 0, "loss": 1.0})
    assert not board.finish(spec.run_id, "succeeded", metrics={"test_accuracy": 1.0})
    assert not board.fail(spec.run_id, "boom") and not board.cancel(spec.run_id, "someone")
    assert not world.r.exists(layout.run_key(spec.run_id))


def test_a_task_of_a_run_whose_keys_were_deleted_writes_nothing(world):
    spec = submit(world)
    delete_run_keys(world.r, spec.run_id)
    shard(spec, 0, 0)                            # a message still queued when the keys went
    outer(spec, 0)
    assert run_keys(world.r, spec.run_id) == {}
    assert not world.store.exists(layout.key("shard", spec.run_id, 0, 0))


def test_status_and_resume_after_the_keys_were_deleted_mid_run(world):
    spec = submit(world)
    shard(spec, 0, 0)
    shard(spec, 0, 1)
    outer(spec, 0)                               # round 0 recorded, its manifest saved
    delete_run_keys(world.r, spec.run_id)
    # a task that was running then still writes its figures, and a stale counter of attempts
    world.r.hset(layout.run_key(spec.run_id), "progress_at", time.time())
    world.r.hset(layout.run_key(spec.run_id, "attempt_n"), "r1/shard-0", 99)

    doc = runs.describe(spec.run_id, world.broker, world.store_url)
    assert doc["state"] == "running" and f"tensorturn resume {spec.run_id}" in doc["note"]
    _, what = runs.resume(spec.run_id, world.broker, world.store_url)
    assert what.startswith("resumed at round 1")
    assert world.r.hget(layout.run_key(spec.run_id, "attempt_n"), "r1/shard-0") is None
    drive(spec, start=1)
    done = world.board.describe(spec.run_id)
    assert done["state"] == "succeeded" and [r["round"] for r in done["rounds"]] == [0, 1]


# ---- a finished run's keys expire; its record is in the store ------------------------------------

def test_a_finished_runs_keys_expire_and_the_store_answers_after(world):
    world.r.set(layout.PRUNE_LOCK, 1)            # pruned a moment ago: the finish alone does it
    spec = submit(world)
    drive(spec)
    keys = run_keys(world.r, spec.run_id)
    ttl = config.current().run_ttl_s
    assert len(keys) > 5 and all(ttl - 60 < t <= ttl for t in keys.values()), keys

    delete_run_keys(world.r, spec.run_id)        # as if the time had passed
    doc = runs.describe(spec.run_id, world.broker, world.store_url)
    assert doc["state"] == "succeeded" and "note" not in doc
    assert [m["run_id"] for m in runs.list_runs(world.broker, world.store_url)] == [spec.run_id]


def test_a_finished_record_behind_its_manifest_is_read_from_the_manifest(world):
    spec = submit(world)
    drive(spec)
    saved = manifest.read_manifest(world.store, spec.run_id)
    attempts = layout.run_key(spec.run_id, "attempts")
    # the board gone back in time: one attempt running again, the last one not begun yet
    first, *_, last = sorted(world.r.hkeys(attempts))
    entry = json.loads(world.r.hget(attempts, first))
    world.r.hset(attempts, first, json.dumps({**entry, "outcome": "running", "finished_at": None}))
    world.r.hdel(attempts, last)
    assert world.board.runs.state(spec.run_id) == "succeeded"

    doc = runs.describe(spec.run_id, world.broker, world.store_url)
    assert doc["attempts"] == saved["attempts"] and doc["state"] == "succeeded"
    assert not world.board.runs.exists(spec.run_id)  # the manifest is the run's record now
    assert manifest.read_manifest(world.store, spec.run_id) == saved


def test_a_failed_run_resumed_keeps_its_keys(world):
    spec = submit(world)
    shard(spec, 0, 0)
    world.board.fail(spec.run_id, "boom")
    assert all(t > 0 for t in run_keys(world.r, spec.run_id).values())
    runs.resume(spec.run_id, world.broker, world.store_url)
    assert set(run_keys(world.r, spec.run_id).values()) == {-1}


def test_a_replayed_start_of_a_run_the_broker_forgot_is_refused(world):
    spec = submit(world)
    drive(spec)
    theta0 = world.store.get_bytes(layout.key("global", spec.run_id, 0))
    saved = world.store.get_bytes(layout.key("manifest", spec.run_id))
    delete_run_keys(world.r, spec.run_id)        # its keys expired
    doc = spec.to_json()
    start_run.apply(args=(doc,), kwargs={"sig": pool_key().sign("submit", doc)}).get()
    _, [refused] = runs.refusals(world.broker)
    assert (refused["task"], refused["run_id"]) == ("tensorturn.start_run", spec.run_id)
    assert not world.board.runs.exists(spec.run_id)
    assert world.store.get_bytes(layout.key("global", spec.run_id, 0)) == theta0
    assert world.store.get_bytes(layout.key("manifest", spec.run_id)) == saved


# ---- leftovers are pruned -------------------------------------------------------------------------

def test_prune_forgets_agents_gone_and_expires_what_runs_left(world):
    r, now = world.r, time.time()
    finished = submit(world)
    drive(finished)                              # (its finish pruned once: the next is `--prune`'s)
    r.hset(layout.live_key(finished.run_id), "shard-0", "{}")  # a late report, after the finish
    lost = submit(world)
    delete_run_keys(r, lost.run_id)
    r.hincrby(layout.run_key(lost.run_id, "store_bytes"), "up", 1)  # written after the loss
    live = submit(world)
    r.zadd(layout.RUN_INDEX, {"expired-run": 1})
    older = submit(world)                        # finished before its keys were given an expiry
    drive(older)
    world.board.runs.persist(older.run_id)

    day = config.current().agent_ttl_s
    gone, here = "old@host", "new@host"
    r.hset(layout.worker_key(gone), mapping={"name": gone, "inventory": "{}", "last_seen": now - 2 * day})
    r.hset(layout.worker_key(here), mapping={"name": here, "inventory": "{}", "last_seen": now})
    for node in (gone, here, "orphan@host"):     # kombu's tables of each agent's own queue
        queue = layout.agent_queue(node)
        r.sadd(f"_kombu.binding.{queue}", f"{queue}\x06\x16\x06\x16{queue}")
        r.sadd(f"_kombu.binding_permanent.{queue}", f"{queue}\x06\x16\x06\x16{queue}")
        r.sadd("_kombu.binding.celery.pidbox", f"\x06\x16\x06\x16{node}.celery.pidbox")
    r.lpush(layout.agent_queue(gone), "a backup copy only it would take")
    assert [w["name"] for w in runs.workers(world.broker)] == [here]  # listed no longer

    done = runs.prune(world.broker)
    # (and this process's task reports, in a hash with no heartbeat: no agent's)
    assert {gone, "orphan@host"} <= set(done["agents_forgotten"]) and here not in done["agents_forgotten"]
    assert not r.exists(layout.worker_key(gone), layout.agent_queue(gone),
                        f"_kombu.binding.{layout.agent_queue(gone)}",
                        f"_kombu.binding_permanent.{layout.agent_queue('orphan@host')}")
    assert r.exists(f"_kombu.binding.{layout.agent_queue(here)}") and r.ttl(layout.worker_key(here)) > 0
    assert r.smembers("_kombu.binding.celery.pidbox") == {f"\x06\x16\x06\x16{here}.celery.pidbox"}
    assert all(t > 0 for t in run_keys(r, finished.run_id).values())
    assert all(t > 0 for t in run_keys(r, lost.run_id).values())
    assert set(run_keys(r, live.run_id).values()) == {-1}
    assert all(t > 0 for t in run_keys(r, older.run_id).values())
    assert "expired-run" not in r.zrange(layout.RUN_INDEX, 0, -1)
    assert done["runs_unlisted"] == 1


def test_a_run_whose_final_manifest_was_not_saved_keeps_its_keys(world, monkeypatch):
    spec = submit(world)
    shard(spec, 0, 0)
    real_put = world.store.put_json

    def store_down(key, doc):
        raise StoreError("store down")

    world.board.fail(spec.run_id, "boom")        # its keys expire, once the manifest is saved:
    monkeypatch.setattr(world.store, "put_json", store_down)
    manifest.try_write_manifest(world.store, world.board, spec.run_id)  # it was not
    assert set(run_keys(world.r, spec.run_id).values()) == {-1}
    runs.prune(world.broker)
    assert set(run_keys(world.r, spec.run_id).values()) == {-1}
    monkeypatch.setattr(world.store, "put_json", real_put)
    manifest.try_write_manifest(world.store, world.board, spec.run_id)  # the store is back
    assert all(t > 0 for t in run_keys(world.r, spec.run_id).values())
    assert not world.r.hexists(layout.run_key(spec.run_id), "kept")


def test_a_finishing_run_prunes_at_most_once_an_hour(world, monkeypatch):
    calls = []
    monkeypatch.setattr(housekeeping, "prune", lambda c: calls.append(1) or {})
    for _ in range(2):
        spec = submit(world)
        world.board.fail(spec.run_id, "boom")
    assert calls == [1] and 0 < world.r.ttl(layout.PRUNE_LOCK) <= housekeeping.PRUNE_EVERY_S


# ---- refusals are counted -------------------------------------------------------------------------

def test_a_flood_of_refusals_cannot_hide_how_many_there_were(world):
    for i in range(150):
        refuse(world.r, "w1@host", "tensorturn.fused.train_shard", f"run-{i}", "missing or bad signature")
    total, last = runs.refusals(world.broker)
    assert total == 150 and len(last) == 100 and last[0]["run_id"] == "run-149"
    proc = tt_here("workers", "--broker", world.broker)
    assert "150 task message(s) refused by the agents" in proc.stderr and "the last 100 kept" in proc.stderr


# ---- runs rm --------------------------------------------------------------------------------------

def test_runs_rm_deletes_a_finished_run_and_nothing_else(world):
    keep, spec = submit(world), submit(world)
    drive(spec)
    args = ("--broker", world.broker, "--store", world.store_url)
    refused = tt_here("runs", "rm", spec.run_id, *args)      # no terminal to ask on
    assert refused.returncode == 2 and "pass --yes" in refused.stderr
    assert world.store.exists(layout.key("manifest", spec.run_id))

    doc = json.loads(tt_here("runs", "rm", spec.run_id, "--yes", "--json", *args).stdout)
    assert doc["run_id"] == spec.run_id and doc["state"] == "succeeded" and doc["objects"] > 5
    assert doc["broker_keys"] > 5 and doc["bytes"] > 0
    assert world.store.list(f"runs/{spec.run_id}/") == [] and run_keys(world.r, spec.run_id) == {}
    assert spec.run_id not in world.r.zrange(layout.RUN_INDEX, 0, -1)
    assert world.store.exists(layout.key("manifest", keep.run_id)) and world.board.runs.exists(keep.run_id)

    gone = tt_here("runs", "rm", spec.run_id, "--yes", *args)
    assert gone.returncode == 2 and f"no run '{spec.run_id}'" in gone.stderr
    for bad in ("../etc", "*", "a/b"):
        proc = tt_here("runs", "rm", bad, "--yes", *args)
        assert proc.returncode == 2 and "is not a run id" in proc.stderr


def test_runs_rm_asks_first_on_a_terminal(world, monkeypatch):
    from click.testing import CliRunner

    from tensorturn.cli import cli, inspect

    spec = submit(world)
    world.board.cancel(spec.run_id, "test")
    monkeypatch.setattr(inspect, "can_ask", lambda: True)
    args = ["runs", "rm", spec.run_id, "--broker", world.broker, "--store", world.store_url]
    declined = CliRunner().invoke(cli, args, input="n\n")
    assert declined.exit_code == 1 and f"run {spec.run_id} not removed" in declined.output
    assert world.board.runs.exists(spec.run_id) and world.store.exists(layout.key("spec", spec.run_id))
    agreed = CliRunner().invoke(cli, args, input="y\n")
    assert agreed.exit_code == 0, agreed.output
    assert f"remove run {spec.run_id} (cancelled): " in agreed.output and "removed:" in agreed.output
    assert not world.board.runs.exists(spec.run_id) and world.store.list(f"runs/{spec.run_id}/") == []


def test_runs_rm_refuses_a_run_that_is_running_read_or_served(world):
    args = ("--broker", world.broker, "--store", world.store_url)
    live = submit(world)
    proc = tt_here("runs", "rm", live.run_id, "--yes", *args)
    assert proc.returncode == 2 and f"cancel it first (`tensorturn cancel {live.run_id}`)" in proc.stderr
    no_broker = tt_here("runs", "rm", live.run_id, "--yes", "--store", world.store_url)
    assert no_broker.returncode == 2 and "without its pool's broker" in no_broker.stderr
    delete_run_keys(world.board.r, live.run_id)  # as another pool's broker would answer: no record
    elsewhere = tt_here("runs", "rm", live.run_id, "--yes", *args)
    assert elsewhere.returncode == 2 and "the broker has no record of it (is it this run's pool?)" in elsewhere.stderr
    assert world.store.exists(layout.key("manifest", live.run_id))
    forced = tt_here("runs", "rm", live.run_id, "--yes", "--force", *args)
    assert forced.returncode == 0, forced.stderr
    assert world.store.list(f"runs/{live.run_id}/") == []

    done = submit(world)
    drive(done)
    reader = RunSpec.create(store_url=world.store_url, mode="ensemble", recipe="digits-mlp",
                            members=2, init_from=done.run_id)
    world.board.runs.create(reader)                   # a live ensemble that starts from its model
    proc = tt_here("runs", "rm", done.run_id, "--yes", *args)
    assert proc.returncode == 2 and f"read by run {reader.run_id}, still running" in proc.stderr
    world.board.cancel(reader.run_id, "test")

    with manifest.serving(world.store, done.run_id, "127.0.0.1:8000"):
        proc = tt_here("runs", "rm", done.run_id, "--yes", *args)
        assert proc.returncode == 2 and "is being served (127.0.0.1:8000" in proc.stderr
    assert world.store.exists(layout.key("manifest", done.run_id))
    assert tt_here("runs", "rm", done.run_id, "--yes", *args).returncode == 0


def test_a_stale_serving_mark_does_not_block_removal(world, monkeypatch):
    spec = submit(world)
    world.board.cancel(spec.run_id, "test")
    key = layout.key("serving", spec.run_id, "crashed-1-abc")
    world.store.put_json(key, {"where": "h:1", "host": "h", "pid": 1, "at": time.time()})
    assert manifest.servers(world.store, spec.run_id)  # fresh: served
    # a server killed without removing its mark stops refreshing it: the store last wrote it
    # longer ago than SERVING_STALE_S (its age is reckoned on the store's clock, not the mark's)
    old = time.time() - manifest.SERVING_STALE_S - 1
    os.utime(world.store._path(key), (old, old))
    assert manifest.servers(world.store, spec.run_id) == []
    assert runs.remove_run(spec.run_id, world.broker, world.store_url, lambda plan: True)


# ---- the same on a real pool ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_a_store_deletes_one_runs_folder_only(kind, tmp_path, request):
    url = (tmp_path / "store").as_uri() if kind == "file" else f"s3://{request.getfixturevalue('s3_bucket')}/pool"
    store = open_store(url)
    for key in ("runs/a/spec.json", "runs/a/r0000/shard-000.safetensors", "runs/ab/spec.json"):
        store.put_bytes(key, b"12345")
    assert store.sizes("runs/a/") == {"runs/a/r0000/shard-000.safetensors": 5, "runs/a/spec.json": 5}
    store.delete_folder("runs/a/")
    assert store.list("runs/") == ["runs/ab/spec.json"]
    with pytest.raises(StoreError, match="must end with /"):
        store.delete_folder("runs/a")
