"""`tensorturn export RUN DIR`: the folder, loaded back with no pool, predicts what the API serves;
its ONNX graph and the folder itself as a GPT-2 folder load in onnxruntime and transformers with
the same outputs; its card is one the Hugging Face Hub reads."""

from __future__ import annotations

import csv
import errno
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import TEST_POOL_KEY, Server, bearer, tt, tt_here, tt_here_json, tt_json_many
from sklearn.datasets import load_digits

import tensorturn.export
from tensorturn import layout
from tensorturn.errors import SpecError, TensorTurnError
from tensorturn.recipes import charlm
from tensorturn.store.objects import open_store, sha256_hex
from tensorturn.trust import UntrustedError

# over a text at a relative path, as a user names it: the folder must load where it is not
# the module's runs are real agent pools (its fixture): the end-to-end lane
pytestmark = pytest.mark.e2e

TINY_LM = ("--recipe", "charlm", "--recipe-option", "data=lm.txt", "--recipe-option", "n_layer=1",
           "--recipe-option", "context=16", "--rounds", "1", "--sync-every", "2", "--shards", "2",
           "--local-workers", "1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Into one store, side by side: a fused and an ensemble digits run, a tiny charlm; into a
    store of its own, a tabular run over a pushed table (a regression); an API token."""
    work = tmp_path_factory.mktemp("export")
    store, table_store = str(work / "store"), str(work / "tables")
    (work / "lm.txt").write_text(Path(charlm.__file__).read_text(encoding="utf-8"), encoding="utf-8")
    table = work / "houses.csv"
    rng = np.random.default_rng(0)
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["rooms", "area", "price"])
        for _ in range(300):
            rooms, area = int(rng.integers(1, 6)), float(rng.uniform(20, 200))
            w.writerow([rooms, round(area, 2), round(10 * rooms + 2 * area + rng.normal(), 3)])
    pushed = tt_here("data", "push", str(table), "--name", "houses", "--label", "price", "--store", table_store)
    assert pushed.returncode == 0, pushed.stderr
    fused, ensemble, lm, tabular = tt_json_many(
        ("run", "--recipe", "digits-mlp", "--rounds", "2", "--local-workers", "2", "--store", store, "--json"),
        ("run", "--mode", "ensemble", "--recipe", "digits-mlp", "--members", "2", "--local-workers", "2",
         "--store", store, "--json"),
        ("run", *TINY_LM, "--store", store, "--json"),
        ("run", "--recipe", "tabular", "--recipe-option", "dataset=houses", "--rounds", "1", "--local-workers", "1",
         "--store", table_store, "--json"), cwd=work)
    for doc in (fused, ensemble, lm, tabular):
        assert doc["state"] == "succeeded", doc.get("error")
    token = tt_here_json("token", "create", "--name", "tests", "--store", store, "--json")["token"]
    return {"work": work, "store": store, "table_store": table_store, "token": token,
            "fused": fused, "ensemble": ensemble, "lm": lm, "tabular": tabular}


@pytest.fixture(scope="module")
def folders(runs):
    """Each run exported (in this process: the command is thin and torch is loaded here), from
    the folder the runs ran in (where the language model's text is)."""
    out = runs["work"] / "exported"
    wanted = {"fused": ("--format", "onnx"), "ensemble": ("--format", "onnx"),
              "lm": ("--format", "transformers", "--format", "onnx"), "tabular": ()}
    done = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(runs["work"])
        for name, flags in wanted.items():
            store = runs["table_store"] if name == "tabular" else runs["store"]
            done[name] = tt_here_json("export", runs[name]["run_id"], str(out / name), *flags, "--store", store,
                                      "--json")
    return done


def test_the_folder_describes_the_model_and_how_it_was_trained(runs, folders):
    for name in ("fused", "ensemble"):
        run, result = runs[name], folders[name]
        folder = runs["work"] / "exported" / name
        assert sorted(result["files"]) == ["README.md", "model.onnx", "tensorturn.json", "tensorturn.safetensors"]
        config = json.loads((folder / "tensorturn.json").read_text())
        # the run's own model file: its sha256 is the run's
        assert config["model_sha256"] == result["model_sha256"] == run["model_sha256"]
        assert config["recipe"] == {"name": "digits-mlp", "options": {}}
        assert config["task"] == "classification" and config["input"]["shape"] == [64]
        assert [o["name"] for o in config["outputs"]] == ["label", "probabilities"]
        assert config["lineage"]["run_id"] == run["run_id"] and config["lineage"]["mode"] == name
        assert config["metrics"]["test_accuracy"] == run["metrics"]["test_accuracy"]
        assert config["run"]["mode"] == name and "store_url" not in config["run"]
        assert "store" not in config["lineage"] and runs["store"] not in json.dumps(config)
        card = (folder / "README.md").read_text()
        assert run["run_id"] in card and f"| mode | {name} |" in card
        assert f"| test_accuracy | {run['metrics']['test_accuracy']:.4g} |" in card
        assert "| machines | local" in card and "model bytes up / down" in card
        for part in folder.iterdir():  # nothing secret in the folder
            assert TEST_POOL_KEY.encode() not in part.read_bytes()
            assert runs["token"].encode() not in part.read_bytes()
    fused = json.loads((runs["work"] / "exported" / "fused" / "tensorturn.json").read_text())
    assert fused["model"] == {"kind": "single", "config": {"dropout": 0.1, "hidden": [256]}}
    assert "| rounds | 2 of 2 |" in (runs["work"] / "exported" / "fused" / "README.md").read_text()
    ensemble = json.loads((runs["work"] / "exported" / "ensemble" / "tensorturn.json").read_text())
    assert ensemble["model"]["kind"] == "ensemble" and ensemble["model"]["vote"] == "soft"
    assert [m["member"] for m in ensemble["model"]["members"]] == [0, 1]


def test_load_predicts_exactly_what_the_api_serves(runs, folders):
    """The fused model and the ensemble's vote (and each member), as `tensorturn serve` answers
    them over HTTP and as `tensorturn.load(DIR).predict` returns them: the same bits."""
    x, y = load_digits(return_X_y=True)
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.flatten().tolist()}],
            "parameters": {"members": True}}
    with ThreadPoolExecutor(2) as threads:
        servers = list(threads.map(lambda name: Server(runs["store"], runs[name]["run_id"]), ("fused", "ensemble")))
    try:
        for name, server in zip(("fused", "ensemble"), servers):
            r = httpx.post(f"{server.url}/v2/models/{runs[name]['run_id']}/infer", json=body,
                           headers=bearer(runs["token"]), timeout=60)
            assert r.status_code == 200, r.text
            served = {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in r.json()["outputs"]}
            model = tensorturn.load(runs["work"] / "exported" / name)
            predicted = model.predict(x, members=True)
            assert sorted(predicted) == sorted(served)
            assert np.array_equal(predicted["label"], served["label"])
            for key in served:  # float32 through JSON and back: exact
                assert np.array_equal(predicted[key], served[key].astype(predicted[key].dtype)), key
            assert (predicted["label"] == y).mean() > 0.8
    finally:
        for server in servers:
            server.stop()
    ensemble = tensorturn.export.load(runs["work"] / "exported" / "ensemble")
    assert len(ensemble.models) == 2
    with torch.no_grad():  # the module votes as the API does: softmax of its output is the mean probability
        probabilities = torch.softmax(ensemble.module(ensemble.recipe.preprocess(torch.from_numpy(x[:50]))), -1)
    assert np.allclose(probabilities.numpy(), ensemble.predict(x[:50])["probabilities"], atol=1e-6)


def test_the_onnx_graph_answers_as_the_api_in_onnxruntime(runs, folders):
    import onnxruntime

    x, _ = load_digits(return_X_y=True)
    x = x.astype(np.float32)
    for name in ("fused", "ensemble", "lm"):
        folder = runs["work"] / "exported" / name
        model = tensorturn.export.load(folder)
        rows = (np.random.default_rng(1).integers(0, len(model.config["vocabulary"]), (7, 16)).astype(np.float32)
                if name == "lm" else x)
        session = onnxruntime.InferenceSession(str(folder / "model.onnx"))
        assert [i.name for i in session.get_inputs()] == ["input"]
        meta = session.get_modelmeta().custom_metadata_map  # what reads the outputs, and whence
        assert json.loads(meta["tensorturn.recipe"])["name"] == model.config["recipe"]["name"]
        assert meta["tensorturn.run_id"] == runs[name]["run_id"] and meta["tensorturn.task"] == model.config["task"]
        assert json.loads(meta.get("tensorturn.classes", "null")) == model.config["classes"]
        label, probabilities = session.run(["label", "probabilities"], {"input": rows})
        expected = model.predict(rows)
        assert np.array_equal(label, expected["label"])
        assert np.allclose(probabilities, expected["probabilities"], atol=1e-5), name


def test_a_charlm_folder_is_one_transformers_loads_and_generates_from(runs, folders):
    """`AutoTokenizer`, `AutoModelForCausalLM` and `pipeline("text-generation")` on the exported
    folder itself: the tokenizer encodes the text as charlm does, the logits are the model's and
    greedy generation after a window is `tensorturn.load(DIR).predict`'s label."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    folder = runs["work"] / "exported" / "lm"
    model = tensorturn.load(folder)
    assert model.config["task"] == "language_model" and len(model.config["vocabulary"]) > 64
    files = set(folders["lm"]["files"])
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    text = (runs["work"] / "lm.txt").read_text(encoding="utf-8")
    windows = [text[i:i + 16] for i in range(0, 4000, 500)]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    rows = np.asarray(tokenizer(windows)["input_ids"])
    assert rows.tolist() == [model.recipe.encode(w).tolist() for w in windows]
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.from_numpy(rows)
    with torch.no_grad():
        theirs, ours = hf(ids).logits, model.module(ids)
    assert theirs.shape == ours.shape and torch.allclose(theirs, ours, atol=1e-4)
    served = model.predict(rows)  # next-character probabilities and label, as served
    assert np.allclose(torch.softmax(theirs[:, -1], -1).numpy(), served["probabilities"], atol=1e-5)
    generate = pipeline("text-generation", model=str(folder))
    for window, label in zip(windows, served["label"]):
        assert generate(window, max_new_tokens=1)[0]["generated_text"] == window + model.config["vocabulary"][label]


def test_the_card_is_one_the_hugging_face_hub_reads(runs, folders):
    from huggingface_hub import ModelCard

    lm = ModelCard.load(runs["work"] / "exported" / "lm" / "README.md")
    assert lm.data.library_name == "transformers" and lm.data.pipeline_tag == "text-generation"
    assert {"tensorturn", "charlm", "fused", "onnx"} <= set(lm.data.tags) and lm.data.license == "unknown"
    assert lm.data.metrics == ["accuracy", "loss"]
    tested = {r.metric_type: r.metric_value for r in lm.data.eval_results}
    assert tested == {"accuracy": runs["lm"]["metrics"]["test_accuracy"], "loss": runs["lm"]["metrics"]["test_loss"]}
    assert lm.text.startswith("\n# charlm — fused run") and "A language model trained with TensorTurn" in lm.text
    assert 'pipeline("text-generation", model="path/to/this/folder")' in lm.text
    digits = ModelCard.load(runs["work"] / "exported" / "ensemble" / "README.md")
    assert digits.data.library_name == "tensorturn" and digits.data.pipeline_tag == "tabular-classification"
    assert "A classification model trained with TensorTurn: a voting ensemble of 2 models" in digits.text
    assert 'tensorturn.load("path/to/this/folder")' in digits.text and "tensorturn.export.load" not in digits.text
    assert "`model.onnx` — the served computation as one ONNX graph" in digits.text


def test_a_pushed_datasets_model_loads_without_its_store(runs, folders):
    """tabular's preprocessing reads the dataset's statistics: the folder carries its index, so
    the model predicts with the store gone, exactly as it served from the store."""
    from tensorturn import config as settings
    from tensorturn.predictor import load_result

    run = runs["tabular"]
    rows = np.array([[3, 120.5], [1, 30.0], [5, 199.0]], np.float32)
    where = Path(runs["table_store"]).as_uri()
    settings.use(settings.current().with_(store_url=where))  # as `serve --store` does (reset after the test)
    served = load_result(open_store(where), run["run_id"])[0].serve_rows(rows)
    settings.reload()  # no store: the default ./tensorturn-store holds nothing
    config = json.loads((runs["work"] / "exported" / "tabular" / "tensorturn.json").read_text())
    assert config["lineage"]["data"]["dataset"] == "houses" and config["lineage"]["data"]["version"] == 1
    assert config["task"] == "regression" and [o["name"] for o in config["outputs"]] == ["prediction"]
    moved = runs["work"] / "tables-gone"
    shutil.move(runs["table_store"], moved)
    try:
        model = tensorturn.export.load(runs["work"] / "exported" / "tabular")
        assert np.array_equal(model.predict(rows)["prediction"], served.combined[..., 0])
    finally:
        shutil.move(moved, runs["table_store"])


def forget_texts_read() -> None:
    """charlm keeps the texts it read by path for the process: as a new process on another
    machine, nothing read here before counts."""
    for cache in (charlm.load_text, charlm._vocab, charlm._ids):
        cache.cache_clear()


def test_a_language_model_loads_anywhere_without_its_text(runs, folders, tmp_path, monkeypatch):
    """charlm's vocabulary is its text's characters: the folder carries it, so the model loads in
    another folder with no text there (nor, for the built-in corpus, the run's Python) and
    predicts what the run's model serves."""
    from tensorturn.predictor import load_result

    folder = runs["work"] / "exported" / "lm"
    config = json.loads((folder / "tensorturn.json").read_text())
    text = (runs["work"] / "lm.txt").read_text(encoding="utf-8")
    assert config["vocabulary"] == sorted(set(text))
    assert config["recipe"]["standalone_options"] == {"vocabulary": config["vocabulary"]}
    rows = np.random.default_rng(3).integers(0, len(config["vocabulary"]), (5, 16)).astype(np.float32)
    monkeypatch.chdir(runs["work"])  # the model as the store serves it, where its text is
    served = load_result(open_store(Path(runs["store"]).as_uri()), runs["lm"]["run_id"])[0].serve_rows(rows)
    moved = tmp_path / "elsewhere" / "lm"
    shutil.copytree(folder, moved)
    monkeypatch.chdir(tmp_path)
    forget_texts_read()
    model = tensorturn.export.load(moved)
    assert np.array_equal(model.predict(rows)["probabilities"], served.combined)
    assert model.recipe.vocab() == config["vocabulary"] and not (tmp_path / "lm.txt").exists()


def test_export_reads_a_relative_data_path_from_the_current_folder(runs, folders, tmp_path, monkeypatch):
    """Where the run's text is not at the path its options name, export says so in one line and
    writes nothing; where it is, export works from any folder."""
    lm, store = runs["lm"]["run_id"], runs["store"]
    monkeypatch.chdir(tmp_path)
    forget_texts_read()
    proc = tt_here("export", lm, str(tmp_path / "lm"), "--store", store)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "No such file or directory: lm.txt" in proc.stderr and "export where the run's data is" in proc.stderr
    assert list(tmp_path.iterdir()) == []
    shutil.copy(runs["work"] / "lm.txt", tmp_path / "lm.txt")
    tt_here_json("export", lm, str(tmp_path / "lm"), "--store", store, "--json")
    exported = json.loads((tmp_path / "lm" / "tensorturn.json").read_text())
    assert exported["recipe"]["standalone_options"] == folders_config(runs, "lm")["recipe"]["standalone_options"]


def folders_config(runs, name):
    return json.loads((runs["work"] / "exported" / name / "tensorturn.json").read_text())


def test_config_and_card_hold_no_secret_of_the_run(runs, folders):
    """What is written for people is ``config.public``: a secret-named option's value is ***, a URL's
    password masked, the rest exact; a model file whose own options hold a secret is not exported."""
    from tensorturn.export.folder import check_no_secret, describe, texts
    from tensorturn.state.manifest import read_manifest
    from tensorturn.store.tensors import metadata_of

    manifest = read_manifest(open_store(Path(runs["store"]).as_uri()), runs["fused"]["run_id"])
    url = "s3://AKIAEXAMPLE:pw-SECRET-1@minio.local:9000/bucket?X-Amz-Signature=SECRET-3"
    options = {"api_token": "tok-SECRET-2", "source": url, "hidden": [256], "data": "notes.txt"}
    manifest["spec"].update(store_url=url, recipe_options=options,
                            run_config={**manifest["spec"]["run_config"], "store": url, "recipe_options": options})
    model = tensorturn.export.load(runs["work"] / "exported" / "fused")
    data = (runs["work"] / "exported" / "fused" / "tensorturn.safetensors").read_bytes()
    doc = describe(model.predictor, manifest, metadata_of(data), None)
    written = texts(doc, manifest)
    for name, text in written.items():
        assert "SECRET" not in text and "pw-" not in text, name
    assert doc["recipe"]["options"] == {"api_token": "***", "hidden": [256], "data": "notes.txt",
                                        "source": "s3://AKIAEXAMPLE:***@minio.local:9000/bucket?X-Amz-Signature=***"}
    assert '"api_token": "***"' in written["README.md"] and "`notes.txt`" in written["README.md"]
    with pytest.raises(SpecError, match=r"option 'api_token' holds a secret") as refused:
        check_no_secret({"recipe_options": json.dumps({"api_token": "tok-SECRET-2", "n_layer": 1})}, "r")
    assert "SECRET" not in str(refused.value)
    with pytest.raises(SpecError, match=r"option 'source' holds a secret"):
        check_no_secret({"recipe_options": json.dumps({"source": url})}, "r")
    check_no_secret(metadata_of(data), "r")  # digits-mlp's: nothing secret


def test_the_card_describes_the_kept_round(runs, folders):
    """The card's figures are those of the round whose weights were exported: the last, or with
    ``--keep best`` an earlier one (``metrics.kept_round``)."""
    from tensorturn.export import card
    from tensorturn.state.manifest import read_manifest

    manifest = read_manifest(open_store(Path(runs["store"]).as_uri()), runs["fused"]["run_id"])
    first, last = manifest["rounds"]
    assert manifest["metrics"]["kept_round"] == 1
    written = (runs["work"] / "exported" / "fused" / "README.md").read_text()
    assert f"Round 1, the last, is the exported model: train loss {last['loss']:.4g}" in written
    best = {**manifest, "metrics": {**manifest["metrics"], "kept_round": 0}}  # as --keep best records it
    text = card.model_card(folders_config(runs, "fused"), best)
    assert (f"Round 0, kept by `--keep best` (lowest validation loss; the run's last was round 1), is the "
            f"exported model: train loss {first['loss']:.4g}, validation loss {first['val_loss']:.4g}") in text
    assert f"train loss {last['loss']:.4g}" not in text


def test_export_into_a_folder_it_cannot_write_is_one_line_and_leaves_nothing(runs, folders, tmp_path, monkeypatch):
    store, fused = runs["store"], runs["fused"]["run_id"]
    (tmp_path / "a-file").write_text("mine")
    proc = tt_here("export", fused, str(tmp_path / "a-file" / "sub" / "model"), "--store", store)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "cannot write" in proc.stderr and "Not a directory" in proc.stderr and "Traceback" not in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"] and (tmp_path / "a-file").read_text() == "mine"
    # the disk fills while the folder is written: its temporary folder and the parents made for it go
    write_text = Path.write_text

    def disk_full(self, *args, **kwargs):
        if self.name == "README.md":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return write_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", disk_full)
    proc = tt_here("export", fused, str(tmp_path / "new" / "deeper" / "model"), "--store", store)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "No space left on device" in proc.stderr and "nothing was written" in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_export_refuses_what_it_cannot_write_in_one_line_and_writes_nothing(runs, folders, tmp_path):
    store, fused = runs["store"], runs["fused"]["run_id"]
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    proc = tt_here("export", fused, str(taken), "--store", store)
    assert proc.returncode == 2 and "is not empty" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert [p.name for p in taken.iterdir()] == ["notes.txt"]
    # a format the model does not map to: nothing left behind
    proc = tt_here("export", fused, str(tmp_path / "gpt"), "--format", "transformers", "--store", store)
    assert proc.returncode == 2 and "not charlm's GPT" in proc.stderr
    assert not (tmp_path / "gpt").exists() and not list(tmp_path.glob(".gpt.*"))
    proc = tt_here("export", runs["ensemble"]["run_id"], str(tmp_path / "e"), "--format", "transformers",
                   "--store", store)
    assert proc.returncode == 2 and "ensemble of 2" in proc.stderr
    proc = tt_here("export", "20990101-000000-abcdef", str(tmp_path / "x"), "--store", store)
    assert proc.returncode == 2 and "no run '20990101-000000-abcdef'" in proc.stderr
    # runs that did not succeed, as their manifests record them
    files = open_store((tmp_path / "store").as_uri())
    for run_id, state in (("20990101-000000-aaaaaa", "running"), ("20990101-000000-bbbbbb", "failed")):
        files.put_json(layout.key("manifest", run_id), {"run_id": run_id, "state": state})
        proc = tt_here("export", run_id, str(tmp_path / run_id), "--store", str(tmp_path / "store"))
        said = "is running" if state == "running" else "failed"
        assert proc.returncode == 2 and f"run {run_id} {said}" in proc.stderr
        assert not (tmp_path / run_id).exists()


def test_export_writes_nothing_outside_dir_whatever_the_dataset_index_holds(runs, folders, tmp_path):
    """Once, the folder's copy of the dataset index was put at a path made of the stored
    index's own ``name``: a store writer's ``../../../../elsewhere/escaped`` made `export` (exit 0)
    write ``elsewhere/escaped/v0001.json``, outside DIR. Every path now comes from the run's
    signed spec, and the index is checked against the sha256 the run pinned when it started."""
    from tensorturn import trust

    store = tmp_path / "store"
    shutil.copytree(runs["table_store"], store)
    run_id, index_file = runs["tabular"]["run_id"], store / "datasets" / "houses" / "v0001.json"
    honest = index_file.read_bytes()
    index = json.loads(honest)
    out = tmp_path / "out"
    # a name that climbs out of DIR (the index's own name, not its key)
    index_file.write_text(json.dumps({**index, "name": "../../../../elsewhere/escaped"}))
    proc = tt_here("export", run_id, str(out / "model"), "--store", str(store))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert ("the index of dataset 'houses' version 1 (datasets/houses/v0001.json) names dataset "
            "'../../../../elsewhere/escaped'" in proc.stderr), proc.stderr
    assert not (tmp_path / "elsewhere").exists() and not out.exists()
    # the name kept, the chunks changed (validation's for training's): not the index the run read
    index_file.write_text(json.dumps({**index, "splits": {**index["splits"], "train": index["splits"]["val"]}}))
    proc = tt_here("export", run_id, str(out / "model"), "--store", str(store))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "the dataset index datasets/houses/v0001.json is not the one the run read when it started" in proc.stderr
    assert not out.exists()
    # a run from before runs pinned their index (its signed manifest without the pin) still exports,
    # its index checked to name its own dataset and version
    index_file.write_bytes(honest)
    manifest_key = layout.key("manifest", run_id)
    files = open_store(store.as_uri())
    manifest = trust.pool_key().check_doc("manifest", files.get_json(manifest_key), "manifest")
    assert manifest["spec"]["datasets"] == {"datasets/houses/v0001.json": sha256_hex(honest)}
    del manifest["spec"]["datasets"]
    files.put_json(manifest_key, trust.pool_key().sign_doc("manifest", manifest))
    done = tt_here_json("export", run_id, str(out / "old"), "--store", str(store), "--json")
    assert "dataset/datasets/houses/v0001.json" in done["files"]
    index_file.write_text(json.dumps({**index, "name": "../../../../elsewhere/escaped"}))
    proc = tt_here("export", run_id, str(out / "model"), "--store", str(store))
    assert proc.returncode == 2 and "names dataset '../../../../elsewhere/escaped'" in proc.stderr
    assert not (tmp_path / "elsewhere").exists() and sorted(p.name for p in out.iterdir()) == ["old"]


def test_the_command_runs_as_a_user_runs_it(runs, folders, tmp_path):
    proc = tt("export", runs["fused"]["run_id"], str(tmp_path / "cli"), "--store", runs["store"])
    assert proc.returncode == 0, proc.stderr
    assert f"exported run {runs['fused']['run_id']}" in proc.stdout and "tensorturn.safetensors" in proc.stdout
    assert proc.stderr == ""
    assert "tensorturn.safetensors" in tt("export", "--help").stdout


def test_load_refuses_a_folder_that_is_not_an_export_or_was_changed(runs, folders, tmp_path):
    with pytest.raises(TensorTurnError, match="not a folder"):
        tensorturn.export.load(tmp_path / "nothing")
    with pytest.raises(TensorTurnError, match="holds no tensorturn.json"):
        tensorturn.export.load(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(runs["work"] / "exported" / "fused", copy)
    model = tensorturn.export.load(copy)
    with pytest.raises(SpecError, match=r"do not fit this model: expected \[N, 64\]"):
        model.predict(np.zeros((2, 63)))
    with pytest.raises(SpecError, match="non-finite"):
        model.predict(np.full((1, 64), np.nan))
    data = bytearray((copy / "tensorturn.safetensors").read_bytes())
    data[-1] ^= 1
    (copy / "tensorturn.safetensors").write_bytes(bytes(data))
    with pytest.raises(UntrustedError, match="changed after export"):
        tensorturn.export.load(copy)


def test_a_user_recipe_loads_only_where_it_is_allowed(runs, folders, tmp_path):
    """A folder names its recipe, and a recipe is code: one that is not built in is imported only
    where this machine allows it (TENSORTURN_ALLOW_RECIPES), or where the call does (``allow``)."""
    from tensorturn.store.objects import sha256_hex
    from tensorturn.store.tensors import model_bytes

    copy = tmp_path / "user"
    shutil.copytree(runs["work"] / "exported" / "fused", copy)
    config = json.loads((copy / "tensorturn.json").read_text())
    data = model_bytes(tensorturn.export.load(copy).models[0].state_dict(), "mixed_recipe:Small",
                       config["model"]["config"])
    (copy / "tensorturn.safetensors").write_bytes(data)
    config.update(model_sha256=sha256_hex(data), recipe={"name": "mixed_recipe:Small", "options": {}})
    (copy / "tensorturn.json").write_text(json.dumps(config))
    with pytest.raises(UntrustedError, match="not allowed on this machine"):
        tensorturn.export.load(copy)
    model = tensorturn.export.load(copy, allow=["mixed_recipe:Small"])
    assert type(model.recipe).__name__ == "Small"
    x, _ = load_digits(return_X_y=True)
    expected = tensorturn.export.load(runs["work"] / "exported" / "fused").predict(x[:20])
    assert np.array_equal(model.predict(x[:20])["probabilities"], expected["probabilities"])
