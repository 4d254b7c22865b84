"""`run --plan-only` on a pool of real agents: the plan is made from what the agents publish in
their heartbeats — their links to the store (capped by their owners) and their step times — and
says why. gpt2-small (85.5M values) behind 20 Mbit/s uplinks gets a compressed codec and
overlapped rounds at a predicted utilisation ≥ 0.9; on loopback, whole precision (blocking or
overlapped rounds as the measured loopback says: a CPU's store moves 50-500 MB/s)."""

from __future__ import annotations

import json

import pytest
import redis
from conftest import assert_clean_error, clean_env, tt, tt_here, tt_here_json, tt_json_many, wait_for

from tensorturn import layout
from tensorturn.pool import routing
from tensorturn.state.roster import list_workers

pytestmark = pytest.mark.e2e

MBIT = 1e6 / 8  # bytes/s


def publish(r: redis.Redis, agent: str, **fields: str) -> None:
    """Write figures into an agent's heartbeat hash, after its first beat (which starts it afresh)."""
    key = next(k for k in r.scan_iter(layout.worker_key(agent + "@*")))
    r.hset(key, mapping=fields)


def standing(r: redis.Redis, agent: str) -> dict:
    """An agent's entry in the pool's list of workers (what `tensorturn workers` shows)."""
    return next(w for w in list_workers(r) if w["name"].startswith(agent + "@"))


def plan_of(pool, *args: str) -> dict:
    return tt_here_json("run", "--recipe", "gpt2-small", "--broker", pool.broker_url, "--store",
                        pool.store_url, "--plan-only", "--json", *args)["plan"]


def test_a_pool_capped_at_20_mbit_gets_a_compressed_codec_and_overlapped_rounds(pool_factory):
    pool = pool_factory(4, roles=["train", "train", "train", "outer"])
    r = redis.Redis.from_url(pool.broker_url, decode_responses=True)
    wait_for(lambda: routing.queue_for_outer(r, "celery") == routing.outer_queue("celery"),
             "the outer agent to say it serves the outer queue")
    trainers = ("local1", "local2", "local3")
    wait_for(lambda: all(standing(r, a)["link_up_bps"] for a in trainers), "the trainers to measure their links")
    # each trainer has stepped gpt2-small in 1 s (a GPU-class step, as BENCHMARKS §13b assumes:
    # a CPU step of this model here takes tens of seconds), so no step is timed here
    for agent in trainers:
        publish(r, agent, step_s=json.dumps({"gpt2-small": 1.0}))
    loopback = plan_of(pool)
    assert loopback["codec"] in ("fp32", "int8") and loopback["broadcast_codec"] in ("fp32", "int8")
    assert loopback["outer_role"] == "store" and not any("links not measured" in w for w in loopback["why"])
    # blocking rounds or overlapped by the measured loopback: this store's fsynced objects go at
    # 50-500 MB/s here (the agents' own probe), 1-7 s of fp32 a round against 25 s of compute
    # (tests/unit/test_plan.py: at 1 GB/s, blocking rounds)
    assert loopback["sync"] in ("rounds", "overlap") and loopback["predicted_utilisation"] >= 0.9

    # each owner caps the uploads at 20 Mbit/s (the household's video call), as a user would
    for agent in trainers:
        out = tt("rules", agent, "--max-upload-mbit", "20", env=clean_env(TENSORTURN_BROKER_URL=pool.broker_url))
        assert out.returncode == 0, out.stderr
    wait_for(lambda: all(standing(r, a)["cap_up_bps"] == 20 * MBIT for a in trainers),
             "the caps in the trainers' heartbeats")
    capped = plan_of(pool)
    assert capped["codec"] != "fp32" and capped["sync"] == "overlap"
    assert capped["predicted_utilisation"] >= 0.9
    assert set(capped) == {"codec", "broadcast_codec", "sync", "sync_every", "shards", "outer_role",
                           "predicted_utilisation", "round_s", "bytes_per_round", "why"}
    assert not any("links not measured" in w for w in capped["why"])
    # the user's options win
    given = plan_of(pool, "--codec", "fp32", "--sync-every", "30")
    assert (given["codec"], given["sync_every"]) == ("fp32", 30)
    assert given["predicted_utilisation"] < capped["predicted_utilisation"]


def test_plan_only_is_refused_for_what_has_no_plan(tmp_path):
    for args, says in [(("--mode", "ensemble"), "--plan-only shows a fused run's plan; --mode ensemble has none"),
                       (("--plan", "off"), "--plan-only shows what --plan auto chooses: drop --plan off")]:
        proc = tt_here("run", "--recipe", "digits-mlp", "--store", str(tmp_path / "store"), "--plan-only", *args)
        assert says in assert_clean_error(proc, 2)


def test_resume_replan_plans_h_again_from_todays_step_times_and_says_so(tmp_path, pool_factory):
    # every step lasts 0.2 s on the agents (θ_0's timed steps too): a round of 25 steps is a small
    # model's 5 s, so the run starts with the data's H; cancelled, its machines then say they step
    # digits in 0.4 s: 10 s a round at H 25, no longer small, and a round's fixed costs (its
    # dispatch, each task's start and round trips: ≈ 1.3 s) keep it under a utilisation of 0.9 —
    # the plan made again raises H (a heartbeat's links are signed: the step times are not)
    pool, store = pool_factory(step_s=0.2), str(tmp_path / "store")
    doc = tt_here_json("run", "--broker", pool.broker_url, "--store", store, "--recipe", "digits-mlp",
                       "--rounds", "1", "--shards", "2", "--detach", "--json")
    run_id = doc["run_id"]
    assert doc["spec"]["options"]["sync_every"] == 25 and doc["spec"]["options"]["planned"]["sync_every"] == 25

    def attempts() -> list[dict]:
        return tt_here_json("status", run_id, "--broker", pool.broker_url, "--store", store, "--json")["attempts"]

    r = redis.Redis.from_url(pool.broker_url, decode_responses=True)
    wait_for(lambda: any(a["outcome"] == "running" for a in attempts()), "a shard training")
    assert tt_here("cancel", run_id, "--broker", pool.broker_url, "--store", store).returncode == 0
    # the cancelled attempts' ends write their own step times: today's figures come after them
    wait_for(lambda: not any(a["outcome"] == "running" for a in attempts()), "the cancelled shards to end")
    for agent in ("local1", "local2"):
        publish(r, agent, step_s=json.dumps({"digits-mlp": 0.4}))
    resumed = tt_here_json("resume", run_id, "--replan", "--broker", pool.broker_url, "--store", store, "--json")
    assert resumed["state"] == "succeeded"
    options = resumed["spec"]["options"]
    assert 25 < options["sync_every"] <= 40 and options["planned"]["sync_every"] == options["sync_every"]
    assert (options["codec"], options["sync"], options["shards"]) == ("fp32", "rounds", 2)
    replanned = [i for i in resumed["incidents"] if i["kind"] == "replanned"]
    assert len(replanned) == 1 and f"sync_every 25 → {options['sync_every']}" in replanned[0]["detail"]
    assert any(w.startswith("sync rounds: kept") for w in options["planned"]["why"])
    shown = tt_here("status", run_id, "--broker", pool.broker_url, "--store", store)
    assert "utilisation: predicted" in shown.stdout and "measured" in shown.stdout


def test_resume_replan_is_refused_for_a_run_without_a_plan(tmp_path):
    store = str(tmp_path / "store")
    ensemble, static = tt_json_many(
        ("run", "--recipe", "digits-mlp", "--mode", "ensemble", "--members", "2", "--store", store,
         "--local-workers", "1", "--json"),
        ("run", "--recipe", "digits-mlp", "--plan", "off", "--rounds", "1", "--store", store,
         "--local-workers", "1", "--json"), cwd=tmp_path)
    assert static["spec"]["options"]["planned"] == {} and static["spec"]["options"]["codec"] == "fp32"
    for doc, says in [(ensemble, "is not fused (--mode ensemble)"),
                      (static, "was started with --plan off: there is no plan to make again")]:
        refused = tt_here("resume", doc["run_id"], "--replan", "--store", store)
        assert says in assert_clean_error(refused, 2)
