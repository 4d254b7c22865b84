"""`run` shows progress inside rounds, and its JSON is complete when printed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import clean_env, tt, wait_for

from tensorturn import layout
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import redis_client


@pytest.fixture
def board(redis_server):
    return RunBoard(redis_client(redis_server.url))



def test_run_shows_progress_inside_rounds_and_json_is_complete_when_printed(tmp_path, pool_factory):

    # every training step lasts 10 ms on the agents: a shard of 150 steps takes 1.5 s, long
    # enough to be seen inside its round however loaded the machine is
    pool, store = pool_factory(step_s=0.01), tmp_path / "store"
    board = RunBoard(redis_client(pool.broker_url))
    args = ("run", "--broker", pool.broker_url, "--store", str(store), "--recipe", "digits-mlp",
            "--rounds", "3", "--shards", "4", "--sync-every", "150")
    proc = subprocess.Popen([sys.executable, "-m", "tensorturn", *args], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    try:
        run_id = wait_for(lambda: next(iter(board.r.zrange(layout.RUN_INDEX, 0, -1)), None), "the run")
        seen = wait_for(lambda: (d := board.describe(run_id)).get("in_round")
                        and 0 < d["in_round"]["steps_done"] < d["in_round"]["steps_total"]
                        and d["in_round"], "steps inside a round")
        assert seen["shards"] == 4 and seen["steps_total"] == 600
        out, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    lines = err.splitlines()
    rounds = [line.split()[1] for line in lines if line.startswith("round ")]
    assert rounds == ["0", "1", "2"]
    assert any(line.startswith("  round ") and " steps" in line for line in lines), err
    assert all(len(line) <= 80 for line in lines if line.startswith("  round "))

    # `run --json` on the standing pool: complete when printed, a few times over
    for seed in range(3):
        done = tt(*args[:-6], "--rounds", "2", "--shards", "2", "--sync-every", "5",
                  "--seed", str(seed), "--json")
        assert done.returncode == 0, done.stderr[-3000:]
        doc = json.loads(done.stdout)
        assert not [a for a in doc["attempts"] if a["outcome"] == "running"], doc["attempts"]
        later = board.describe(doc["run_id"])
        for field in ("state", "attempts", "store_bytes_up", "store_bytes_down",
                      "store_bytes_by_worker", "bytes_up", "bytes_down"):
            assert doc[field] == later[field], field
