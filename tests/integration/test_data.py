"""The data plane: datasets pushed as Parquet chunks + a versioned index, read back through a
machine's chunk cache (only the chunks asked for, verified, under a byte budget)."""

from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest
from conftest import push_pictures, tt, tt_json, tt_many

from tensorturn import data as datasets
from tensorturn import layout
from tensorturn.data.cache import ChunkCache, ChunkError
from tensorturn.errors import SpecError
from tensorturn.store.objects import open_store


@pytest.fixture
def table_csv(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "table.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["a", "b", "c", "y"])
        for _ in range(3000):
            w.writerow([*rng.normal(size=3).round(5), int(rng.integers(0, 3))])
    return path


def test_shards_are_whole_chunks_when_there_are_enough():
    from tensorturn.data.source import shard_bounds

    assert shard_bounds([100] * 8, 4) == [0, 200, 400, 600, 800]
    assert shard_bounds([100] * 9, 4) == [0, 200, 400, 700, 900]    # sizes within a chunk
    assert shard_bounds([100, 100, 50], 2) == [0, 100, 250]
    assert shard_bounds([100] * 3, 4) == [0, 75, 150, 225, 300]      # too few chunks: rows
    assert shard_bounds([1000, 1, 1, 1], 3) == [0, 334, 668, 1003]   # no edge for each: rows
    assert shard_bounds([1000, 1, 1, 1], 2) == [0, 501, 1003]        # 1000 and 3 rows: too uneven


def chunk_files(store_dir):
    return sorted(p.name for p in (store_dir / "datasets" / "chunks").glob("*.parquet"))


def test_push_list_show_rm_a_table(table_csv, tmp_path):
    store = tmp_path / "store"
    pushed = tt_json("data", "push", str(table_csv), "--name", "tab", "--label", "y", "--store", str(store),
                     "--chunk-mb", "0.02", "--json")
    assert pushed["rows"] == {"train": 2400, "val": 300, "test": 300} and pushed["chunks"] > 3
    index = tt_json("data", "show", "tab", "--store", str(store))
    assert index["kind"] == "table" and index["label"] == "y" and index["features"] == ["a", "b", "c"]
    every = [c for split in index["splits"].values() for c in split]
    assert sum(c["rows"] for c in every) == 3000 and len(chunk_files(store)) == len(every)
    # the rows, read back from the chunks, are the source's rows, each exactly once
    st = open_store(store.as_uri())
    cache = ChunkCache(tmp_path / "cache", budget_bytes=10 ** 9)
    back = sorted(tuple(r.values()) for c in every for r in cache.read(st, c).to_pylist())
    with open(table_csv) as f:
        source = sorted(tuple(float(v) if i < 3 else int(v) for i, v in enumerate(row))
                        for row in list(csv.reader(f))[1:])
    assert back == source
    # the same data again: version 2, the same chunks, nothing new stored
    again = tt_json("data", "push", str(table_csv), "--name", "tab", "--label", "y", "--store", str(store),
                    "--chunk-mb", "0.02", "--json")
    assert again["version"] == 2 and len(chunk_files(store)) == len(every)
    listed = tt_json("data", "list", "--store", str(store), "--json")
    assert [(d["name"], d["version"]) for d in listed] == [("tab", 2)]
    # a run trained on a version can no longer be exported or served without it: asked first
    unasked = tt("data", "rm", "tab", "--version", "1", "--store", str(store))
    assert unasked.returncode == 2 and unasked.stderr.strip().splitlines() == [
        "error: not removing dataset tab without confirmation: no terminal to ask on; pass --yes"]
    assert tt("data", "rm", "tab", "--version", "1", "--yes", "--store", str(store)).returncode == 0
    assert len(chunk_files(store)) == len(every)  # version 2 still uses them
    assert tt("data", "rm", "tab", "--yes", "--store", str(store)).returncode == 0
    assert chunk_files(store) == [] and tt_json("data", "list", "--store", str(store), "--json") == []


@pytest.mark.parametrize("args, expected", [
    (["--name", "tab"], "is a table: name its target with --label COLUMN (columns: a, b, c, y)"),
    (["--name", "tab", "--label", "price"], "has no column 'price' (columns: a, b, c, y)"),
    (["--name", "Bad Name", "--label", "y"], "invalid dataset name 'Bad Name'"),
    (["--name", "chunks", "--label", "y"], "invalid dataset name 'chunks'"),
])
def test_bad_pushes_are_one_line_and_store_nothing(table_csv, tmp_path, args, expected):
    store = tmp_path / "store"
    proc = tt("data", "push", str(table_csv), *args, "--store", str(store))
    assert proc.returncode == 2 and expected in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (store / "datasets").exists()


def test_an_empty_table_a_missing_dataset_and_mixed_image_sizes_are_one_line(tmp_path):
    from PIL import Image

    store = str(tmp_path / "store")
    (tmp_path / "empty.csv").write_text("a,y\n")
    proc = tt("data", "push", str(tmp_path / "empty.csv"), "--name", "e", "--label", "y", "--store", store)
    assert proc.returncode == 2 and proc.stderr.strip().endswith("the dataset is empty")
    proc = tt("data", "show", "nothing", "--store", store)
    assert proc.returncode == 2 and "no dataset 'nothing' in the store" in proc.stderr
    for name, size in (("a", (8, 8)), ("b", (9, 8))):
        (tmp_path / "imgs" / name).mkdir(parents=True)
        Image.new("RGB", size).save(tmp_path / "imgs" / name / "0.png")
    proc = tt("data", "push", str(tmp_path / "imgs"), "--name", "pets", "--store", store)
    assert proc.returncode == 2 and "images of different sizes (8x8, 9x8" in proc.stderr
    resized = tt_json("data", "push", str(tmp_path / "imgs"), "--name", "pets", "--resize", "8x8",
                      "--val-fraction", "0", "--test-fraction", "0", "--store", store, "--json")
    assert resized["kind"] == "images" and resized["rows"]["train"] == 2


def test_text_folders_and_saved_hugging_face_datasets(tmp_path):
    import pyarrow as pa

    st = open_store((tmp_path / "store").as_uri())
    (tmp_path / "books").mkdir()
    for i in range(5):
        (tmp_path / "books" / f"{i}.txt").write_text(f"document {i}\n" * (i + 1))
    text = datasets.push(st, str(tmp_path / "books"), "books", val_fraction=0.2, test_fraction=0.2)
    assert text["kind"] == "text" and text["rows"] == {"train": 3, "val": 1, "test": 1}
    saved = tmp_path / "hf"
    saved.mkdir()
    (saved / "dataset_info.json").write_text(json.dumps({"features": {}}))
    table = pa.table({"x": pa.array([1.0, 2.0, 3.0, 4.0]), "label": pa.array([0, 1, 0, 1])})
    with pa.OSFile(str(saved / "data-00000-of-00001.arrow"), "wb") as sink:  # what save_to_disk writes
        with pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table)
    hf = datasets.push(st, str(saved), "hf", label="label", val_fraction=0.25, test_fraction=0.25)
    assert hf["kind"] == "table" and hf["rows"] == {"train": 2, "val": 1, "test": 1}
    # a DatasetDict: dataset_dict.json names the splits, each a saved dataset in its own folder
    both = tmp_path / "hfdict"
    for split in ("train", "test"):
        (both / split).mkdir(parents=True)
        (both / split / "state.json").write_text("{}")
        with pa.OSFile(str(both / split / "data-00000-of-00001.arrow"), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
    (both / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    merged = datasets.push(st, str(both), "hfdict", label="label", val_fraction=0.25, test_fraction=0.25)
    assert merged["kind"] == "table" and sum(merged["rows"].values()) == 8
    assert datasets.names(st) == ["books", "hf", "hfdict"]


def test_a_partial_download_of_a_dead_process_is_removed(tmp_path):
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / "c").mkdir()
    orphan, live = tmp_path / "c" / f".{'a' * 64}.{dead}", tmp_path / "c" / f".{'b' * 64}.{os.getpid()}"
    fresh = tmp_path / "c" / f".{'c' * 64}.{dead}"
    for path in (orphan, live, fresh):
        path.write_bytes(b"x")
    for path in (orphan, live):
        os.utime(path, (1, 1))                          # written long ago
    ChunkCache(tmp_path / "c", 10 ** 6)
    assert not orphan.exists() and live.exists()       # a download in progress is left alone
    assert fresh.exists()                               # and so is a recent one (another container's?)


def test_the_cache_keeps_to_its_budget_and_refuses_a_damaged_chunk(table_csv, tmp_path):
    st = open_store((tmp_path / "store").as_uri())
    index = datasets.push(st, str(table_csv), "tab", label="y", chunk_mb=0.02)
    train = index["splits"]["train"]
    budget = sum(c["bytes"] for c in train[:3])  # room for three chunks of the train split
    cache = ChunkCache(tmp_path / "cache", budget_bytes=budget)
    for chunk in train:
        cache.read(st, chunk)
    assert cache.used_bytes() <= budget and cache.misses == len(train) and cache.hits == 0
    cache.read(st, train[-1])                       # the most recent one is still there
    assert cache.hits == 1
    cache.read(st, train[0])                        # the least recent one was evicted
    assert cache.misses == len(train) + 1
    assert cache.bytes_downloaded == sum(c["bytes"] for c in train) + train[0]["bytes"]
    # a chunk damaged in the store: fetched twice, then one clear error naming it
    key = layout.key("chunk", train[1]["sha256"])
    good = st.get_bytes(key)
    (tmp_path / "store" / key).write_bytes(good[:-10] + b"0123456789")
    fresh = ChunkCache(tmp_path / "cache2", budget_bytes=budget)
    with pytest.raises(ChunkError, match=f"dataset chunk {train[1]['sha256'][:12]}"):
        fresh.path(st, train[1])
    assert fresh.bytes_downloaded == 2 * len(good) and not list((tmp_path / "cache2").glob("*.parquet"))
    (tmp_path / "store" / key).write_bytes(good)       # repaired: read as usual
    assert fresh.read(st, train[1]).num_rows == train[1]["rows"]


def test_a_dataset_in_s3(table_csv, tmp_path, s3_bucket):
    st = open_store(f"s3://{s3_bucket}/data")
    index = datasets.push(st, str(table_csv), "tab", label="y", chunk_mb=0.05)
    cache = ChunkCache(tmp_path / "cache", budget_bytes=10 ** 9)
    rows = sum(cache.read(st, c).num_rows for c in index["splits"]["val"])
    assert rows == 300 and datasets.show(st, "tab")["version"] == 1


def test_a_run_on_a_dataset_that_is_not_there_is_one_line_and_queues_nothing(tmp_path, redis_server):
    import redis
    from conftest import clean_env, queued_messages

    store = str(tmp_path / "store")
    (tmp_path / "books").mkdir()
    (tmp_path / "books" / "a.txt").write_text("some text\n" * 50)
    tt_json("data", "push", str(tmp_path / "books"), "--name", "books", "--store", store, "--json")
    proc = tt("run", "--recipe", "tabular", "--recipe-option", "dataset=nope", "--store", store,
              env=clean_env(TENSORTURN_BROKER_URL=redis_server.url), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "error: recipe 'tabular': no dataset 'nope' in the store (datasets: books; see `tensorturn data push`)")
    assert queued_messages(redis.Redis.from_url(redis_server.url)) == []


def test_check_recipe_on_pushed_images_and_tables(tmp_path, table_csv):
    from conftest import clean_env

    store = str(tmp_path / "store")
    push_pictures(tmp_path, store, per_class=10)
    tt_json("data", "push", str(table_csv), "--name", "tab", "--label", "y", "--store", store, "--json")
    env = clean_env(TENSORTURN_STORE_URL=store)
    check = ("check-recipe", "tabular", "--recipe-option")
    images, table, wrong = tt_many(  # three processes that load torch: at once
        ("check-recipe", "image-folder", "--recipe-option", "dataset=colors", "--json"),
        (*check, "dataset=tab", "--json"), (*check, "dataset=colors"), envs=[env] * 3)
    images = json.loads(images.stdout)
    assert images["input_shape"] == [3, 12, 12] and images["outputs"]["probabilities"]["shape"] == ["N", 2]
    table = json.loads(table.stdout)
    assert table["task"] == "classification" and table["input_shape"] == [3]
    assert wrong.returncode == 2
    assert wrong.stderr.strip() == ("error: recipe 'tabular' failed at build: recipe 'tabular': dataset "
                                    "'colors' is 'images' data, not 'table'")


def test_labels_become_what_they_mean_and_bad_ones_are_one_line(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    st = open_store((tmp_path / "store").as_uri())
    words = pq.write_table(pa.table({"x": [1.0, 2.0, 3.0, 4.0, 5.0], "kind": ["b", "a", "b", "c", "a"]}),
                           tmp_path / "words.parquet")
    assert words is None
    named = datasets.push(st, str(tmp_path / "words.parquet"), "words", label="kind", val_fraction=0,
                          test_fraction=0)
    assert (named["task"], named["classes"], named["class_names"]) == ("classification", 3, ["a", "b", "c"])
    prices = np.arange(1000, 1500, dtype=np.int64)
    pq.write_table(pa.table({"x": prices.astype(np.float32), "price": prices}), tmp_path / "prices.parquet")
    assert datasets.push(st, str(tmp_path / "prices.parquet"), "prices", label="price")["task"] == "regression"
    forced = datasets.push(st, str(tmp_path / "prices.parquet"), "prices", label="price", task="classification")
    assert forced["task"] == "classification" and forced["classes"] == 1500
    with pytest.raises(SpecError, match=r"--task regression needs a numeric label; 'kind' is string"):
        datasets.push(st, str(tmp_path / "words.parquet"), "words2", label="kind", task="regression")
    pq.write_table(pa.table({"x": [1.0, 2.0], "y": pa.array([1, None], pa.int64())}), tmp_path / "holes.parquet")
    proc = tt("data", "push", str(tmp_path / "holes.parquet"), "--name", "h", "--label", "y",
              "--store", str(tmp_path / "store"))
    assert proc.returncode == 2 and "the label column 'y' has 1 empty values" in proc.stderr
    (tmp_path / "broken.csv").write_text('a,y\n1,2\n"unclosed,3\n')
    proc = tt("data", "push", str(tmp_path / "broken.csv"), "--name", "b", "--label", "y",
              "--store", str(tmp_path / "store"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "cannot read it: ArrowInvalid" in proc.stderr


def test_a_run_pins_the_dataset_version_it_started_with(tmp_path, table_csv, redis_server):
    from tensorturn import config, runs
    from tensorturn.pool.celery_app import configure
    from tensorturn.spec import RunSpec
    from tensorturn.state.manifest import load_spec

    store = (tmp_path / "store").as_uri()
    st = open_store(store)
    datasets.push(st, str(table_csv), "tab", label="y")
    config.use(config.current().with_(store_url=store, cache_dir=str(tmp_path / "cache")))
    configure(redis_server.url)
    spec = RunSpec.create(mode="fused", recipe="tabular", store_url=store, rounds=1, shards=2, sync_every=2,
                          recipe_options={"dataset": "tab"})
    runs.submit(spec, redis_server.url)
    datasets.push(st, str(table_csv), "tab", label="y", seed=1)  # version 2, pushed meanwhile
    assert load_spec(st, spec.run_id).recipe_options == {"dataset": "tab", "version": 1}


def test_a_chunk_name_that_is_no_sha256_is_refused(tmp_path):
    st = open_store((tmp_path / "store").as_uri())
    with pytest.raises(ChunkError, match="not a sha256"):
        ChunkCache(tmp_path / "cache").path(st, {"sha256": "../../etc/passwd", "bytes": 1})
