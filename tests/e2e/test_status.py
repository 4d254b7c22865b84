"""`status` and `runs` after an embedded run: the JSON contract, read back from the manifest."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from conftest import queued_messages, tt, tt_json

pytestmark = pytest.mark.e2e

SHARDS, SYNC_EVERY, BATCH = 2, 2, 32  # digits-mlp's batch size is 32


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One small embedded run (its private Redis is gone once `run` returns)."""
    work = tmp_path_factory.mktemp("status")
    store = work / "store"
    doc = tt_json("run", "--recipe", "digits-mlp", "--local-workers", "1", "--rounds", "1",
                  "--shards", str(SHARDS), "--sync-every", str(SYNC_EVERY), "--store", str(store),
                  "--json", cwd=work)
    return store, doc


def path_of(uri: str) -> Path:
    assert uri.startswith("file:///"), uri
    return Path(unquote(urlsplit(uri).path))


def test_run_json_has_the_contract_fields(finished_run):
    store, doc = finished_run
    run_id = doc["run_id"]
    assert doc["state"] == "succeeded", doc.get("error")
    assert doc["mode"] == "fused"
    assert doc["recipe"] == "digits-mlp"
    assert doc["error"] is None
    assert set(doc["metrics"]) >= {"test_accuracy", "test_loss"}
    assert 0.0 <= doc["metrics"]["test_accuracy"] <= 1.0
    assert doc["metrics"]["test_loss"] > 0
    assert doc["model_uri"] == (store / "runs" / run_id / "final" / "model.safetensors").as_uri()
    assert len(doc["model_sha256"]) == 64

    assert len(doc["rounds"]) == 1
    r0 = doc["rounds"][0]
    assert r0["round"] == 0
    assert r0["loss"] > 0
    assert r0["samples"] == SHARDS * SYNC_EVERY * BATCH
    assert r0["bytes"] == r0["bytes_up"] + r0["bytes_down"]
    assert doc["bytes_up"] == r0["bytes_up"] and doc["bytes_down"] == r0["bytes_down"]

    # the byte counts are those of the objects actually moved through the store
    run_dir = store / "runs" / run_id
    shard_sizes = sum((run_dir / "r0000" / f"shard-{k:03d}.safetensors").stat().st_size
                      for k in range(SHARDS))
    assert doc["bytes_up"] == shard_sizes
    # θ_0 is not downloaded: each agent rebuilds it from the seed and checks its sha256
    assert doc["bytes_down"] == 0
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["options"]["init_sha256"] == hashlib.sha256(
        (run_dir / "global" / "r0000.safetensors").read_bytes()).hexdigest()

    tasks = sorted(a["task"] for a in doc["attempts"])
    assert tasks == ["r0/outer"] + [f"r0/shard-{k}" for k in range(SHARDS)]
    for a in doc["attempts"]:
        assert a["outcome"] == "succeeded"
        assert a["worker"].startswith("local1@")
        assert a["attempt"] == 1
        assert a["started_at"] <= a["finished_at"]


def test_model_file_hashes_to_model_sha256(finished_run):
    _, doc = finished_run
    data = path_of(doc["model_uri"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == doc["model_sha256"]
    # the final model is the global weights after the last round
    last = path_of(doc["model_uri"]).parent.parent / "global" / "r0001.safetensors"
    assert last.read_bytes() == data


def test_status_reads_the_manifest_after_the_embedded_pool_is_gone(finished_run):
    store, doc = finished_run
    st = tt_json("status", doc["run_id"], "--store", str(store), "--json")
    for field in ("run_id", "mode", "state", "recipe", "metrics", "model_uri", "model_sha256",
                  "rounds", "attempts", "bytes_up", "bytes_down", "error", "finished_at"):
        assert st[field] == doc[field], field
    assert st["spec"]["options"]["rounds"] == 1 and st["spec"]["options"]["shards"] == SHARDS


def test_status_falls_back_to_the_store_when_the_broker_does_not_know_the_run(finished_run,
                                                                               redis_server):
    store, doc = finished_run
    st = tt_json("status", doc["run_id"], "--broker", redis_server.url, "--store", str(store), "--json")
    assert (st["run_id"], st["state"], st["model_sha256"]) == (
        doc["run_id"], "succeeded", doc["model_sha256"])


def test_status_human_output(finished_run):
    store, doc = finished_run
    proc = tt("status", doc["run_id"], "--store", str(store))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert f"run {doc['run_id']}: succeeded" in out
    assert f"sha256: {doc['model_sha256']}" in out
    assert f"model: {doc['model_uri']}" in out
    assert "test_accuracy:" in out
    assert "round 0: loss" in out


def test_runs_lists_the_run_from_the_store(finished_run):
    store, doc = finished_run
    items = tt_json("runs", "--store", str(store), "--json")
    assert [m["run_id"] for m in items] == [doc["run_id"]]
    m = items[0]
    assert (m["mode"], m["state"], m["recipe"]) == ("fused", "succeeded", "digits-mlp")
    assert m["metrics"] == doc["metrics"]
    assert m["error"] is None
    assert m["created_at"] == doc["created_at"]


def test_sigterm_puts_the_running_task_back_in_the_queue(tmp_path, pool_factory, monkeypatch):
    import time

    import redis

    from tensorturn.state.board import RunBoard
    from tensorturn.state.broker import check_broker

    monkeypatch.setenv("TENSORTURN_BROKER_URL", "redis://127.0.0.1:1/0")  # the pool points it elsewhere
    store = tmp_path / "store"
    pool = pool_factory(1)
    doc = tt_json("run", "--broker", pool.broker_url, "--store", str(store), "--recipe",
                  "digits-mlp", "--rounds", "1", "--shards", "1", "--sync-every", "100000",
                  "--detach", "--json")
    board = RunBoard(check_broker(pool.broker_url))
    deadline = time.monotonic() + 180
    while not board.attempts.all(doc["run_id"]):  # until the agent has started the shard
        assert time.monotonic() < deadline, "the agent never started the shard"
        time.sleep(0.05)
    assert [a["outcome"] for a in board.attempts.all(doc["run_id"])] == ["running"]
    agent = pool.agents[0]
    agent.terminate()  # SIGTERM, as systemd or Ctrl-C would send
    assert agent.wait(60) is not None
    # the long shard did not finish; its message is back in the queue for another machine
    r = redis.Redis.from_url(pool.broker_url)
    queued = [m for m in queued_messages(r) if b"tensorturn.fused.train_slot" in m]
    assert len(queued) == 1
    assert r.hlen("unacked") == 0
    assert not (store / "runs" / doc["run_id"] / "r0000" / "shard-000.safetensors").exists()
