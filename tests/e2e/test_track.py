"""Experiment trackers: a fused and an ensemble run on a pool of real agents, each tracked by
`tensorturn run --track` to MLflow, TensorBoard and W&B (offline), read back with each library's
own reader; `tensorturn track RUN` logs a finished run again without logging a round twice."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import struct
import sys
import time

import pytest
from conftest import clean_env, tt, tt_here, tt_many

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tracked(pool, tmp_path_factory):
    """One fused and one ensemble run, side by side on the module's pool, both tracked to all
    three trackers under a folder of their own: (description, that folder) by mode."""
    where = {mode: tmp_path_factory.mktemp(f"track-{mode}") for mode in ("fused", "ensemble")}
    common = ("--broker", pool.broker_url, "--store", pool.store_url, "--json", "--track", "mlflow",
              "--track", "tensorboard", "--track", "wandb")
    procs = tt_many(
        ("run", "--mode", "fused", "--recipe", "digits-mlp", "--rounds", "3", *common,
         "--track-dir", str(where["fused"])),
        ("run", "--mode", "ensemble", "--recipe", "digits-mlp", "--members", "2", "--segments", "1",
         "--segment-steps", "60", *common, "--track-dir", str(where["ensemble"])),
        envs=[_env()] * 2)
    out = {}
    for mode, proc in zip(where, procs):
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[mode] = (json.loads(proc.stdout), where[mode])
    return out


def _env() -> dict[str, str]:
    env = clean_env()
    for key in [k for k in env if k.startswith(("WANDB_", "MLFLOW_"))]:
        del env[key]  # the trackers' defaults: everything on this machine
    return env


def mlflow_run(folder, run_id):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("tensorturn")
    found = client.search_runs([experiment.experiment_id], f"tags.`tensorturn.run_id` = '{run_id}'")
    assert len(found) == 1
    return client, found[0]


def events(folder, run_id):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder / "runs" / run_id), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def wandb_records(folder):
    """The records of the one offline W&B run under ``folder``, parsed with wandb's own protobuf
    messages. wandb (0.31) has no Python reader of an offline run's file (its Go core writes and
    syncs it): the file is a LevelDB-style log — a 7-byte header, 32 KiB blocks of chunks with a
    7-byte head each (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(folder / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    records, pos, chunk = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        chunk += data[pos:pos + n]
        pos += n
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            records.append(record)
            chunk = b""
    return records


def test_fused_rounds_read_back_from_mlflow(tracked):
    doc, folder = tracked["fused"]
    client, run = mlflow_run(folder, doc["run_id"])
    for name, key in (("train/loss", "loss"), ("val/loss", "val_loss"), ("val/accuracy", "val_accuracy"),
                      ("samples", "samples"), ("bytes/up", "bytes_up")):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        assert history == [(r["round"], r[key]) for r in doc["rounds"]], name
    assert {k for k in run.data.metrics if k.startswith("rate/")}  # each machine's samples/s
    assert run.data.metrics["final/test_accuracy"] == doc["metrics"]["test_accuracy"]
    assert run.data.params["mode"] == "fused" and run.data.params["option.rounds"] == "3"
    # what the run used where the user gave nothing: the recipe's lr and batch, the data's H
    used = doc["spec"]["run_config"]
    assert [run.data.params[k] for k in ("lr", "batch_size", "option.sync_every")] == [
        str(used["lr"]), str(used["batch_size"]), str(used["sync_every"])]
    assert "None" not in run.data.params.values()
    assert run.info.status == "FINISHED"
    # the model as an MLflow model: its weights the run's own file, nothing pickled
    path = client.download_artifacts(run.info.run_id, "model/artifacts/tensorturn/tensorturn.safetensors",
                                     str(folder / "dl"))
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == doc["model_sha256"]
    assert run.data.tags["tensorturn.model_uri"] == doc["model_uri"]
    files = artifact_paths(client, run.info.run_id, "model")
    assert {"model/MLmodel", "model/mlflow_model.py", "model/requirements.txt"} <= files
    assert not [f for f in files if f.endswith((".pkl", ".pickle", ".pt", ".pth"))]


def artifact_paths(client, run_id, under):
    out = set()
    for info in client.list_artifacts(run_id, under):
        out |= artifact_paths(client, run_id, info.path) if info.is_dir else {info.path}
    return out


def test_the_logged_model_predicts_what_serve_answers(tracked, pool, monkeypatch):
    """`mlflow.pyfunc.load_model("runs:/<id>/model")`, MLflow's own loader, answers what
    `tensorturn serve` answers over HTTP for the same run: the fused model, and the ensemble's
    vote and members."""
    import httpx
    import mlflow.pyfunc
    import numpy as np
    from conftest import Server, bearer, tt_json
    from sklearn.datasets import load_digits

    x, _ = load_digits(return_X_y=True)
    x = x[:64].astype(np.float32)
    token = tt_json("token", "create", "--name", "mlflow", "--store", pool.store_url, "--json")["token"]
    for mode in ("fused", "ensemble"):
        doc, folder = tracked[mode]
        _, run = mlflow_run(folder, doc["run_id"])
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{folder / 'mlflow.db'}")
        model = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
        inputs = model.metadata.get_input_schema().inputs[0]
        assert inputs.shape == (-1, 64) and str(inputs.type) == "float32"
        predicted = model.predict(x, params={"members": True})
        server = Server(pool.store_url, doc["run_id"])
        try:
            r = httpx.post(f"{server.url}/v2/models/{doc['run_id']}/infer", headers=bearer(token), timeout=60,
                           json={"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                                             "data": x.flatten().tolist()}], "parameters": {"members": True}})
        finally:
            server.stop()
        assert r.status_code == 200, r.text
        served = {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in r.json()["outputs"]}
        assert sorted(predicted) == sorted(served), mode
        for key in served:
            assert np.array_equal(predicted[key], served[key].astype(predicted[key].dtype)), (mode, key)


def test_the_pinned_mlflow_server_reads_the_store_the_client_wrote(tracked, tmp_path):
    """The full `mlflow` of the version the extra pins (mlflow-skinny) serves the SQLite store the
    client wrote — no "out-of-date database schema" — and its REST API returns the run."""
    import subprocess
    from importlib.metadata import version

    import httpx

    from tensorturn.pool.embedded import free_port

    assert version("mlflow") == version("mlflow-skinny")  # one pin, client and server
    doc, folder = tracked["fused"]
    _, run = mlflow_run(folder, doc["run_id"])
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                             f"sqlite:///{folder / 'mlflow.db'}", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1"], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        got = None
        for _ in range(600):
            try:
                got = httpx.get(f"{url}/api/2.0/mlflow/runs/get", params={"run_id": run.info.run_id}, timeout=5)
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read()
                time.sleep(0.2)
        assert got is not None and got.status_code == 200, got.text if got is not None else "no answer"
        served = got.json()["run"]
        assert served["info"]["status"] == "FINISHED"
        assert {p["key"]: p["value"] for p in served["data"]["params"]}["mode"] == "fused"
        metrics = {m["key"]: m["value"] for m in served["data"]["metrics"]}
        assert metrics["final/test_accuracy"] == doc["metrics"]["test_accuracy"]
        assert httpx.get(url, timeout=10).status_code == 200  # the UI's page
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def test_fused_rounds_read_back_from_tensorboard(tracked):
    doc, folder = tracked["fused"]
    acc = events(folder, doc["run_id"])
    for tag, key in (("train/loss", "loss"), ("val/loss", "val_loss"), ("bytes/down", "bytes_down")):
        scalars = [(e.step, e.value) for e in acc.Scalars(tag)]
        assert scalars == [(r["round"], pytest.approx(r[key], rel=1e-6)) for r in doc["rounds"]], tag
    (model,) = acc.Tensors("run/model/text_summary")
    assert doc["model_uri"] in model.tensor_proto.string_val[0].decode()
    assert "fused" in acc.Tensors("run/settings/text_summary")[0].tensor_proto.string_val[0].decode()
    # the settings in the HParams tab, numbers as numbers (so they sort and filter as such)
    hparams = hparams_of(acc)
    assert hparams["option.rounds"].number_value == 3 and hparams["mode"].string_value == "fused"
    assert hparams["lr"].number_value == doc["spec"]["run_config"]["lr"]


def hparams_of(acc):
    """The hparams a TensorBoard run's events declare, read as the HParams plugin reads them."""
    from tensorboard.plugins.hparams import plugin_data_pb2

    for content in acc.PluginTagToContent("hparams").values():
        data = plugin_data_pb2.HParamsPluginData.FromString(content)
        if data.HasField("session_start_info"):
            return data.session_start_info.hparams
    raise AssertionError("no hparams in the run's events")


def test_fused_rounds_in_the_offline_wandb_run(tracked):
    doc, folder = tracked["fused"]
    records = wandb_records(folder)
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]
    rounds = [h for h in history if "train/loss" in h]
    assert [(h["step"], h["train/loss"]) for h in rounds] == [(r["round"], r["loss"]) for r in doc["rounds"]]
    assert [h for h in history if h.get("final/test_accuracy") == doc["metrics"]["test_accuracy"]]
    (artifact,) = [r.artifact for r in records if r.WhichOneof("record_type") == "artifact"]
    assert artifact.type == "model" and [e.path for e in artifact.manifest.contents] == ["model.safetensors"]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == doc["run_id"]


def test_ensemble_members_and_vote_read_back(tracked):
    doc, folder = tracked["ensemble"]
    client, run = mlflow_run(folder, doc["run_id"])
    acc = events(folder, doc["run_id"])
    assert len(doc["members"]) == 2
    for member in doc["members"]:
        for key, value in member["metrics"].items():
            name = f"m{member['member']}/{key}"
            assert run.data.metrics[name] == value
            assert acc.Scalars(name)[-1].value == pytest.approx(value, rel=1e-6)
    for key in ("test_accuracy", "test_loss", "disagreement"):  # the vote's
        assert run.data.metrics[f"final/{key}"] == doc["metrics"][key]
        assert acc.Scalars(f"final/{key}")[-1].value == pytest.approx(doc["metrics"][key], rel=1e-6)
    assert run.data.params["mode"] == "ensemble" and run.data.params["option.members"] == "2"


def test_track_afterwards_logs_each_round_once(tracked, pool, tmp_path):
    """`tensorturn track RUN` into the folder `run --track` logged to adds nothing; into a new
    folder it logs the recorded rounds and end, as `--track` did."""
    from mlflow import MlflowClient

    from tensorturn.track import track_run

    doc, folder = tracked["fused"]
    proc = tt("track", doc["run_id"], "--to", "mlflow", "--to", "tensorboard", "--store", pool.store_url,
              "--track-dir", str(folder), "--json", env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    rounds = [r["round"] for r in doc["rounds"]]
    assert [(t["to"], t["rounds"], t["finished"]) for t in json.loads(proc.stdout)["trackers"]] == [
        ("mlflow", rounds, True), ("tensorboard", rounds, True)]
    client, run = mlflow_run(folder, doc["run_id"])
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == len(rounds)
    assert len(events(folder, doc["run_id"]).Scalars("train/loss")) == len(rounds)

    track_run(doc["run_id"], ["mlflow"], tmp_path, None, pool.store_url)  # as the command does, here
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    _, replayed = mlflow_run(tmp_path, doc["run_id"])
    assert sorted((m.step, m.value) for m in client.get_metric_history(replayed.info.run_id, "train/loss")) == [
        (r["round"], r["loss"]) for r in doc["rounds"]]
    assert replayed.data.metrics["final/test_loss"] == doc["metrics"]["test_loss"]


def test_a_missing_tracker_library_is_one_line_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed (imports of it fail)
    monkeypatch.chdir(tmp_path)
    proc = tt_here("run", "--mode", "fused", "--recipe", "digits-mlp", "--track", "wandb", env=_env())
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: --track wandb needs wandb, not installed here: "
                                   "pip install 'tensorturn[wandb]'")
    assert list(tmp_path.iterdir()) == []  # no pool, no store, no log


def test_track_with_detach_or_an_unknown_run_is_refused(tmp_path):
    proc = tt("run", "--mode", "fused", "--recipe", "digits-mlp", "--broker", "redis://127.0.0.1:1/0",
              "--detach", "--track", "mlflow", env=_env(), cwd=tmp_path)
    assert proc.returncode == 2 and "drop --detach" in proc.stderr and len(proc.stderr.splitlines()) == 1
    proc = tt("track", "20200101-000000-abcdef", "--to", "tensorboard", env=_env(), cwd=tmp_path)
    assert proc.returncode != 0 and "no run" in proc.stderr and not (tmp_path / "runs").exists()


def test_a_track_dir_that_is_a_file_is_one_line_before_anything_starts(tmp_path, monkeypatch):
    (tmp_path / "notes").write_text("mine")
    monkeypatch.chdir(tmp_path)
    for where in ("notes", "notes/logs"):
        proc = tt_here("run", "--mode", "fused", "--recipe", "digits-mlp", "--track", "tensorboard",
                       "--track-dir", where, env=_env())
        assert proc.returncode == 2
        assert proc.stderr.count("\n") == 1 and "is a file, not a folder" in proc.stderr, proc.stderr
    proc = tt_here("track", "20200101-000000-abcdef", "--to", "mlflow", "--track-dir", "notes", env=_env())
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: --track-dir notes is a file, not a folder: name a folder the trackers may write in")
    assert [p.name for p in tmp_path.iterdir()] == ["notes"]  # no pool, no store, no log


def test_track_in_a_run_file_or_track_dir_alone_is_one_line(tmp_path):
    import tensorturn
    from tensorturn.errors import SpecError

    (tmp_path / "run.toml").write_text('recipe = "digits-mlp"\ntrack = ["mlflow"]\n')
    proc = tt_here("run", "--config", str(tmp_path / "run.toml"), env=_env())
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert f"{tmp_path / 'run.toml'}: 'track' is how the run is logged, not what runs: give --track" in proc.stderr
    pool = tensorturn.Pool("redis://127.0.0.1:1/0", (tmp_path / "store").as_uri())  # never reached
    with pytest.raises(SpecError, match="track_dir is where trackers write: name them too"):
        pool.run(recipe="digits-mlp", track_dir=tmp_path)
    with pytest.raises(SpecError, match="unknown tracker 'neptune'"):
        pool.run(recipe="digits-mlp", track="neptune")


def test_secrets_in_options_are_masked_in_what_trackers_log(tmp_path):
    """A recipe option named like a secret is ``***`` and a URL's password masked, in every
    parameter a tracker logs (MLflow params, W&B config) and TensorBoard's settings table."""
    from tensorturn.track.base import params
    from tensorturn.track.to_tensorboard import TensorBoardTracker

    options = {"dataset": "https://bob:hunter2@data.example/rows.csv", "api_token": "tok-4f2a9c"}
    doc = {"run_id": "20200101-000000-abcdef", "mode": "fused", "recipe": "tabular",
           "spec": {"store_url": "s3://AKIA:s3cret-pw@minio.example:9000/bucket", "seed": 0,
                    "recipe_options": options, "options": {"rounds": 2},
                    "run_config": {"recipe": "tabular", "rounds": 2, "recipe_options": options}}}
    logged = params(doc)
    assert logged["recipe.api_token"] == "***" and "run_config" not in logged
    assert logged["recipe.dataset"] == "https://bob:***@data.example/rows.csv"
    assert logged["option.rounds"] == 2 and logged["store"].startswith("s3://AKIA:***@")
    for secret in ("hunter2", "tok-4f2a9c", "s3cret-pw"):
        assert [k for k, v in logged.items() if secret in str(v)] == [], secret
    tracker = TensorBoardTracker(tmp_path)
    tracker.start(doc["run_id"], logged)
    tracker.close()
    (table,) = events(tmp_path, doc["run_id"]).Tensors("run/settings/text_summary")
    text = table.tensor_proto.string_val[0].decode()
    assert "| recipe.api_token | *** |" in text and "tok-4f2a9c" not in text and "hunter2" not in text


def test_pool_run_tracks_like_the_command_and_a_tracker_that_cannot_start_is_dropped(
        pool, tmp_path, monkeypatch, caplog):
    """``Pool.run(track=..., track_dir=...)`` logs the run as ``--track`` does, as ``result()``
    follows it. A tracker that fails to start (TensorBoard, its disk full) is dropped with one
    warning and the run goes on. An asynchronous run's rounds carry each machine's samples/s
    (its updates train, not shards), and so does its report."""
    import tensorturn
    from tensorturn.runs.report import worker_stats
    from tensorturn.track.to_tensorboard import TensorBoardTracker

    def disk_full(self, run_id, params):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(TensorBoardTracker, "start", disk_full)
    for key in [k for k in os.environ if k.startswith(("WANDB_", "MLFLOW_"))]:
        monkeypatch.delenv(key)
    caplog.set_level(logging.INFO, logger="tensorturn.api")
    run = tensorturn.Pool.connect(broker=pool.broker_url, store=pool.store_url).run(
        recipe="digits-mlp", rounds=2, sync="async", track=["mlflow", "tensorboard"], track_dir=tmp_path)
    doc = run.result()
    assert doc["state"] == "succeeded"
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"warning: --track tensorboard stopped logging: OSError: [Errno 28] No space left on device "
        f"(the run goes on; `tensorturn track {doc['run_id']} --to tensorboard` logs it later)"]
    client, logged = mlflow_run(tmp_path, doc["run_id"])
    assert sorted(m.step for m in client.get_metric_history(logged.info.run_id, "train/loss")) == [0, 1]
    assert logged.data.metrics["final/test_accuracy"] == doc["metrics"]["test_accuracy"]
    assert logged.info.status == "FINISHED"
    assert "run_config" not in logged.data.params and logged.data.params["option.sync"] == "async"
    rates = {k for k in logged.data.metrics if k.startswith("rate/")}
    steps = {m.step for name in rates for m in client.get_metric_history(logged.info.run_id, name)}
    assert {0, 1} <= steps  # each round's, then the run's at the end
    stats = worker_stats(doc)
    assert stats and all(s["samples_per_s"] > 0 for s in stats)
    assert sum(s["samples"] for s in stats) >= sum(u["samples"] for u in doc["updates"]) > 0
    assert not (tmp_path / "runs").exists()  # TensorBoard never started
