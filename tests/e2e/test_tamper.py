"""Store-only and Redis-only attacks on a real pool: bytes that none of the
run's tasks stored, or a broker record that points elsewhere, never end in a "succeeded" model.

Each run trains a ``gated:Gated`` recipe (tests/gated.py): its shard tasks wait at a gate the test
opens once it has done its damage, so the damage lands between two steps of the run however
loaded the machine is."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from conftest import start_pool, tt_here, tt_json, wait_for

from tensorturn import layout
from tensorturn.spec import FINISHED
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import check_broker
from tensorturn.store.objects import sha256_hex
from tensorturn.store.tensors import delta_bytes, from_bytes

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gated_agents(tmp_path_factory):
    """Two real agents whose gated shard tasks wait while the gate file exists (tests/gated.py),
    shared by the module's tests: (pool, store folder, gate file)."""
    work = tmp_path_factory.mktemp("gated")
    pool = start_pool(work, 2, env={"TT_GATE": str(work / "gate")})
    yield pool, work / "store", work / "gate"
    pool.stop(grace=1.0)


@pytest.fixture
def gated_pool(gated_agents):
    """The module's gated pool, its gate open when the test starts and when it ends."""
    gate = gated_agents[2]
    gate.unlink(missing_ok=True)
    yield gated_agents
    gate.unlink(missing_ok=True)


def close(gate, **when) -> None:
    gate.write_text(json.dumps(when))


def submit(pool, store, *options: str) -> str:
    return tt_json("run", "--broker", pool.broker_url, "--store", str(store), "--recipe", "gated:Gated",
                   "--detach", "--json", *options)["run_id"]


def finished(board: RunBoard, run_id: str) -> dict:
    wait_for(lambda: board.describe(run_id)["state"] in FINISHED, f"run {run_id} finished", timeout=600)
    return board.describe(run_id)


def test_theta_overwritten_in_the_store_fails_the_run_naming_it(gated_pool):
    pool, store, gate = gated_pool
    close(gate, after="runs/*/global/r0001.safetensors", store=str(store))  # round 1 waits for us
    run_id = submit(pool, store, "--rounds", "2", "--shards", "2", "--sync-every", "5", "--keep", "best")
    board = RunBoard(check_broker(pool.broker_url))
    folder = store / "runs" / run_id / "global"
    wait_for((folder / "r0001.safetensors").exists, "θ_1 stored")
    # another model file the run made (θ_0), where θ_1 was: a store writer's swap
    (folder / "r0001.safetensors").write_bytes((folder / "r0000.safetensors").read_bytes())
    gate.unlink()
    doc = finished(board, run_id)
    assert doc["state"] == "failed"
    assert (f"θ of round 1 (runs/{run_id}/global/r0001.safetensors) is not what the run stored"
            in doc["error"]), doc["error"]
    assert "\n" not in doc["error"]
    assert not (store / "runs" / run_id / "final").exists()


def test_a_poisoned_pseudo_gradient_fails_the_run_naming_it(gated_pool):
    pool, store, gate = gated_pool
    close(gate, shard=1)  # shard 1 waits: shard 0's output is stored first
    run_id = submit(pool, store, "--rounds", "1", "--shards", "2", "--sync-every", "5")
    board = RunBoard(check_broker(pool.broker_url))
    path = store / "runs" / run_id / "r0000" / "shard-000.safetensors"
    wait_for(path.exists, "shard 0 stored")
    honest = from_bytes(path.read_bytes())
    poison = {name: torch.full_like(v, float("nan")) for name, v in honest.items()}
    path.write_bytes(delta_bytes(poison, "fp32", {"samples": str(10 ** 9), "loss": "0.0",
                                                  "bytes_down": f"{0:015d}"}))
    gate.unlink()
    doc = finished(board, run_id)
    assert doc["state"] == "failed"
    assert (f"the pseudo-gradient of shard 0 of round 0 (runs/{run_id}/r0000/shard-000.safetensors) "
            f"is not what the run stored" in doc["error"]), doc["error"]
    assert not (store / "runs" / run_id / "final").exists()


def test_an_async_ledger_pointed_at_another_runs_model_is_put_back_from_the_store(gated_pool):
    """Once, the applier read whatever key the broker's hash named, and never checked its
    sha256: pointed at another run's model, the run "succeeded" on it."""
    pool, store, gate = gated_pool
    board = RunBoard(check_broker(pool.broker_url))
    other = submit(pool, store, "--rounds", "1", "--shards", "2", "--sync-every", "5")
    other_doc = finished(board, other)
    assert other_doc["state"] == "succeeded"
    close(gate, shard=1)
    run_id = submit(pool, store, "--sync", "async", "--rounds", "2", "--shards", "2", "--sync-every", "5")
    r = check_broker(pool.broker_url)
    key = layout.run_key(run_id, "async")
    # updates u0 and u2 (shard 0) are applied; u1 and u3 (shard 1) wait at the gate
    wait_for(lambda: r.hget(key, "version") in ("2", b"2"), "versions 1 and 2 committed")
    other_sha = other_doc["model_sha256"]
    r.hset(key, mapping={"key": layout.key("final_model", other), "sha256": other_sha})
    gate.unlink()
    doc = finished(board, run_id)
    assert doc["state"] == "succeeded", doc.get("error")
    repaired = [i for i in doc["incidents"] if i["kind"] == "ledger_repaired"]
    assert repaired and "put back from the store's log at version 2" in repaired[0]["detail"]
    assert doc["model_sha256"] != other_sha
    log = [json.loads(p.read_text()) for p in sorted((store / "runs" / run_id / "async" / "log").glob("*.json"))]
    assert all(entry["key"].startswith(f"runs/{run_id}/async/versions/") for entry in log)


def test_a_dataset_index_rewritten_after_the_run_started_fails_its_attempts_naming_it(gated_pool, tmp_path):
    """The dataset index is not sealed (a push writes it, not a run), so a store
    writer could swap the chunks a run trains on. The run pins the index's sha256 in its signed
    spec when it starts; here the train and validation chunks are swapped once it has, and every
    attempt that reads the index fails naming it: the run never trains on them."""
    pool, store, gate = gated_pool
    table = tmp_path / "houses.csv"
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rooms", "area", "price"])
        w.writerows([[i % 5 + 1, 20 + i, 10 * (i % 5) + 2 * i] for i in range(200)])
    pushed = tt_here("data", "push", str(table), "--name", "houses", "--label", "price", "--store", str(store))
    assert pushed.returncode == 0, pushed.stderr
    close(gate, after="runs/*/spec.json", store=str(store))  # the run's tasks build its recipe after we act
    run_id = tt_json("run", "--broker", pool.broker_url, "--store", str(store), "--recipe", "gated:GatedTable",
                     "--recipe-option", "dataset=houses", "--rounds", "1", "--shards", "2", "--sync-every", "2",
                     "--max-attempts", "2", "--detach", "--json")["run_id"]
    spec = store / "runs" / run_id / "spec.json"
    wait_for(spec.exists, "the run's spec stored")
    index_file = store / "datasets" / "houses" / "v0001.json"
    honest = index_file.read_bytes()
    index = json.loads(honest)
    index["splits"]["train"], index["splits"]["val"] = index["splits"]["val"], index["splits"]["train"]
    index["rows"]["train"], index["rows"]["val"] = index["rows"]["val"], index["rows"]["train"]
    index_file.write_text(json.dumps(index))
    gate.unlink()
    board = RunBoard(check_broker(pool.broker_url))
    doc = finished(board, run_id)
    assert doc["state"] == "failed"
    assert ("the dataset index datasets/houses/v0001.json is not the one the run read when it started"
            in doc["error"]), doc["error"]
    assert "\n" not in doc["error"]
    assert not (store / "runs" / run_id / "final").exists()
    assert json.loads(spec.read_text())["datasets"] == {"datasets/houses/v0001.json": sha256_hex(honest)}
