"""Small holes an attack pass found (issue 26, item 16): `--json` that was not JSON, a NaN model
served as if healthy, a request id echoed back however long, `up` broken by the join file the
README says to export, and a refused start request that still wrote to the broker."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys

import pytest
from conftest import clean_env, tt_here, tt_many

from tensorturn import config, layout
from tensorturn.pool.celery_app import configure
from tensorturn.pool.embedded import free_port, stop_process_group
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import redis_client
from tensorturn.trust import PoolKey


def strict_json(text: str):
    """``text`` parsed as JSON proper: NaN, Infinity and -Infinity are not JSON."""
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


# ---- (a) every --json is strict JSON --------------------------------------------------------------

def test_status_json_of_a_run_with_nan_metrics_is_strict_json(redis_server, tmp_path):
    spec = RunSpec.create("fused", "digits-mlp", (tmp_path / "store").as_uri(), rounds=1)
    board = RunBoard(redis_client(redis_server.url))
    board.create(spec)
    board.record_round(spec.run_id, 0, {"round": 0, "loss": float("nan"), "val_loss": float("inf"),
                                        "bytes": 0})
    board.finish(spec.run_id, "succeeded", metrics={"test_loss": float("nan"),
                                                    "test_accuracy": float("-inf")})
    proc = tt_here("status", spec.run_id, "--json", "--broker", redis_server.url,
                   "--store", str(tmp_path / "store"))
    assert proc.returncode == 0, proc.stderr
    doc = strict_json(proc.stdout)
    assert doc["metrics"] == {"test_loss": None, "test_accuracy": None}
    assert doc["rounds"][0]["loss"] is None and doc["rounds"][0]["val_loss"] is None


def test_emit_json_turns_every_non_finite_number_into_null(capsys):
    from tensorturn.cli import emit_json

    emit_json({"a": [1.0, float("nan"), {"b": (float("inf"), 2)}], "c": "NaN", "d": None})
    assert strict_json(capsys.readouterr().out) == {"a": [1.0, None, {"b": [None, 2]}],
                                                    "c": "NaN", "d": None}


# ---- (b) a model with non-finite weights is not served ----------------------------------------------

def nan_model(store_dir, run_id: str, member_models: int = 0) -> None:
    """A signed, 'succeeded' digits-mlp run whose model holds a NaN weight (a run that diverged
    before the outer step learned to refuse it); ``member_models``: an ensemble of that many."""
    import torch

    from tensorturn import trust
    from tensorturn.recipes import resolve
    from tensorturn.store.objects import open_store, sha256_hex
    from tensorturn.store.tensors import ensemble_bytes, model_metadata, to_bytes

    recipe = resolve("digits-mlp")
    cfg = recipe.default_config()
    state = {k: v.clone() for k, v in recipe.model(cfg).state_dict().items()}
    first = next(iter(state))
    bad = {**state, first: torch.full_like(state[first], float("nan"))}
    store = open_store(store_dir.as_uri())
    if member_models:
        members = [(m, {k: v.clone() for k, v in (state if m == 0 else bad).items()}, cfg)
                   for m in range(member_models)]
        data, mode, final = ensemble_bytes(members, "digits-mlp", "soft"), "ensemble", "final_ensemble"
    else:
        data, mode, final = to_bytes(bad, model_metadata("digits-mlp", cfg)), "fused", "final_model"
    store.put_bytes(layout.key(final, run_id), data)
    store.put_json(layout.key("manifest", run_id), trust.pool_key().sign_doc("manifest", {
        "run_id": run_id, "mode": mode, "state": "succeeded", "recipe": "digits-mlp",
        "model_uri": "x", "model_sha256": sha256_hex(data)}))


NAN_MEMBERS = {0: "run diverged is not served: weight 0.weight holds NaN or infinite values",
               3: "run diverged is not served: member 1's weight 0.weight holds NaN or infinite values"}


@pytest.fixture(scope="module")
def served_nan_models(tmp_path_factory):
    """`serve` of a diverged fused model and of a diverged ensemble (3 members), both at once
    (each loads torch): members → its answer."""
    work = tmp_path_factory.mktemp("nan")
    for members in NAN_MEMBERS:
        nan_model(work / f"store-{members}", "diverged", members)
    with socket.socket() as holder:  # were it not refused, binding would fail rather than serve
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = str(holder.getsockname()[1])
        answers = tt_many(*(("serve", "diverged", "--store", str(work / f"store-{members}"), "--port", port)
                            for members in NAN_MEMBERS))
    return dict(zip(NAN_MEMBERS, answers))


@pytest.mark.parametrize("members, expected", list(NAN_MEMBERS.items()))
def test_a_model_with_nan_weights_is_refused_in_one_line(served_nan_models, members, expected):
    proc = served_nan_models[members]
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {expected} (the run diverged)"]


# ---- (c) a request id is a label, not a payload --------------------------------------------------

def test_a_request_id_longer_than_the_cap_is_a_400():
    from tensorturn.serve.protocol import MAX_ID_CHARS, BadRequest, parse_request

    def body(request_id: str) -> bytes:
        return json.dumps({"id": request_id, "inputs": [
            {"name": "input", "shape": [1, 2], "datatype": "FP32", "data": [0.0, 1.0]}]}).encode()

    assert parse_request(body("x" * MAX_ID_CHARS), [2], 10).id == "x" * MAX_ID_CHARS
    with pytest.raises(BadRequest) as refused:
        parse_request(body("x" * 3_000_000), [2], 10)
    assert refused.value.status == 400
    assert refused.value.message == f"'id' is 3,000,000 characters; at most {MAX_ID_CHARS} are echoed back"


# ---- (d) `up` with the README's exported join file -----------------------------------------------

def start_up(tmp_path, port: int) -> subprocess.Popen:
    """`tensorturn up` in ``tmp_path`` with TENSORTURN_JOIN_FILE exported as the README says."""
    return subprocess.Popen(
        [sys.executable, "-m", "tensorturn", "up", "--port", str(port), "--bind", "127.0.0.1",
         "--store", str(tmp_path / "store")],
        env=clean_env(TENSORTURN_JOIN_FILE=".tensorturn/join"), cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        start_new_session=True)


def test_up_works_with_the_join_file_exported_before_and_after_it_exists(tmp_path):
    port = free_port()
    for start in ("first", "again"):  # no join file yet; then the one the first `up` wrote
        proc = start_up(tmp_path, port)
        try:
            line = proc.stdout.readline()  # the banner's command for each machine
            assert line.strip() == "tensorturn agent --join-file join --name NAME", (
                start, proc.stderr.read() if proc.poll() is not None else "")
            assert (tmp_path / ".tensorturn" / "join").read_text().startswith("tt1.")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 0
        finally:
            stop_process_group(proc, grace=5)


# ---- (e) a refused start request writes nothing but its refusal ---------------------------------

def test_an_unsigned_or_forged_start_request_writes_only_its_refusal(redis_server, tmp_path):
    from tensorturn.tasks.start import start_run

    configure(redis_server.url)
    r = redis_client(redis_server.url)
    store_url = (tmp_path / "store").as_uri()
    config.use(config.current().with_(store_url=store_url))
    doc = RunSpec.create("fused", "digits-mlp", store_url, rounds=1, shards=2, sync_every=5).to_json()
    before = set(r.keys("*"))
    start_run.apply(args=[doc]).get()                                    # its signature left out
    start_run.apply(args=[doc], kwargs={"sig": PoolKey.generate().sign("submit", doc)}).get()
    written = set(r.keys("*")) - before
    assert written and all(k.startswith(layout.REFUSED) for k in written), written
    assert r.keys(layout.run_key(doc["run_id"], "*")) == []
    assert [json.loads(e)["task"] for e in r.lrange(layout.REFUSED, 0, -1)] == ["tensorturn.start_run"] * 2
    assert not (tmp_path / "store").exists()


def test_a_start_request_replayed_after_its_run_left_the_broker_starts_nothing(redis_server, tmp_path):
    """Its signature still verifies, and the broker no longer knows the run (its keys expired,
    or were deleted): the run's spec in the store says it started once already."""
    from tensorturn import runs, trust
    from tensorturn.store.objects import open_store
    from tensorturn.tasks.start import start_run

    configure(redis_server.url)
    r = redis_client(redis_server.url)
    store_url = (tmp_path / "store").as_uri()
    config.use(config.current().with_(store_url=store_url))
    spec = RunSpec.create("fused", "digits-mlp", store_url, rounds=1, shards=2, sync_every=5)
    doc = spec.to_json()
    request = {"sig": trust.pool_key().sign("submit", doc)}  # as the submitter sent it
    runs.submit(spec, redis_server.url)
    stored = sorted(open_store(store_url).list(layout.RUNS))
    r.flushdb()
    start_run.apply(args=[doc], kwargs=request).get()
    assert [json.loads(e)["reason"] for e in r.lrange(layout.REFUSED, 0, -1)] == [
        "this run exists in the store already (a replayed request?)"]
    assert r.keys(layout.run_key(spec.run_id, "*")) == [] and not r.exists(layout.run_key(spec.run_id))
    assert sorted(open_store(store_url).list(layout.RUNS)) == stored
