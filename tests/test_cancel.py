"""`tensorturn cancel` on a standing pool: the run ends `cancelled`, its queued tasks are dropped,
its running attempts stop and store nothing, no attempt starts afterwards, and `resume` continues
it to the model an uncancelled run gives."""

from __future__ import annotations

import json

import pytest
import redis
from conftest import queued_messages, tt, tt_json, wait_for

from tensorturn import runs
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import check_broker
from tensorturn.tasks.attempt import CANCELLED

pytestmark = pytest.mark.long  # minutes of agents: scheduled first (conftest)


@pytest.mark.e2e
def test_cancel_stops_a_run_on_a_standing_pool_and_resume_continues_it(tmp_path, pool_factory):
    # every training step lasts 20 ms on the agents: a shard of 400 steps trains for 8 s however
    # loaded the machine is, so the cancel lands while both agents train
    pool, store = pool_factory(step_s=0.02), tmp_path / "store"
    doc = tt_json("run", "--broker", pool.broker_url, "--store", str(store), "--recipe",
                  "digits-mlp", "--rounds", "1", "--shards", "4", "--sync-every", "400",
                  "--detach", "--json")
    run_id = doc["run_id"]
    board = RunBoard(check_broker(pool.broker_url))
    wait_for(lambda: len([a for a in board.attempts(run_id) if a["outcome"] == "running"]) == 2,
             "both agents training a shard")

    proc = tt("cancel", run_id, "--broker", pool.broker_url, "--store", str(store), "--json")
    assert proc.returncode == 0, proc.stderr
    cancelled = json.loads(proc.stdout)
    assert cancelled["state"] == "cancelled" and "tensorturn cancel" in cancelled["cancelled"]["by"]
    assert f"run {run_id} cancelled; 2 queued tasks dropped" in proc.stderr
    # the two running attempts stopped at their next look, recorded as cancelled
    attempts = board.attempts(run_id)
    assert [a["outcome"] for a in attempts] == [CANCELLED, CANCELLED]
    assert not list((store / "runs" / run_id).glob("r0000/shard-*"))  # nothing stored

    r = redis.Redis.from_url(pool.broker_url)
    wait_for(lambda: r.hlen("unacked") == 0 and all(
        w["state"] == "idle" for w in runs.workers(pool.broker_url)), "the agents idle")
    assert not [m for m in queued_messages(r) if run_id.encode() in m]
    assert board.attempts(run_id) == attempts  # no attempt started after the cancel

    status = tt("status", run_id, "--broker", pool.broker_url, "--store", str(store))
    assert status.returncode == 0, status.stderr
    assert f"run {run_id}: cancelled" in status.stdout and "cancelled at" in status.stdout
    saved = json.loads((store / "runs" / run_id / "manifest.json").read_text())
    assert saved["state"] == "cancelled"

    again = tt("cancel", run_id, "--broker", pool.broker_url, "--store", str(store))
    assert again.returncode == 0 and "was cancelled already" in again.stderr

    resumed = tt_json("resume", run_id, "--broker", pool.broker_url, "--store", str(store),
                      "--json")
    assert resumed["state"] == "succeeded" and len(resumed["rounds"]) == 1
    assert "cancelled" not in resumed

    done = tt("cancel", run_id, "--broker", pool.broker_url, "--store", str(store))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "has succeeded: there is nothing to cancel" in done.stderr


def test_cancel_refuses_a_run_the_broker_does_not_know(redis_server, tmp_path):
    proc = tt("cancel", "20990101-000000-abcdef", "--broker", redis_server.url,
              "--store", str(tmp_path / "store"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "no run '20990101-000000-abcdef' on this broker" in proc.stderr


def test_cancel_without_a_pool_says_what_it_needs(tmp_path):
    proc = tt("cancel", "20990101-000000-abcdef", "--store", str(tmp_path / "store"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--join-file" in proc.stderr
