"""A recipe's learned state trains in both modes and is served and loaded without the data."""

from __future__ import annotations

import json

import pytest
from conftest import Server, bearer, clean_env, tt, tt_json, tt_json_many

from tensorturn import config, trust
from tensorturn.recipes import resolve


@pytest.fixture(autouse=True)
def _allowed():
    config.use(trust.with_allowed(config.current(), [ALLOW, "failing:*"]))



ALLOW = "learned_recipes:*"


def test_learned_state_trains_in_both_modes_and_is_served_and_loaded_without_the_data(tmp_path):
    name, store = "learned_recipes:Diabetes", str(tmp_path / "store")
    fused, ensemble = tt_json_many(
        ("run", "--recipe", name, "--local-workers", "2", "--rounds", "2", "--shards", "2",
         "--sync-every", "20", "--store", store, "--json"),
        ("run", "--mode", "ensemble", "--recipe", name, "--members", "2", "--segments", "1",
         "--segment-steps", "60", "--local-workers", "2", "--store", store, "--json"), cwd=tmp_path)
    for doc in (fused, ensemble):
        assert doc["state"] == "succeeded", doc.get("error")
        assert 20 < doc["metrics"]["test_mae"] < 150 and doc["metrics"]["test_in_range"] == 1.0

    no_data = clean_env(TT_NO_DATA="1")  # raw_data raises here: nothing may call it
    raw = resolve(name).raw_data()[4][:5]
    for doc in (fused, ensemble):
        folder = tmp_path / f"export-{doc['mode']}"
        proc = tt("export", doc["run_id"], str(folder), "--store", store, "--allow-recipe", ALLOW, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        code = ("import json, sys, tensorturn; m = tensorturn.load(sys.argv[1], allow=['learned_recipes:Diabetes']); "
                "print(json.dumps(m.predict(json.loads(sys.argv[2]))['prediction'].tolist()))")
        import subprocess
        import sys

        loaded = subprocess.run([sys.executable, "-c", code, str(folder), json.dumps(raw.tolist())],
                                env=no_data, capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert loaded.returncode == 0, loaded.stderr[-2000:]
        values = json.loads(loaded.stdout)
        assert len(values) == 5 and all(0 < v < 400 for v in values)  # the score: 25 to 346
    token = tt_json("token", "create", "--store", store, "--json", cwd=tmp_path)["token"]
    server = Server(store, fused["run_id"], "--allow-recipe", ALLOW, env=no_data)  # no data here either
    try:
        body = {"inputs": [{"name": "input", "shape": list(raw.shape), "datatype": "FP32",
                            "data": raw.flatten().tolist()}]}
        import httpx

        r = httpx.post(f"{server.url}/v2/models/{fused['run_id']}/infer", json=body, headers=bearer(token),
                       timeout=60)
        assert r.status_code == 200, r.text
        served = {o["name"]: o["data"] for o in r.json()["outputs"]}["prediction"]
        assert len(served) == 5 and all(0 < v < 400 for v in served)
    finally:
        server.stop()
