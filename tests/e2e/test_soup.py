"""Weight soups on a real pool: members fine-tuned from one model (``--init-from``), averaged
into one served model by ``tensorturn soup``; every other ensemble refused with its reason."""

from __future__ import annotations

import pytest
import redis
import torch
from conftest import run_to_end, tt_here, tt_here_json

from tensorturn import layout
from tensorturn.predictor import load_result
from tensorturn.recipes import resolve
from tensorturn.store.objects import open_store
from tensorturn.store.tensors import from_bytes
from tensorturn.train.distill import uniform_soup

pytestmark = pytest.mark.e2e


def finished(pool, **fields) -> dict:
    doc = run_to_end(pool, recipe="digits-mlp", seed=0, **fields)
    assert doc["state"] == "succeeded", doc.get("error")
    return doc


@pytest.fixture(scope="module")
def base(pool):
    """The model the members are fine-tuned from: a short fused run."""
    return finished(pool, mode="fused", rounds=2, shards=2, sync_every=50)


@pytest.fixture(scope="module")
def finetuned(pool, base):
    return finished(pool, mode="ensemble", members=3, segments=1, segment_steps=60,
                    init_from=base["run_id"])


def test_members_start_from_the_given_model_with_its_architecture(pool, base, finetuned):
    configs = [m["config"]["model"] for m in finetuned["members"]]
    assert configs == [resolve("digits-mlp").default_config()] * 3  # no draw of architectures
    assert finetuned["spec"]["options"]["init_sha256"] == base["model_sha256"]
    # each member's only segment began by fetching the base model (from scratch it fetches nothing)
    store = open_store(pool.store_url)
    size = len(store.get_bytes(layout.key("final_model", base["run_id"])))
    assert finetuned["bytes_down"] >= 3 * size


def test_soup_of_a_finetuned_ensemble_is_one_served_model_with_its_lineage(pool, finetuned):
    doc = tt_here_json("soup", finetuned["run_id"], "--rule", "greedy", "--store", pool.store_url, "--json")
    lineage = doc["lineage"]
    assert lineage["souped_from"] == finetuned["run_id"] and lineage["rule"] == "greedy"
    assert lineage["init_from"] == finetuned["spec"]["options"]["init_from"]
    members = lineage["member_val_scores"]
    assert lineage["members"][0] == int(max(members, key=members.get))  # best member first
    # the greedy soup is never worse on validation than its best member (it starts there)
    assert doc["metrics"]["val_score_greedy"] >= doc["metrics"]["best_member_val_score"]
    store = open_store(pool.store_url)
    predictor, manifest = load_result(store, doc["run_id"])  # served like a fused model
    assert len(predictor.models) == 1 and manifest["lineage"] == lineage
    # the uniform rule is the plain mean of the members' weights
    uniform = tt_here_json("soup", finetuned["run_id"], "--rule", "uniform", "--store", pool.store_url, "--json")
    assert uniform["lineage"]["members"] == [m["member"] for m in finetuned["members"]]
    ensemble = from_bytes(store.get_bytes(layout.key("final_ensemble", finetuned["run_id"])))
    states = [{k.split(".", 1)[1]: v for k, v in ensemble.items() if k.startswith(f"m{m}.")}
              for m in uniform["lineage"]["members"]]
    stored = from_bytes(store.get_bytes(layout.key("final_model", uniform["run_id"])))
    for name, value in uniform_soup(states).items():
        assert torch.allclose(stored[name], value)
    # the default rule takes whichever soup scores higher on validation; what a person reads
    scores = {"greedy": doc["metrics"]["val_score_greedy"], "uniform": doc["metrics"]["val_score_uniform"]}
    chosen = "greedy" if scores["greedy"] >= scores["uniform"] else "uniform"
    proc = tt_here("soup", finetuned["run_id"], "--store", pool.store_url)
    assert proc.returncode == 0, proc.stderr
    assert f"souped from: run {finetuned['run_id']} ({chosen} soup of members " in proc.stdout
    assert "test_accuracy: " in proc.stdout and "model: " in proc.stdout


def test_soups_and_starts_that_cannot_work_are_refused_in_one_line(pool, base, finetuned, redis_server):
    scratch = finished(pool, mode="ensemble", members=2, segments=1, segment_steps=20)

    def refused(*args: str) -> str:
        proc = tt_here(*args, "--store", pool.store_url)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == "", proc.stderr
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, proc.stderr
        return errors[0]

    assert "started from their own random initialisations" in refused("soup", scratch["run_id"])
    assert "is a fused run, not an ensemble" in refused("soup", base["run_id"])
    assert "no run 'nosuchrun' in the store" in refused("soup", "nosuchrun")
    assert "--eval-batches must be a whole number ≥ 0" in refused("soup", finetuned["run_id"],
                                                                  "--eval-batches", "-1")
    # --init-from: a finished one-model run of the same recipe, checked before anything is queued
    start = ("run", "--mode", "ensemble", "--recipe", "digits-mlp", "--broker", redis_server.url)
    assert "--init-from nosuchrun: no such run" in refused(*start, "--init-from", "nosuchrun")
    assert "is a succeeded ensemble run" in refused(*start, "--init-from", scratch["run_id"])
    other = ("run", "--mode", "ensemble", "--recipe", "charlm", "--broker", redis_server.url)
    assert "that run trained recipe 'digits-mlp' with options {}, this ensemble 'charlm'" in refused(
        *other, "--init-from", base["run_id"])
    assert [k for k in redis.Redis.from_url(redis_server.url).keys("tt:run*")] == []
