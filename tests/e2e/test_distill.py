"""Distillation on a real pool: an ensemble's vote → one student model (``tensorturn distill``).

The student is a fused run of the ``distill`` recipe; its teacher targets are computed by the
shards' machines and stored beside the ensemble. These tests check what a user relies on: the
targets are the members' vote, the result serves like any model and names its ensemble, an agent
killed mid-distillation changes nothing, and every mistake is one line with nothing started.
"""

from __future__ import annotations

import json
import os
import signal

import pytest
import redis
import torch
from conftest import run_to_end, submit_run, tt, tt_here, tt_json, wait_for, wait_for_run

from tensorturn import config, layout, trust
from tensorturn.errors import RecipeError
from tensorturn.merge.distill import distill_spec
from tensorturn.merge.student import Distilled
from tensorturn.predictor import load_result
from tensorturn.recipes import Recipe, resolve
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.store.objects import open_store
from tensorturn.train.distill import teacher_targets
from tensorturn.train.seeding import shard_rows

pytestmark = [pytest.mark.e2e, pytest.mark.long]

# small, and long enough per shard (≈ 1.5k steps) for a kill to land mid-training
STUDENT = dict(rounds=2, shards=3, sync_every=1500)
# the module's pool (conftest): leases of 4 s, not 8 (refreshed every second), so the killed
# agent's shard comes back sooner
POOL_ENV = {"TENSORTURN_VISIBILITY_TIMEOUT_S": "4"}


@pytest.fixture(scope="module")
def ensemble(pool):
    doc = run_to_end(pool, mode="ensemble", recipe="digits-mlp", members=2, segments=1,
                     segment_steps=150, seed=0)
    assert doc["state"] == "succeeded", doc.get("error")
    return doc


@pytest.fixture(scope="module")
def student(pool, ensemble):
    """``tensorturn distill`` through the CLI, fault-free: the reference run."""
    return tt_json("distill", ensemble["run_id"], "--broker", pool.broker_url, "--store",
                   pool.store_url, *(f"--{k.replace('_', '-')}={v}" for k, v in STUDENT.items()),
                   "--json")


def test_the_student_learns_the_vote_and_serves_as_one_model_with_its_lineage(pool, ensemble, student):
    assert student["state"] == "succeeded", student.get("error")
    assert student["recipe"] == "distill" and student["mode"] == "fused"
    assert student["lineage"] == {"distilled_from": ensemble["run_id"], "recipe": "digits-mlp",
                                  "temperature": 2.0, "alpha": 0.5, "top_k": 16, "mixup": 0,
                                  "student": {}}
    store = open_store(pool.store_url)
    # each shard's targets once, beside the ensemble; they are the members' soft vote at T
    keys = sorted(store.list(f"runs/{ensemble['run_id']}/teacher/"))
    assert keys == [layout.key("teacher", ensemble["run_id"], "T2-k16-s0-t1", k, 3) for k in range(3)]
    vote, _ = load_result(store, ensemble["run_id"])
    base = resolve("digits-mlp")
    x, _, rows = base.shard_data(1, 3, 0)
    with torch.no_grad():
        want_values, want_indices = teacher_targets(torch.stack([m(x[rows]) for m in vote.models]), 2.0, 16)
    from tensorturn.store.tensors import from_bytes

    stored = from_bytes(store.get_bytes(keys[1]))
    assert torch.equal(stored["indices"], want_indices.int())
    assert torch.allclose(stored["values"].float(), want_values, atol=1e-3)
    # the result is one model, served by the base recipe's code with no teacher in reach
    predictor, manifest = load_result(store, student["run_id"])
    assert len(predictor.models) == 1 and manifest["lineage"]["distilled_from"] == ensemble["run_id"]
    answer, _ = predictor.predict(base.preprocess(base.raw_data()[4][:5]))
    assert answer.shape == (5, 10)
    assert student["metrics"]["test_accuracy"] == pytest.approx(
        base.evaluate_split(predictor.models[0], "test")["accuracy"])


def test_an_agent_killed_mid_distillation_loses_nothing(pool, ensemble, student):
    spec = submit_run(pool, distill_spec(ensemble["run_id"], pool.store_url, **STUDENT))
    board = RunBoard(redis.Redis.from_url(pool.broker_url, decode_responses=True))
    victim = wait_for(lambda: next((a for a in board.attempts.all(spec.run_id)
                                    if a["task"].startswith("r0/") and a["outcome"] == "running"), None),
                      "a shard of round 0 training")
    index = int(victim["worker"].split("@")[0].removeprefix("local")) - 1
    os.killpg(pool.agents[index].pid, signal.SIGKILL)
    pool.agents[index].wait()
    pool.start_agent(index)
    doc = wait_for_run(pool, spec.run_id)
    assert doc["state"] == "succeeded", doc.get("error")
    assert doc["model_sha256"] == student["model_sha256"]  # the fault-free student, bit for bit
    assert [r["samples"] for r in doc["rounds"]] == [r["samples"] for r in student["rounds"]]
    tries = [a for a in doc["attempts"] if a["task"] == victim["task"]]
    assert tries[0]["outcome"].startswith("lost") and tries[-1]["outcome"] == "succeeded"


def test_merge_distill_runs_the_ensemble_then_its_student_in_one_command(pool):
    """On a standing pool (the embedded pool runs the same stages): the student starts from the
    ensemble's manifest, saved as finished before it is read."""
    doc = tt_json("run", "--mode", "ensemble", "--recipe", "digits-mlp", "--members", "2",
                  "--segments", "1", "--segment-steps", "50", "--merge", "distill",
                  "--broker", pool.broker_url, "--store", pool.store_url, "--json")
    assert doc["ensemble"]["state"] == "succeeded" and doc["ensemble"]["mode"] == "ensemble"
    assert doc["state"] == "succeeded" and doc["lineage"]["distilled_from"] == doc["ensemble"]["run_id"]
    predictor, _ = load_result(open_store(pool.store_url), doc["run_id"])
    assert len(predictor.models) == 1


# ---- mistakes: one line, nothing queued -------------------------------------------------------

def fake_manifest(store, run_id: str, **fields) -> None:
    doc = {"run_id": run_id, "mode": "ensemble", "state": "running", "recipe": "digits-mlp",
           "model_uri": None, "spec": {"recipe": "digits-mlp"}, **fields}
    store.put_json(layout.key("manifest", run_id), trust.pool_key().sign_doc("manifest", doc))


@pytest.mark.parametrize("args,expected", [
    (("nosuchrun",), "no run 'nosuchrun' in the store"),
    (("STUDENT",), "is a fused run, not an ensemble: it is one model already"),
    (("UNFINISHED",), "is running, not a finished ensemble"),
    (("ENSEMBLE", "--student", '{"hidden": "wide"}'), "the student config {\"hidden\": \"wide\"} "
                                                      "does not fit recipe 'digits-mlp'"),
    (("ENSEMBLE", "--student", "wide"), "--student is not JSON"),
    (("ENSEMBLE", "--student", "[64]"), "--student must be a JSON object"),
    (("ENSEMBLE", "--student", "@/nonexistent.json"), "cannot read /nonexistent.json"),
    (("ENSEMBLE", "--temperature", "0"), "--temperature must be positive (got 0)"),
    (("ENSEMBLE", "--alpha", "1.5"), "--alpha must be in [0, 1] (got 1.5)"),
    (("ENSEMBLE", "--top-k", "0"), "--top-k must be a whole number ≥ 1 (got 0)"),
    (("ENSEMBLE", "--rounds", "0"), "--rounds must be a whole number ≥ 1 (got 0)"),
])
def test_bad_distillations_are_one_line_and_start_nothing(pool, ensemble, student, redis_server,
                                                          args, expected):
    store = open_store(pool.store_url)
    fake_manifest(store, "unfinished-ensemble")
    names = {"STUDENT": student["run_id"], "ENSEMBLE": ensemble["run_id"],
             "UNFINISHED": "unfinished-ensemble"}
    before = sorted(store.list("runs/"))
    proc = tt_here("distill", *(names.get(a, a) for a in args), "--broker", redis_server.url,
                   "--store", pool.store_url)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr
    assert proc.stdout == ""
    assert sorted(store.list("runs/")) == before
    assert redis.Redis.from_url(redis_server.url).keys("*") == []


def test_merge_is_refused_where_it_cannot_work(tmp_path, redis_server):
    proc = tt("run", "--mode", "fused", "--recipe", "digits-mlp", "--merge", "distill",
              "--store", str(tmp_path / "store"), cwd=tmp_path)
    assert proc.returncode == 2 and "--merge distill merges an ensemble's members" in proc.stderr
    proc = tt("run", "--mode", "ensemble", "--recipe", "digits-mlp", "--merge", "distill",
              "--detach", "--broker", redis_server.url, "--store", str(tmp_path / "store"), cwd=tmp_path)
    assert proc.returncode == 2 and "--merge waits for the ensemble" in proc.stderr
    assert not (tmp_path / "store").exists() and redis.Redis.from_url(redis_server.url).keys("*") == []


class Wide(Recipe):
    """A recipe whose output width is a setting: a student can be built with the wrong one."""

    def raw_data(self):
        x = torch.randn(40, 3, generator=torch.Generator().manual_seed(0))
        y = torch.randint(4, (40,), generator=torch.Generator().manual_seed(1))
        return x[:20], y[:20], x[20:30], y[20:30], x[30:], y[30:]

    def default_config(self):
        return {"classes": 4}

    def model(self, config):
        return torch.nn.Linear(3, config["classes"])


def test_a_student_with_other_outputs_than_the_members_is_refused():
    config.use(trust.with_allowed(config.current(), ["test_distill:*"]))
    recipe = Distilled(teacher="some-ensemble", recipe="test_distill:Wide", student={"classes": 5})
    with pytest.raises(RecipeError, match=r"its output for one row is \(1, 5\), the ensemble's "
                                          r"members give \(1, 4\)"):
        recipe.check_student([{"classes": 4}])
    Distilled(teacher="some-ensemble", recipe="test_distill:Wide").check_student([{"classes": 4}])


def test_shard_rows_of_the_student_are_the_base_recipes_rows_with_their_labels():
    """The packed target of a row: its label, then the teacher's top-k values and classes."""
    config.use(trust.with_allowed(config.current(), ["test_distill:*"]))
    recipe = Distilled(teacher="t", recipe="test_distill:Wide", top_k=2)
    base_x, base_y, rows = recipe.base.shard_data(0, 2, 0)
    values, indices = torch.rand(len(rows), 2).half(), torch.randint(4, (len(rows), 2)).int()
    recipe._targets[(0, 2, 0)] = (values, indices)  # as if read from the store
    x, y, order = recipe.shard_data(0, 2, 0)
    assert torch.equal(x, base_x[rows]) and torch.equal(order, torch.arange(len(rows)))
    assert torch.equal(y[:, 0].long(), base_y[rows])
    assert torch.equal(y[:, 1:3], values.float()) and torch.equal(y[:, 3:].long(), indices.long())
    assert shard_rows(20, 2, 0, 0).tolist() == rows.tolist()


def test_a_language_model_is_distilled_position_by_position(pool, tmp_path):
    """charlm: the teacher's targets are a top-k distribution per position of each window."""
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(400)))
    options = {"data": str(text), "context": 16, "n_layer": 1, "n_embd": 32, "n_head": 2}
    spec = RunSpec.create("ensemble", "charlm", pool.store_url, recipe_options=options, members=2,
                          segments=1, segment_steps=20, diversity="seed", seed=0)
    ens = run_to_end(pool, spec)
    assert ens["state"] == "succeeded", ens.get("error")
    doc = run_to_end(pool, distill_spec(spec.run_id, pool.store_url, top_k=4, rounds=1, shards=2,
                                        sync_every=10))
    assert doc["state"] == "succeeded", doc.get("error")
    assert doc["rounds"][0]["val_loss"] is not None
    from tensorturn.store.tensors import from_bytes

    store = open_store(pool.store_url)
    stored = from_bytes(store.get_bytes(layout.key("teacher", spec.run_id, "T2-k4-s0-t1", 0, 2)))
    windows = len(resolve("charlm", options).shard_data(0, 2, 0)[2])
    assert stored["values"].shape == stored["indices"].shape == (windows, 16, 4)
    assert torch.allclose(stored["values"].float().sum(-1), torch.ones(windows, 16), atol=1e-2)


def test_a_merged_models_lineage_is_printed():
    from tensorturn.runs.display import as_one, result_lines

    base = {"run_id": "r2", "state": "succeeded", "metrics": {"test_accuracy": 0.97},
            "model_uri": "file:///s/runs/r2/final/model.safetensors", "model_sha256": "ab"}
    ensemble = {**base, "run_id": "r1", "model_uri": None}
    out = result_lines(ensemble) + result_lines({**base, "lineage": {
        "distilled_from": "r1", "temperature": 2.0, "alpha": 0.5, "top_k": 16}})
    assert out[0] == "run r1: succeeded" and "run r2: succeeded" in out
    assert "  distilled from: run r1 (T 2, alpha 0.5, top-k 16)" in out
    souped = result_lines({**base, "lineage": {"souped_from": "r1", "rule": "greedy", "members": [2, 0]}})
    assert "  souped from: run r1 (greedy soup of members 2, 0)" in souped
    doc = json.loads(json.dumps(as_one([ensemble, {**base, "lineage": {}}])))
    assert doc["run_id"] == "r2" and doc["ensemble"]["run_id"] == "r1"


class NoValidation(Wide):
    def raw_data(self):
        x_tr, y_tr, _, _, x_te, y_te = super().raw_data()
        return x_tr, y_tr, x_tr[:0], y_tr[:0], x_te, y_te


def test_a_soup_needs_validation_rows():
    from tensorturn.merge.soup import validation_score
    from tensorturn.train.distill import SoupRefused

    recipe = NoValidation()
    with pytest.raises(SoupRefused, match="no validation rows: a soup is chosen on validation"):
        validation_score(recipe, recipe.model({"classes": 4}), None)
    assert 0 <= validation_score(Wide(), Wide().model({"classes": 4}), None) <= 1


def test_merge_distill_of_a_regression_recipe_is_refused_before_the_ensemble(redis_server, tmp_path):
    proc = tt("run", "--mode", "ensemble", "--recipe", "regress:Diabetes", "--merge", "distill",
              "--broker", redis_server.url, "--store", str(tmp_path / "store"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert ("error: --merge distill: recipe 'regress:Diabetes' is a regression recipe; distillation "
            "needs a classification or language-model ensemble") in proc.stderr
    assert not (tmp_path / "store" / "runs").exists()
    assert redis.Redis.from_url(redis_server.url).keys("*") == []


def test_a_student_file_that_is_not_text_is_one_line(ensemble, pool, tmp_path):
    path = tmp_path / "student.json"
    path.write_bytes(b"\xff\xfe\x00binary")
    proc = tt("distill", ensemble["run_id"], "--student", f"@{path}", "--store", pool.store_url)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"error: --student @{path}: {path} is not UTF-8 text" in proc.stderr


def test_teacher_targets_rewritten_in_the_store_fail_the_student_naming_them(pool, ensemble, student):
    """Rewritten targets once taught a student the wrong labels (0.978 → 0.10) and it
    "succeeded"; now the student's attempt fails in one line naming the object. (Last in this
    module: the other tests read these targets.)"""
    from tensorturn.store.tensors import from_bytes, to_bytes

    store = open_store(pool.store_url)
    key = layout.key("teacher", ensemble["run_id"], "T2-k16-s0-t1", 1, 3)
    honest = store.get_bytes(key)
    stored = from_bytes(honest)
    stored["indices"] = torch.roll(stored["indices"], 1, dims=-1)  # every row taught another class
    store.put_bytes(key, to_bytes(stored, {"teacher": ensemble["run_id"]}))
    for index, agent in enumerate(pool.agents):  # fresh agents: none holds the targets in memory
        os.killpg(agent.pid, signal.SIGKILL)
        agent.wait()
        pool.start_agent(index)
    try:
        proc = tt("distill", ensemble["run_id"], "--broker", pool.broker_url, "--store", pool.store_url,
                  *(f"--{k.replace('_', '-')}={v}" for k, v in STUDENT.items()), "--json")
        doc = json.loads(proc.stdout)
        assert proc.returncode != 0 and doc["state"] == "failed"
        assert (f"teacher targets shard 1 of 3 (T2-k16-s0-t1) ({key}) is not what the run stored"
                in doc["error"]), doc["error"]
    finally:
        store.put_bytes(key, honest)
