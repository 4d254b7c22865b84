"""The inference API, called over real HTTP: auth, predictions on every digit, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import pytest
from conftest import clean_env, tt, tt_json
from sklearn.datasets import load_digits

from tensorturn import tokens
from tensorturn.local import free_port, stop_process_group
from tensorturn.store import open_store
from tensorturn.tokens import TokenChecker


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One fused and one ensemble digits run into one store, and an API token for it."""
    work = tmp_path_factory.mktemp("serve")
    store = str(work / "store")
    fused = tt_json("run", "--recipe", "digits-mlp", "--local-workers", "2", "--store", store,
                    "--json", cwd=work)
    ensemble = tt_json("run", "--mode", "ensemble", "--recipe", "digits-mlp", "--members", "3",
                       "--local-workers", "2", "--store", store, "--json", cwd=work)
    token = tt_json("token", "create", "--name", "tests", "--store", store, "--json")
    assert fused["state"] == ensemble["state"] == "succeeded"
    return store, fused, ensemble, token


class Server:
    def __init__(self, store: str, run_id: str, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorturn", "serve", run_id, "--store", store, "--host",
             "127.0.0.1", "--port", str(self.port), *extra],
            env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, self.proc.stdout.read()
            time.sleep(0.1)
        stop_process_group(self.proc, grace=10)
        raise AssertionError("the API did not come up")

    def stop(self) -> str:
        stop_process_group(self.proc, grace=10)
        return self.proc.stdout.read()


@pytest.fixture(scope="module")
def fused_api(runs):
    store, fused, _, _ = runs
    server = Server(store, fused["run_id"], "--name", "digits", "--max-body-mb", "2")
    yield server
    log = server.stop()
    assert runs[3]["token"] not in log  # tokens never reach the log


def infer_body(x, members=False):
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.flatten().tolist()}]}
    if members:
        body["parameters"] = {"members": True}
    return body


def bearer(token):
    return {"Authorization": f"Bearer {token}"}


def accuracy(url, name, token, members=False):
    x, y = load_digits(return_X_y=True)
    r = httpx.post(f"{url}/v2/models/{name}/infer", json=infer_body(x, members),
                   headers=bearer(token), timeout=60)
    assert r.status_code == 200, r.text
    out = {o["name"]: o for o in r.json()["outputs"]}
    labels = out["label"]["data"]
    assert out["label"]["shape"] == [1797] and out["probabilities"]["shape"] == [1797, 10]
    return sum(int(a == b) for a, b in zip(labels, y)) / len(y), out


@pytest.mark.e2e
def test_health_is_open_and_models_need_a_token(fused_api, runs):
    run_id, token = runs[1]["run_id"], runs[3]["token"]
    assert httpx.get(f"{fused_api.url}/v2/health/live").json() == {"live": True}
    for path in (f"/v2/models/{run_id}", f"/v2/models/{run_id}/infer"):
        method = httpx.get if path.endswith(run_id) else httpx.post
        assert method(f"{fused_api.url}{path}").status_code == 401
        assert method(f"{fused_api.url}{path}", headers=bearer("tt_wrong")).status_code == 401
        assert method(f"{fused_api.url}{path}", headers={"Authorization": token}).status_code == 401
    meta = httpx.get(f"{fused_api.url}/v2/models/digits", headers=bearer(token)).json()
    assert meta["inputs"][0]["shape"] == [-1, 64]
    assert meta["parameters"]["mode"] == "fused" and meta["parameters"]["run_id"] == run_id


@pytest.mark.e2e
def test_fused_model_labels_all_digits(fused_api, runs):
    acc, _ = accuracy(fused_api.url, runs[1]["run_id"], runs[3]["token"])
    assert acc >= 0.95


@pytest.mark.e2e
def test_ensemble_votes_over_http(runs):
    store, _, ensemble, token = runs
    server = Server(store, ensemble["run_id"])
    try:
        acc, out = accuracy(server.url, ensemble["run_id"], token["token"], members=True)
        assert acc >= 0.95
        member_outputs = [k for k in out if k.startswith("member_")]
        assert len(member_outputs) == 3
        meta = httpx.get(f"{server.url}/v2/models/{ensemble['run_id']}",
                         headers=bearer(token["token"])).json()
        assert meta["parameters"]["mode"] == "ensemble" and meta["parameters"]["vote"] == "soft"
    finally:
        server.stop()


@pytest.mark.e2e
@pytest.mark.parametrize("body,status,words", [
    ({"inputs": [{"name": "input", "shape": [1, 63], "datatype": "FP32", "data": [0] * 63}]},
     400, "does not fit this model"),
    ({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "BYTES", "data": ["a"] * 64}]},
     400, "unsupported datatype"),
    ({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32", "data": [0] * 60}]},
     400, "must hold 64 numbers"),
    ({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                  "data": ["x"] + [0] * 63}]}, 400, "numbers only"),
    ({"inputs": []}, 400, "non-empty 'inputs'"),
    ([1, 2, 3], 400, "JSON object"),
])
def test_bad_input_is_a_4xx_that_says_what_is_wrong(fused_api, runs, body, status, words):
    r = httpx.post(f"{fused_api.url}/v2/models/digits/infer", json=body,
                   headers=bearer(runs[3]["token"]))
    assert r.status_code == status and words in r.json()["error"]
    assert httpx.get(f"{fused_api.url}/v2/health/ready").status_code == 200  # still serving


@pytest.mark.e2e
def test_non_finite_oversized_and_malformed_bodies(fused_api, runs):
    headers = {**bearer(runs[3]["token"]), "Content-Type": "application/json"}
    url = f"{fused_api.url}/v2/models/digits/infer"
    nan = json.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                                  "data": [float("nan")] + [0] * 63}]})  # Python writes NaN
    r = httpx.post(url, content=nan, headers=headers)
    assert r.status_code == 400 and "non-finite" in r.json()["error"]
    r = httpx.post(url, content=b"{not json", headers=headers)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    big = b'{"inputs": [' + b" " * (3 * 1024 * 1024) + b"]}"  # over --max-body-mb 2
    r = httpx.post(url, content=big, headers=headers)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]
    r = httpx.post(f"{fused_api.url}/v2/models/other/infer", json={}, headers=headers)
    assert r.status_code == 404
    assert httpx.get(f"{fused_api.url}/v2/health/live").status_code == 200


@pytest.mark.e2e
def test_token_list_and_revoke(fused_api, runs):
    store = runs[0]
    extra = tt_json("token", "create", "--name", "temp", "--store", store, "--json")
    listed = tt_json("token", "list", "--store", store, "--json")
    assert {t["name"] for t in listed} >= {"tests", "temp"}
    assert all("sha256" not in t and "token" not in t for t in listed)
    url = f"{fused_api.url}/v2/models/digits"
    assert httpx.get(url, headers=bearer(extra["token"])).status_code == 200
    assert tt("token", "revoke", "temp", "--store", store).returncode == 0
    deadline = time.monotonic() + 120  # the server re-reads the token list every 2 s
    while time.monotonic() < deadline:
        if httpx.get(url, headers=bearer(extra["token"])).status_code == 401:
            break
        time.sleep(0.1)
    assert httpx.get(url, headers=bearer(extra["token"])).status_code == 401
    assert httpx.get(url, headers=bearer(runs[3]["token"])).status_code == 200
    missing = tt("token", "revoke", "nope", "--store", store)
    assert missing.returncode == 2 and "no token" in missing.stderr


def test_serving_a_run_that_does_not_exist_is_one_clear_error(tmp_path):
    proc = tt("serve", "nope", "--store", str(tmp_path), "--port", str(free_port()))
    assert proc.returncode != 0 and "no run 'nope'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_token_created_right_after_a_check_works_on_its_first_request(tmp_path):
    store = open_store(tmp_path.as_uri())
    check = TokenChecker(store)
    first, _ = tokens.create(store, "first")
    assert check(first)                    # this read the list
    second, _ = tokens.create(store, "second")
    assert check(second)                   # a miss right after a read waits its turn, re-reads
    assert not check("tt_" + "x" * 43)
    tokens.revoke(store, "first")
    check.ttl_s = 0.0                      # (the server re-reads every 2 s)
    assert not check(first) and check(second)
