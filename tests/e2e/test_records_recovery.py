"""A run's records on the broker deleted, rolled back or rewritten under real agents: one line and a
resume, rebuilt from the manifest, the same model; `runs rm` of a run being served."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis
from conftest import clean_env, queued_messages, tt, tt_json, wait_for

from tensorturn import layout, runs
from tensorturn.state import manifest
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import check_broker
from tensorturn.store.objects import open_store


def run_keys(r, run_id: str) -> dict[str, int]:
    """Every key of the run on the broker, with its time to live (-1: none)."""
    keys = [layout.run_key(run_id), *r.scan_iter(match=layout.run_keys_pattern(run_id))]
    return {k: r.ttl(k) for k in keys if r.exists(k)}



def delete_run_keys(r, run_id: str) -> None:
    """What someone with the Redis password does: `DEL tt:run:<id>*`, the queues left alone."""
    r.delete(*run_keys(r, run_id))



pytestmark = pytest.mark.long  # minutes of agents: scheduled first (conftest)


def training_round_1(tmp_path, pool_factory, sync_every: int):
    """A 3-round run on a pool of 3 agents, detached, once round 0 is recorded and round 1 trains:
    (pool, store folder, the CLI's pool arguments, run id, its board). Each training step lasts
    10 ms on the agents, so a round's shards train for seconds however loaded the machine is."""
    pool, store = pool_factory(agents=3, step_s=0.01), tmp_path / "store"
    args = ("--broker", pool.broker_url, "--store", str(store))
    run_id = tt_json("run", *args, "--recipe", "digits-mlp", "--rounds", "3", "--shards", "2",
                     "--sync-every", str(sync_every), "--detach", "--json")["run_id"]
    board = RunBoard(check_broker(pool.broker_url))
    wait_for(lambda: board.rounds.has(run_id, 0) and any(
        a["task"].startswith("r1/") and a["outcome"] == "running" for a in board.attempts.all(run_id)),
        "round 1 training")
    return pool, store, args, run_id, board


def test_deleting_a_runs_keys_mid_run_ends_in_one_line_and_a_resume(tmp_path, pool_factory):
    # each training step lasts 10 ms on the agents: a round's shards train ~2 s however loaded
    # the machine is, so the keys go while round 1 trains (the third agent evaluates round 0)
    pool, store, args, run_id, board = training_round_1(tmp_path, pool_factory, sync_every=200)
    r = board.r
    delete_run_keys(r, run_id)

    # what was running ends, what was queued is taken and does nothing; no record comes back
    wait_for(lambda: r.hlen("unacked") == 0 and not queued_messages(r) and all(
        w["state"] == "idle" for w in runs.workers(pool.broker_url)), "the agents idle")
    assert not r.exists(layout.run_key(run_id))
    status = tt("status", run_id, *args)
    assert status.returncode == 0 and status.stdout.splitlines()[0] == f"run {run_id}: running"
    assert status.stderr.strip().splitlines() == [
        f"warning: the last saved state is 'running', but the broker has no record of the run "
        f"(Redis lost its data, or its keys were deleted?); continue it with `tensorturn "
        f"resume {run_id}`"]

    resumed = tt_json("resume", run_id, *args, "--json")
    assert resumed["state"] == "succeeded" and [x["round"] for x in resumed["rounds"]] == [0, 1, 2]
    saved = json.loads((store / "runs" / run_id / "manifest.json").read_text())
    assert saved["state"] == "succeeded"


def test_a_finished_runs_record_rolled_back_on_the_broker_is_rebuilt_from_its_manifest(tmp_path, pool_factory):
    # Redis restarted from an AOF seconds old: the run's keys, the queues and the leases go back
    # to round 1 training, after the run succeeded. Its messages come back and find their work
    # done; the record must end as the store's signed manifest has it — not with attempts
    # `running` forever and the later ones missing, nor a manifest saved from the stale record.
    pool, store, args, run_id, board = training_round_1(tmp_path, pool_factory, sync_every=100)
    r = board.r
    old = {k: (r.dump(k), r.pttl(k)) for k in r.scan_iter()}   # what the old AOF holds
    assert runs.wait(pool.broker_url, run_id)["state"] == "succeeded"
    saved = json.loads((store / "runs" / run_id / "manifest.json").read_text())

    r.flushall()                                              # the restart from it
    raw = redis.Redis.from_url(pool.broker_url)               # DUMP's bytes: no decoding
    for k, (value, ttl) in old.items():
        if value is not None:
            raw.restore(k, max(ttl, 0), value, replace=True)
    wait_for(lambda: r.hlen("unacked") == 0 and not queued_messages(r) and all(
        w["state"] == "idle" for w in runs.workers(pool.broker_url)), "the old messages done")

    doc = runs.describe(run_id, pool.broker_url, store.as_uri())
    assert doc["state"] == "succeeded" and [x["round"] for x in doc["rounds"]] == [0, 1, 2]
    assert not [a for a in doc["attempts"] if a["outcome"] == "running"], doc["attempts"]
    key = {(a["task"], a["attempt"]) for a in saved["attempts"]}
    assert {(a["task"], a["attempt"]) for a in doc["attempts"]} == key
    assert json.loads((store / "runs" / run_id / "manifest.json").read_text())["attempts"] == saved["attempts"]
    assert tt_json("status", run_id, *args, "--json")["attempts"] == doc["attempts"]


def test_a_runs_state_rewritten_on_the_broker_is_recovered_by_resume_to_the_same_model(tmp_path, pool_factory):
    # A run's state on the broker is not signed: with the Redis password alone it can be set to
    # failed, cancelled or succeeded mid-run, which stops the run (its tasks see it finished).
    # `resume` continues it from the store to exactly the model of a run left alone.
    pool, store = pool_factory(agents=3, step_s=0.01), tmp_path / "store"
    args = ("--broker", pool.broker_url, "--store", str(store))
    run = ("run", *args, "--recipe", "digits-mlp", "--rounds", "3", "--shards", "2", "--sync-every", "100")
    undisturbed = tt_json(*run, "--json")
    board = RunBoard(check_broker(pool.broker_url))
    r = board.r
    for state in ("failed", "cancelled", "succeeded"):
        run_id = tt_json(*run, "--detach", "--json")["run_id"]
        wait_for(lambda run_id=run_id: board.rounds.has(run_id, 0) and any(
            a["task"].startswith("r1/") and a["outcome"] == "running" for a in board.attempts.all(run_id)),
            "round 1 training")
        r.hset(layout.run_key(run_id), mapping={"state": state, "error": "forged"})
        wait_for(lambda: r.hlen("unacked") == 0 and not queued_messages(r) and all(
            w["state"] == "idle" for w in runs.workers(pool.broker_url)), "the run stopped")
        assert json.loads(tt("status", run_id, *args, "--json").stdout)["state"] == state
        assert json.loads((store / "runs" / run_id / "manifest.json").read_text())["state"] != "succeeded"

        resumed = tt_json("resume", run_id, *args, "--json")
        assert resumed["state"] == "succeeded" and [x["round"] for x in resumed["rounds"]] == [0, 1, 2]
        assert resumed["model_sha256"] == undisturbed["model_sha256"], state
    done = tt("resume", undisturbed["run_id"], *args)  # its signed manifest says so: nothing to do
    assert done.returncode == 2 and done.stderr.strip().endswith("already succeeded; nothing to resume")


def test_runs_rm_refuses_a_run_tensorturn_serve_serves(tmp_path):
    from tensorturn.pool.embedded import free_port, stop_process_group

    store, uri = str(tmp_path / "store"), (tmp_path / "store").as_uri()
    done = tt_json("run", "--recipe", "digits-mlp", "--rounds", "1", "--local-workers", "1",
                   "--store", store, "--json", cwd=tmp_path)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorturn", "serve", done["run_id"], "--store",
                               store, "--port", str(port)], env=clean_env(), cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: manifest.servers(open_store(uri), done["run_id"]), "the server's mark")
        proc = tt("runs", "rm", done["run_id"], "--yes", "--store", store)
        assert proc.returncode == 2 and f"is being served (127.0.0.1:{port}" in proc.stderr
    finally:
        stop_process_group(server, grace=10)
    assert manifest.servers(open_store(uri), done["run_id"]) == []  # a clean stop removes its mark
    proc = tt("runs", "rm", done["run_id"], "--yes", "--store", store)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "store" / "runs" / done["run_id"]).exists()
