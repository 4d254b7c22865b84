"""Task kinds beyond classification, and `check-recipe`: a regression recipe trains in both modes
and is served with a `prediction` output; every hook of a recipe is checked in seconds."""

from __future__ import annotations

import httpx
import pytest
from conftest import Server, bearer, tt_json, tt_json_many

RECIPE = "regress:Diabetes"  # tests/regress.py


@pytest.mark.e2e
def test_a_regression_recipe_trains_in_both_modes_and_is_served_with_a_prediction(tmp_path):
    store = str(tmp_path / "store")
    fused, ensemble = tt_json_many(  # side by side, each on its own embedded pool
        ("run", "--recipe", RECIPE, "--local-workers", "2", "--rounds", "2", "--shards", "2",
         "--sync-every", "20", "--store", store, "--json"),
        ("run", "--mode", "ensemble", "--recipe", RECIPE, "--members", "3", "--segments", "1",
         "--segment-steps", "60", "--local-workers", "2", "--store", store, "--json"), cwd=tmp_path)
    assert fused["state"] == "succeeded"
    assert set(fused["metrics"]) >= {"test_loss", "test_mae"} and "test_accuracy" not in fused["metrics"]
    assert ensemble["state"] == "succeeded", ensemble.get("error")
    m = ensemble["metrics"]
    assert m["members_succeeded"] == 3 and "disagreement" not in m
    assert m["best_member_test_loss"] <= m["member_mean_test_loss"]
    # the mean of the members' predictions is no worse than their mean error (convexity of MSE)
    assert m["test_loss"] <= m["member_mean_test_loss"] + 1e-6
    token = tt_json("token", "create", "--store", store, "--json", cwd=tmp_path)["token"]
    server = Server(store, ensemble["run_id"], "--allow-recipe", "regress:*")  # a recipe is code
    try:
        rows = [[0.01 * (i + j) for j in range(10)] for i in range(3)]
        body = {"inputs": [{"name": "input", "shape": [3, 10], "datatype": "FP32", "data": rows}],
                "parameters": {"members": True}}
        r = httpx.post(f"{server.url}/v2/models/{ensemble['run_id']}/infer", json=body,
                       headers=bearer(token), timeout=60)
        assert r.status_code == 200, r.text
        outputs = {o["name"]: o for o in r.json()["outputs"]}
        assert outputs["prediction"]["datatype"] == "FP32" and outputs["prediction"]["shape"] == [3]
        assert len(outputs["prediction"]["data"]) == 3
        members = [outputs[f"member_{i}_prediction"]["data"] for i in range(3)]
        assert all(outputs[f"member_{i}_prediction"]["shape"] == [3] for i in range(3))  # as the vote's
        mean = [sum(v) / 3 for v in zip(*members)]
        assert outputs["prediction"]["data"] == pytest.approx(mean, rel=1e-5, abs=1e-6)
        meta = httpx.get(f"{server.url}/v2/models/{ensemble['run_id']}", headers=bearer(token), timeout=60).json()
        assert meta["parameters"]["task"] == "regression"
        # the vote's output, then each member's (answered when asked for), one value a row each
        assert meta["outputs"] == [{"name": name, "datatype": "FP32", "shape": [-1]} for name in
                                   ("prediction", *(f"member_{i}_prediction" for i in range(3)))]
    finally:
        server.stop()
