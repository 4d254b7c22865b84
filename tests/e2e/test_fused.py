"""Fused mode end to end, as a user runs it: the CLI, real redis-server, real agent processes."""

import hashlib
from urllib.parse import urlsplit

import boto3
import pytest
from conftest import clean_env, tt_json, tt_json_many

pytestmark = pytest.mark.e2e


def test_embedded_fused_run_reaches_accuracy_and_is_machine_independent(tmp_path):
    store = str(tmp_path / "store")
    run = ("run", "--mode", "fused", "--recipe", "digits-mlp", "--rounds", "8", "--store", store, "--json")
    # side by side, each on its own embedded pool: three agents, and one training with one thread
    three, one = tt_json_many((*run, "--local-workers", "3"),
                              (*run, "--local-workers", "1", "--threads-per-task", "1"), cwd=tmp_path)
    assert three["state"] == "succeeded"
    assert three["metrics"]["test_accuracy"] >= 0.95
    assert len(three["rounds"]) == 8
    assert {a["worker"].split("@")[0] for a in three["attempts"]} <= {"local1", "local2", "local3"}
    # every attempt succeeded, but an evaluation that began after the last outer step recorded
    # its round (it waits only for one running) ends late, or may still run as the run ends
    assert all(a["outcome"] == "succeeded"
               or (a["task"].endswith("/eval") and a["outcome"].startswith(("late", "running")))
               for a in three["attempts"])
    # shards (2 by default on digits' 1,257 training rows), outer steps, and the evaluations of
    # rounds 0-6 (the last outer step evaluates its own; one of a round it finds unrecorded too)
    tasks = {a["task"] for a in three["attempts"]}
    trained = {f"r{r}/shard-{k}" for r in range(8) for k in range(2)} | {f"r{r}/outer" for r in range(8)}
    assert trained <= tasks <= trained | {f"r{r}/eval" for r in range(7)}
    model = urlsplit(three["model_uri"]).path
    assert hashlib.sha256(open(model, "rb").read()).hexdigest() == three["model_sha256"]
    assert three["bytes_up"] > 0 and three["bytes_down"] > 0

    # Shards are virtual replicas: one agent computes the very same weights.
    assert one["state"] == "succeeded"
    assert {a["worker"].split("@")[0] for a in one["attempts"]} == {"local1"}
    assert one["model_sha256"] == three["model_sha256"]
    assert one["run_id"] != three["run_id"]


def test_fused_run_on_a_pool_with_an_s3_store(s3_endpoint, s3_bucket, tmp_path):
    doc = tt_json("run", "--recipe", "digits-mlp", "--local-workers", "2", "--rounds", "2",
                  "--store", f"s3://{s3_bucket}/team", "--json",
                  env=clean_env(**s3_endpoint), cwd=tmp_path)
    assert doc["state"] == "succeeded"
    uri = urlsplit(doc["model_uri"])
    assert uri.scheme == "s3" and uri.netloc == s3_bucket
    assert uri.path == f"/team/runs/{doc['run_id']}/final/model.safetensors"
    body = boto3.client("s3").get_object(Bucket=s3_bucket, Key=uri.path.lstrip("/"))["Body"].read()
    assert hashlib.sha256(body).hexdigest() == doc["model_sha256"]
    assert not (tmp_path / "tensorturn-store").exists()  # nothing went to the default file store


def test_run_on_an_existing_pool_names_its_agents(pool, tmp_path):
    doc = tt_json("run", "--broker", pool.broker_url, "--recipe", "digits-mlp", "--rounds", "2",
                  "--shards", "4", "--sync-every", "5", "--store", pool.store_url, "--json")
    assert doc["state"] == "succeeded"
    assert sorted(a["task"] for a in doc["attempts"]) == sorted(
        [f"r{r}/outer" for r in range(2)] + [f"r{r}/shard-{k}" for r in range(2) for k in range(4)]
        + ["r0/eval"])  # (the last round's outer step evaluates its weights itself)
    assert {a["worker"].split("@")[0] for a in doc["attempts"]} <= {"local1", "local2"}
    assert [r["round"] for r in doc["rounds"]] == [0, 1]
    assert doc["spec"]["options"]["shards"] == 4

    detached = tt_json("run", "--broker", pool.broker_url, "--recipe", "digits-mlp", "--rounds", "1",
                       "--shards", "2", "--sync-every", "2", "--store", pool.store_url,
                       "--detach", "--json")
    # --detach returns the run as it stood when queued; idle agents may already have picked it
    # up (or, on a tiny run, finished it), so only its identity is certain, not its progress
    assert detached["state"] in ("queued", "running", "succeeded"), detached.get("error")
    assert detached["spec"]["options"]["shards"] == 2
    watched = tt_json("status", detached["run_id"], "--broker", pool.broker_url, "--watch", "--json")
    assert watched["run_id"] == detached["run_id"]
    assert watched["state"] == "succeeded"
    assert watched["model_sha256"]
    assert {a["task"] for a in watched["attempts"]} == {"r0/shard-0", "r0/shard-1", "r0/outer"}
    assert {a["worker"].split("@")[0] for a in watched["attempts"]} <= {"local1", "local2"}
