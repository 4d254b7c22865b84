"""The recipe contract in real runs: a recipe `check-recipe` refuses is refused by `run` with
nothing stored; standardised targets are served and measured in the user's units in both modes."""

from __future__ import annotations

import re

import httpx
import pytest
from conftest import Server, bearer, tt, tt_json, tt_json_many

from tensorturn import config, layout, trust
from tensorturn.predictor import load_result
from tensorturn.recipes import resolve
from tensorturn.store.objects import open_store


@pytest.fixture(autouse=True)
def _allowed():
    config.use(trust.with_allowed(config.current(), [ALLOW]))



ALLOW = "contract_recipes:*"

NO_TASK = "contract_recipes:NoTask"

REFUSED_NO_TASK = ("failed at data: task 'classification' needs integer class targets, got "
                   "torch.float32 (a regression recipe sets task = 'regression')")


def test_a_recipe_check_recipe_refuses_is_refused_by_run_with_nothing_stored(tmp_path):
    store = tmp_path / "store"
    proc = tt("run", "--mode", "fused", "--recipe", NO_TASK, "--local-workers", "1",
              "--store", str(store), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: recipe '{NO_TASK}' {REFUSED_NO_TASK}; "
                                                     f"nothing was queued")
    assert not (store / layout.RUNS).exists() or not any((store / layout.RUNS).iterdir())


def test_standardised_targets_are_served_and_measured_in_the_users_units_in_both_modes(tmp_path):
    name, store = "contract_recipes:DiabetesR2", str(tmp_path / "store")
    fused, ensemble = tt_json_many(  # side by side, each on its own embedded pool
        ("run", "--recipe", name, "--local-workers", "2", "--rounds", "3", "--shards", "2",
         "--sync-every", "30", "--store", store, "--json"),
        ("run", "--mode", "ensemble", "--recipe", name, "--members", "2", "--segments", "1",
         "--segment-steps", "90", "--local-workers", "2", "--store", store, "--json"), cwd=tmp_path)
    assert fused["state"] == ensemble["state"] == "succeeded", (fused.get("error"), ensemble.get("error"))
    tested = {k for k in fused["metrics"] if k.startswith("test_")}
    assert tested == {"test_loss", "test_mae", "test_r2", "test_rows"}
    assert tested <= set(ensemble["metrics"])  # the same figures, by the same evaluate
    for doc in (fused, ensemble):
        m = doc["metrics"]
        assert 20 < m["test_mae"] < 120 and m["test_loss"] > 400  # points of the score, not std units
        # each mode's figures are the recipe's evaluate of its result, as one model
        predictor, _ = load_result(open_store((tmp_path / "store").as_uri()), doc["run_id"])
        again = predictor.recipe.evaluate_split(predictor.as_model(), "test")
        assert {f"test_{k}": v for k, v in again.items()} == pytest.approx(
            {k: m[k] for k in tested - {"test_rows"}}, rel=1e-4)
        assert m["test_rows"] == len(predictor.recipe.sample_rows("test", 10 ** 6)[1])  # a small split: whole
    # what a person reads: the recipe's own metrics, in the user's units, rounded
    assert all(20 < r["val_mae"] < 120 and "val_r2" in r for r in fused["rounds"])
    status = tt("status", fused["run_id"], "--store", store, cwd=tmp_path).stdout
    assert re.search(r"^  round 2: loss [\d.]+  val_loss \d+(\.\d)?  val_mae \d+(\.\d+)?  val_r2 -?[\d.]+  bytes \d+$",
                     status, re.M), status
    listed = tt("runs", "--store", store, cwd=tmp_path).stdout.splitlines()
    for doc in (fused, ensemble):
        [line] = [line for line in listed if line.startswith(doc["run_id"])]
        assert re.search(r"  test_loss \d+(\.\d)?  test_mae \d+(\.\d+)?  test_r2 -?[\d.]+$", line), line

    token = tt_json("token", "create", "--store", store, "--json", cwd=tmp_path)["token"]
    server = Server(store, ensemble["run_id"], "--allow-recipe", ALLOW)
    try:
        x = resolve(name).raw_data()[4][:20]
        body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                            "data": x.flatten().tolist()}], "parameters": {"members": True}}
        r = httpx.post(f"{server.url}/v2/models/{ensemble['run_id']}/infer", json=body,
                       headers=bearer(token), timeout=60)
        assert r.status_code == 200, r.text
        outputs = {o["name"]: o["data"] for o in r.json()["outputs"]}
        for values in (outputs["prediction"], outputs["member_0_prediction"]):
            assert len(values) == 20 and all(0 < v < 400 for v in values)  # the score: 25 to 346
            assert max(values) - min(values) > 20
    finally:
        server.stop()
