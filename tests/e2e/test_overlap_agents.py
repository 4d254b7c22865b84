"""Overlapped runs on real agents give one model on 1 and 3 agents, with one killed."""

from __future__ import annotations

import os
import signal

import pytest
import redis
from conftest import run_to_end, submit_run, wait_for, wait_for_run

from tensorturn.state.board import RunBoard

SPEC = dict(mode="fused", recipe="digits-mlp", sync="overlap", rounds=3, shards=3, sync_every=150,
            threads_per_task=1)


@pytest.mark.long
def test_overlapped_runs_give_one_model_on_1_and_3_agents_with_one_killed(pool_factory):
    """The same overlapped run on one agent, and on three of which the one training a shard of
    round 1 is killed: the same model, bit for bit (its task comes back after the 4 s lease and
    trains again from the same θ_0 with the same seed)."""
    env = {"TENSORTURN_VISIBILITY_TIMEOUT_S": "4"}
    one = pool_factory(1, step_s=0.01, env=env)
    alone = run_to_end(one, **SPEC)
    assert alone["state"] == "succeeded", alone.get("error")
    one.stop(grace=1.0)
    three = pool_factory(3, step_s=0.01, env=env)
    spec = submit_run(three, **SPEC)
    board = RunBoard(redis.Redis.from_url(three.broker_url, decode_responses=True))

    def training_in_round_1() -> dict | None:
        assert board.runs.state(spec.run_id) not in ("succeeded", "failed"), "no round-1 shard was caught"
        running = [a for a in board.attempts.all(spec.run_id)
                   if a["task"].startswith("r1/") and a["outcome"] == "running"]
        return running[0] if running else None

    victim = wait_for(training_in_round_1, "a round-1 shard training", pause=0.05)
    os.killpg(three.agents[int(victim["worker"].split("@")[0].removeprefix("local")) - 1].pid, signal.SIGKILL)
    doc = wait_for_run(three, spec.run_id)
    assert doc["state"] == "succeeded", doc.get("error")
    assert doc["model_sha256"] == alone["model_sha256"]
    tries = [a for a in doc["attempts"] if a["task"] == victim["task"]]
    # lost with its agent; trained again (by its redelivered slot, or as a named shard when the
    # shard's next round found its output missing), stored once
    assert tries[0]["outcome"].startswith("lost")
    assert [t["outcome"] for t in tries].count("succeeded") == 1
    assert [r["round"] for r in doc["rounds"]] == list(range(SPEC["rounds"]))
