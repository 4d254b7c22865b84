"""`cancel` and `resume` of a run on a standing pool of real agents: it stops, continues, and shows
its earlier rounds at once."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from conftest import clean_env, queued_messages, tt, tt_json, wait_for

from tensorturn import runs
from tensorturn.dashboard import view
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import check_broker
from tensorturn.tasks.attempt import CANCELLED

pytestmark = pytest.mark.long  # minutes of agents: scheduled first (conftest)


def test_cancel_stops_a_run_on_a_standing_pool_and_resume_continues_it(tmp_path, pool_factory):
    # every training step lasts 20 ms on the agents: a shard of 400 steps trains for 8 s however
    # loaded the machine is, so the cancel lands while both agents train
    pool, store = pool_factory(step_s=0.02), tmp_path / "store"
    doc = tt_json("run", "--broker", pool.broker_url, "--store", str(store), "--recipe",
                  "digits-mlp", "--rounds", "1", "--shards", "4", "--sync-every", "400",
                  "--detach", "--json")
    run_id = doc["run_id"]
    board = RunBoard(check_broker(pool.broker_url))
    wait_for(lambda: len([a for a in board.attempts.all(run_id) if a["outcome"] == "running"]) == 2,
             "both agents training a shard")

    proc = tt("cancel", run_id, "--broker", pool.broker_url, "--store", str(store), "--json")
    assert proc.returncode == 0, proc.stderr
    cancelled = json.loads(proc.stdout)
    assert cancelled["state"] == "cancelled" and "tensorturn cancel" in cancelled["cancelled"]["by"]
    assert f"run {run_id} cancelled; 2 queued tasks dropped" in proc.stderr
    # the two running attempts stopped at their next look, recorded as cancelled
    attempts = board.attempts.all(run_id)
    assert [a["outcome"] for a in attempts] == [CANCELLED, CANCELLED]
    assert not list((store / "runs" / run_id).glob("r0000/shard-*"))  # nothing stored

    r = redis.Redis.from_url(pool.broker_url)
    wait_for(lambda: r.hlen("unacked") == 0 and all(
        w["state"] == "idle" for w in runs.workers(pool.broker_url)), "the agents idle")
    assert not [m for m in queued_messages(r) if run_id.encode() in m]
    assert board.attempts.all(run_id) == attempts  # no attempt started after the cancel

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


def test_a_resumed_run_shows_its_earlier_rounds_at_once_in_order_with_their_times(tmp_path, pool_factory):
    # one agent, every step 20 ms: round 2's first shard trains for 4 s when the run is
    # cancelled, and round 1's evaluation waits behind it in the queue (dropped by the cancel)
    store, gate = tmp_path / "store", tmp_path / "gate"
    pool = pool_factory(agents=1, step_s=0.02, env={"TT_GATE": str(gate), "TENSORTURN_QUICK_END_S": "0"})
    run_id = tt_json("run", "--broker", pool.broker_url, "--store", str(store), "--recipe", "gated:Gated",
                     "--rounds", "4", "--shards", "2", "--sync-every", "200", "--detach", "--json")["run_id"]
    board = RunBoard(check_broker(pool.broker_url))
    wait_for(lambda: [a for a in board.attempts.all(run_id)
                      if a["task"].startswith("r2/") and a["outcome"] == "running"],
             "round 2 training")
    runs.cancel(run_id, pool.broker_url, store.as_uri(), by="test")
    before = board.rounds.all(run_id)
    assert [r["round"] for r in before] == [0]  # round 1's evaluation never ran

    # resumed, the run's shards wait at the gate: it is still running while it is looked at
    gate.write_text("{}")
    log = tmp_path / "resume.err"
    with log.open("w") as err:
        resume = subprocess.Popen([sys.executable, "-m", "tensorturn", "resume", run_id, "--broker",
                                   pool.broker_url, "--store", str(store)], env=clean_env(),
                                  stdout=subprocess.PIPE, stderr=err, text=True, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: "round 1 (2 of 4)" in log.read_text(), "resume printing round 1")
        status = tt_json("status", run_id, "--broker", pool.broker_url, "--store", str(store), "--json")
        dashboard = view.run_view(run_id, pool.broker_url, store.as_uri())
        report = tt("report", run_id, "--broker", pool.broker_url, "--store", str(store),
                    "--out", str(tmp_path / "report"))
        assert report.returncode == 0, report.stderr
        assert status["state"] == dashboard["state"] == "running"
        for rounds in (status["rounds"], dashboard["rounds"]):
            assert [r["round"] for r in rounds] == [0, 1]
            assert rounds[0]["at"] == before[0]["at"] and rounds[0]["at"] < rounds[1]["at"]
        assert table_rounds(tmp_path / "report" / "report.html") == ["0", "1"]
        printed = [line.split()[1] for line in log.read_text().splitlines() if line.startswith("round ")]
        assert printed == ["0", "1"]
        gate.unlink()
        assert resume.wait(timeout=600) == 0, log.read_text()
    finally:
        gate.unlink(missing_ok=True)
        if resume.poll() is None:
            resume.kill()
            resume.wait()
    printed = [line.split()[1] for line in log.read_text().splitlines() if line.startswith("round ")]
    assert printed == ["0", "1", "2", "3"]
    done = tt_json("status", run_id, "--broker", pool.broker_url, "--store", str(store), "--json")
    assert done["state"] == "succeeded" and done["rounds"][0] == before[0]
    times = [r["at"] for r in done["rounds"]]
    assert [r["round"] for r in done["rounds"]] == [0, 1, 2, 3] and times == sorted(times)


def table_rounds(page: Path) -> list[str]:
    """The round numbers of a report page's rounds table, in its order."""
    section = page.read_text().split('<section id="rounds">', 1)[1].split("</section>", 1)[0]
    return re.findall(r'<tr><td class="n">(\d+)</td>', section)
