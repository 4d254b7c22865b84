"""The agent where it does not fork: the core end-to-end cases with `--pool threads`,
on Linux as on Windows and macOS — a fused run, a killed agent's task requeued, a duplicate
delivery ignored, and a stop that hands the running task back — each giving the undisturbed
run's model, bit for bit."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
import redis
from conftest import run_to_end, start_pool, submit_run, wait_for, wait_for_run

from tensorturn import layout
from tensorturn.modes.fused.driver import train_slot
from tensorturn.state.board import RunBoard
from tensorturn.state.roster import list_workers
from tensorturn.tasks.attempt import signed

pytestmark = [pytest.mark.e2e, pytest.mark.long]

SPEC = dict(mode="fused", recipe="digits-mlp", rounds=2, shards=3, sync_every=40)
STEP_S = 0.05  # each shard trains 2 s: long enough to be hit mid-task


@pytest.fixture(scope="module")
def threads_pool(tmp_path_factory):
    pool = start_pool(tmp_path_factory.mktemp("threads"), 2, step_s=STEP_S, loglevel="INFO",
                      env={"TENSORTURN_AGENT_POOL": "threads", "TENSORTURN_VISIBILITY_TIMEOUT_S": "4"})
    yield pool
    pool.stop(grace=1.0)


@pytest.fixture
def pool(threads_pool):
    """The module's pool with both agents running."""
    for i, proc in enumerate(threads_pool.agents):
        if proc.poll() is not None:
            threads_pool.start_agent(i)
    threads_pool.wait_ready()
    yield threads_pool


@pytest.fixture(scope="module")
def reference(threads_pool):
    doc = run_to_end(threads_pool, **SPEC)
    assert doc["state"] == "succeeded" and not doc["incidents"]
    return doc


def board(pool) -> RunBoard:
    return RunBoard(redis.Redis.from_url(pool.broker_url, decode_responses=True))


def running_shard(pool, run_id: str) -> dict:
    return wait_for(lambda: next((a for a in board(pool).attempts.all(run_id)
                                  if a["outcome"] == "running" and "/shard-" in a["task"]), None),
                    "a shard to be training")


def same_model(doc: dict, reference: dict) -> None:
    assert doc["state"] == "succeeded", doc.get("error")
    assert doc["model_sha256"] == reference["model_sha256"]
    assert doc["bytes_up"] == reference["bytes_up"]  # nothing counted twice


def agent_of(pool, attempt: dict) -> int:
    return int(attempt["worker"].split("@")[0].removeprefix("local")) - 1


def test_the_agents_run_their_tasks_on_threads(pool, reference):
    """No pool process: the agent's own process trains (and says which pool it runs)."""
    for proc in pool.agents:
        assert psutil.Process(proc.pid).children(recursive=True) == []
    client = redis.Redis.from_url(pool.broker_url, decode_responses=True)
    assert {w["pool"] for w in list_workers(client)} == {"threads"}
    assert reference["rounds"] and reference["model_sha256"]


def test_a_killed_agents_task_is_requeued(pool, reference):
    spec = submit_run(pool, **SPEC)
    victim = running_shard(pool, spec.run_id)
    os.kill(pool.agents[agent_of(pool, victim)].pid, signal.SIGKILL)
    doc = wait_for_run(pool, spec.run_id)
    same_model(doc, reference)
    assert any(i["kind"] == "requeued" and i["task"] == victim["task"] for i in doc["incidents"])


def test_a_stop_hands_the_running_task_back(pool, reference):
    """SIGTERM: after its grace the agent asks the running task to stop (a thread cannot be
    killed), and the task hands itself back at its next step — at no cost to the run."""
    spec = submit_run(pool, **SPEC, max_attempts=1)
    victim = running_shard(pool, spec.run_id)
    proc = pool.agents[agent_of(pool, victim)]
    proc.terminate()
    assert proc.wait(timeout=120) is not None
    doc = wait_for_run(pool, spec.run_id)
    same_model(doc, reference)
    tries = [a for a in doc["attempts"] if a["task"] == victim["task"]]
    assert tries[0]["outcome"].startswith("handed back: its agent is stopping")
    assert tries[-1]["outcome"] == "succeeded" and tries[-1]["worker"] != victim["worker"]


def test_a_duplicate_delivery_is_ignored(pool, reference):
    spec = submit_run(pool, **SPEC)
    wait_for(lambda: any(a["task"] == "r0/outer" and a["outcome"] == "succeeded"
                         for a in board(pool).attempts.all(spec.run_id)), "round 0 stepped")
    train_slot.apply_async(args=(spec.run_id, 0, 1), kwargs=signed(spec.run_id, "r0/slot-1"))
    doc = wait_for_run(pool, spec.run_id)
    same_model(doc, reference)
    bound = board(pool).r.hget(layout.run_key(spec.run_id, "slots-r0"), "1")
    assert [i["task"] for i in doc["incidents"] if i["kind"] == "duplicate_ignored"] == [f"r0/shard-{bound}"]
