"""Pushed datasets trained on real agents: larger than the cache (the same result on 1 and 3
agents), a text folder (fused and ensemble), an image folder."""

from __future__ import annotations

import numpy as np
from conftest import Server, bearer, push_pictures, tt_json, tt_json_many


def shard_chunk_bytes(chunks, shards):
    """The bytes of the chunks each fused shard reads (its rows' chunks)."""
    from tensorturn.data.source import shard_bounds

    bounds, edges = shard_bounds([c["rows"] for c in chunks], shards), [0]
    for c in chunks:
        edges.append(edges[-1] + c["rows"])
    return [sum(c["bytes"] for c, lo, hi in zip(chunks, edges, edges[1:]) if hi > start and lo < stop)
            for start, stop in zip(bounds, bounds[1:])]


def make_table(path, rows: int, seed: int = 0, classes: int = 3) -> None:
    """A learnable table: the label is which of ``classes`` directions a row leans to."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 8)).astype(np.float32)
    w = rng.normal(size=(8, classes))
    y = (x @ w + 0.3 * rng.normal(size=(rows, classes))).argmax(1)
    pq.write_table(pa.table({**{f"f{i}": x[:, i] for i in range(8)}, "y": y.astype(np.int64)}), path)


def test_a_dataset_larger_than_the_cache_trains_fused_with_the_same_result_on_1_and_3_agents(tmp_path):
    from conftest import clean_env

    make_table(tmp_path / "t.parquet", 40000)
    store = str(tmp_path / "store")
    pushed = tt_json("data", "push", str(tmp_path / "t.parquet"), "--name", "lean", "--label", "y",
                     "--chunk-mb", "0.1", "--store", store, "--json")
    train_bytes = sum(c["bytes"] for c in tt_json("data", "show", "lean", "--store", store)["splits"]["train"])
    budget_gb = train_bytes / 4 / 1024 ** 3   # the train split is 4× what a cache may hold
    # the two runs side by side, each on its own embedded pool and caches
    one, three = tt_json_many(*(("run", "--recipe", "tabular", "--recipe-option", "dataset=lean",
                                 "--local-workers", str(agents), "--rounds", "2", "--shards", "8",
                                 "--sync-every", "20", "--eval-batches", "0",  # whole splits: their chunks
                                 "--store", store, "--json") for agents in (1, 3)),
                              envs=[clean_env(TENSORTURN_CACHE_DIR=str(tmp_path / f"cache-{agents}"),
                                              TENSORTURN_CACHE_GB=str(budget_gb)) for agents in (1, 3)],
                              cwd=tmp_path)
    assert one["state"] == three["state"] == "succeeded"
    assert one["model_sha256"] == three["model_sha256"]           # the math ignores where shards ran
    assert one["metrics"]["test_accuracy"] > 0.8                    # and it learned something
    # each agent's tasks read the chunks of the shards it trained (and of the splits it
    # evaluated), nothing else; it downloaded what its cache lacked of those, plus at most one
    # shard ahead per task (prefetching); none could have held the whole split
    index = tt_json("data", "show", "lean", "--store", store)
    shard_bytes = shard_chunk_bytes(index["splits"]["train"], 8)
    eval_bytes = {s: sum(c["bytes"] for c in index["splits"][s]) for s in ("val", "test")}
    for doc in (one, three):
        read, downloaded = doc["data_read_bytes"], doc["data_bytes"]
        workers = {a["worker"] for a in doc["attempts"] if "/shard-" in a["task"]}
        assert set(read) == workers and set(downloaded) == workers
        for w in workers:
            ran = [a["task"] for a in doc["attempts"] if a["worker"] == w]
            trained = sum(shard_bytes[int(t.split("-")[1])] for t in ran if "/shard-" in t)
            # a round before the last is evaluated by a task of its own; the last by its outer
            # step, which tests the model too
            last = [t for t in ran if t == "r1/outer"]
            evals = [t for t in ran if t.endswith("/eval")] + last
            evaluated = len(evals) * eval_bytes["val"] + len(last) * eval_bytes["test"]
            assert read[w] == trained + evaluated, (w, ran)
            shard_tasks = sum("/shard-" in t for t in ran)
            assert 0 < downloaded[w] <= read[w] + shard_tasks * max(shard_bytes)
    assert len(set(shard_bytes)) > 1 or len(index["splits"]["train"]) % 8 == 0  # whole chunks
    for (cache, agents), doc in zip((("cache-1", 1), ("cache-3", 3)), (one, three)):  # a folder per agent
        folders = sorted(p for p in (tmp_path / cache).iterdir() if p.is_dir())
        # every agent that trained has one (the embedded pool begins with its first agent: on a
        # loaded machine the others may join after the run is done)
        trainers = {a["worker"].split("@")[0] for a in doc["attempts"] if "/shard-" in a["task"]}
        assert trainers <= {p.name for p in folders} <= {f"local{i + 1}" for i in range(agents)}
        for folder in folders:
            assert 0 < sum(p.stat().st_size for p in folder.glob("*.parquet")) <= budget_gb * 1024 ** 3
    assert pushed["rows"]["train"] == 32000
    # served: the server reads the dataset's index (for the features' scaling), no chunk
    import httpx

    token = tt_json("token", "create", "--store", store, "--json", cwd=tmp_path)["token"]
    server = Server(store, one["run_id"])
    try:
        body = {"inputs": [{"name": "input", "shape": [2, 8], "datatype": "FP32", "data": [[0.5] * 8, [-1.0] * 8]}]}
        r = httpx.post(f"{server.url}/v2/models/{one['run_id']}/infer", json=body, headers=bearer(token), timeout=60)
        assert r.status_code == 200, r.text
        outputs = {o["name"]: o for o in r.json()["outputs"]}
        assert outputs["probabilities"]["shape"] == [2, 3] and len(outputs["label"]["data"]) == 2
    finally:
        server.stop()


def test_a_language_model_on_a_pushed_text_folder_trains_fused_and_ensemble(tmp_path):
    import random

    books = tmp_path / "books"
    books.mkdir()
    rng = random.Random(0)
    words = "the quick brown fox jumps over the lazy dog then runs into the quiet forest".split()
    for i in range(30):
        (books / f"{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(200)) + "\n")
    store = str(tmp_path / "store")
    tt_json("data", "push", str(books), "--name", "books", "--store", store, "--json")
    small = ["--recipe-option", "context=32", "--recipe-option", "n_embd=32", "--recipe-option", "n_layer=1"]
    fused, ensemble = tt_json_many(  # side by side, each on its own embedded pool
        ("run", "--recipe", "textlm", "--recipe-option", "dataset=books", *small, "--local-workers", "2",
         "--rounds", "2", "--shards", "2", "--sync-every", "10", "--store", store, "--json"),
        ("run", "--mode", "ensemble", "--recipe", "textlm", "--recipe-option", "dataset=books", *small,
         "--members", "2", "--segments", "1", "--segment-steps", "10", "--local-workers", "2",
         "--store", store, "--json"), cwd=tmp_path)
    assert fused["state"] == "succeeded" and fused["metrics"]["test_loss"] < 5.5  # ln 256 = 5.55
    assert ensemble["state"] == "succeeded", ensemble.get("error")
    assert ensemble["metrics"]["members_succeeded"] == 2 and "test_accuracy" in ensemble["metrics"]


def test_an_image_folder_trains_fused(tmp_path):
    store = str(tmp_path / "store")
    push_pictures(tmp_path, store)
    doc = tt_json("run", "--recipe", "image-folder", "--recipe-option", "dataset=colors", "--local-workers", "2",
                  "--rounds", "2", "--shards", "2", "--sync-every", "15", "--store", store, "--json", cwd=tmp_path)
    assert doc["state"] == "succeeded" and doc["metrics"]["test_accuracy"] >= 0.75
