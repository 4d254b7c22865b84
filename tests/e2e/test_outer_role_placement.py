"""Where outer steps and async updates run on real agents: beside the store, and on the trainers once it is gone."""

from __future__ import annotations

import json

import pytest
import redis
from conftest import run_to_end, submit_run, wait_for, wait_for_run

from tensorturn import layout, runs
from tensorturn.modes.fused.measured import outer_side
from tensorturn.pool import routing
from tensorturn.pool.embedded import stop_process_group

pytestmark = pytest.mark.long  # minutes of agents: scheduled first (conftest)


def runs_store_size(store_url: str, key: str) -> int:
    from tensorturn.store.objects import open_store

    return open_store(store_url).sizes(key)[key]


def outer_workers(doc: dict) -> set[str]:
    return {a["worker"] for a in doc["attempts"]
            if getattr(layout.parse_label(a["task"]), "kind", None) == "outer"}


def test_outer_steps_run_beside_the_store_and_move_to_the_trainers_when_it_is_gone(pool_factory):
    pool = pool_factory(3, roles=["train", "train", "outer"])
    store_url = pool.store_url
    fields = dict(recipe="digits-mlp", mode="fused", rounds=2, shards=2,
                  sync_every=5, codec="int8", seed=3)
    r = redis.Redis.from_url(pool.broker_url, decode_responses=True)
    wait_for(lambda: routing.queue_for_outer(r, "celery") == routing.outer_queue("celery"),
             "the outer agent to say it serves the outer queue")
    first = submit_run(pool, **fields)
    beside = wait_for_run(pool, first.run_id)
    assert beside["state"] == "succeeded", beside.get("error")
    assert {w.split("@")[0] for w in outer_workers(beside)} == {"local3"}
    # round 0's step (a steady one: the last has the run's end beside it) published its rate on
    # the agent that took it, and the next plan reads it there
    outer_agent = next(w for w in outer_workers(beside) if w.startswith("local3@"))
    rate = float(r.hget(layout.worker_key(outer_agent), "outer_s_unit"))
    side, said = outer_side(r)
    assert rate > 0 and side.s_unit == rate
    assert said == "the outer step's rate as measured on 1 of 1 agent(s) that take it"
    # round 0's evaluation went to the same agent, behind round 1's step: its time is the plan's too
    evaluated = json.loads(r.hget(layout.worker_key(outer_agent), "eval_s"))["digits-mlp"]
    side, said = outer_side(r, "digits-mlp")
    assert evaluated > 0 and side.eval_s == evaluated
    assert said.endswith(f"; a round's evaluation {evaluated:.1f} s there")
    shard_workers = {a["worker"].split("@")[0] for a in beside["attempts"]
                     if getattr(layout.parse_label(a["task"]), "kind", None) == "shard"}
    assert shard_workers <= {"local1", "local2"}
    # what each machine moved through the store is recorded with each attempt's outcome:
    # once no attempt runs, the per-machine figures add up to the run's
    def settled() -> dict | None:
        doc = runs.describe(first.run_id, pool.broker_url, store_url)
        return doc if all(a["outcome"] != "running" for a in doc["attempts"]) else None

    beside = wait_for(settled, "the last attempt's outcome")
    by = beside["store_bytes_by_worker"]
    assert sum(v["up"] for v in by.values()) == beside["store_bytes_up"]
    assert sum(v["down"] for v in by.values()) == beside["store_bytes_down"]
    trainers_up = sum(v["up"] for w, v in by.items() if not w.startswith("local3@"))
    assert trainers_up >= beside["bytes_up"] > 0  # their pseudo-gradients, at least
    outer_up = next(v["up"] for w, v in by.items() if w.startswith("local3@"))
    assert outer_up > 0  # θ, the outer state and the broadcasts: stored beside the store
    # the run was set up beside the store too: θ_0 went up from the outer agent, not a trainer
    theta0 = layout.key("global", first.run_id, 0)
    theta0_size = runs_store_size(store_url, theta0)
    assert outer_up >= theta0_size > 0 and trainers_up < beside["bytes_up"] + theta0_size

    # a clean stop mid-round: round 0's outer step was queued for the outer agent when the
    # round began and reaches its queue only after the agent withdrew — it must go on
    second = submit_run(pool, **fields)
    wait_for(lambda: any(a["task"].startswith("r0/") for a in
                         runs.describe(second.run_id, pool.broker_url, store_url)["attempts"]),
             "round 0 to begin")
    pool.agents[2].terminate()
    assert pool.agents[2].wait(timeout=120) is not None
    stopped = wait_for_run(pool, second.run_id)
    assert stopped["state"] == "succeeded", stopped.get("error")
    assert stopped["model_sha256"] == beside["model_sha256"]

    # the outer agent back, then dead without a word: its advertisement is still fresh, so
    # the next run's outer step is queued for it, and must reach the trainers all the same
    pool.start_agent(2)
    wait_for(lambda: routing.queue_for_outer(r, "celery") == routing.outer_queue("celery"),
             "the restarted outer agent to serve the outer queue")
    stop_process_group(pool.agents[2], grace=0, term=False)
    killed = run_to_end(pool, **fields)
    assert killed["state"] == "succeeded", killed.get("error")
    assert {w.split("@")[0] for w in outer_workers(killed)} <= {"local1", "local2"}
    assert killed["model_sha256"] == beside["model_sha256"]


def test_an_async_runs_updates_are_applied_beside_the_store(pool_factory):
    """``--sync async`` with an agent beside the store: it applies every update (θ and the
    outer state stay on its machine); the trainers only train."""
    from tensorturn.modes.fused.async_versions import ledger
    from tensorturn.state.board import RunBoard

    pool = pool_factory(3, roles=["train", "train", "outer"])
    r = redis.Redis.from_url(pool.broker_url, decode_responses=True)
    wait_for(lambda: routing.queue_for_outer(r, "celery") == routing.outer_queue("celery"),
             "the outer agent to say it serves the outer queue")
    spec = submit_run(pool, recipe="digits-mlp", mode="fused", sync="async", rounds=2, shards=3,
                      sync_every=20, seed=3)
    doc = wait_for_run(pool, spec.run_id)
    assert doc["state"] == "succeeded", doc.get("error")
    records = ledger(RunBoard(r), spec.run_id).applied()
    assert [rec["version"] for rec in records] == list(range(1, 7))
    assert {rec["applied_by"].split("@")[0] for rec in records} == {"local3"}
    assert {rec["trained_by"].split("@")[0] for rec in records} <= {"local1", "local2"}
