"""Run reports: PNG figures drawn from real runs' descriptions and saved beside the manifest."""

from __future__ import annotations

import io
import struct

import pytest
from conftest import tt_json_many

from tensorturn import layout
from tensorturn.runs.report import NAMES, plots, save_report, task_samples, worker_stats
from tensorturn.store.objects import open_store

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the signature."""
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def check_png(data: bytes) -> None:
    width, height = png_size(data)
    assert width > 0 and height > 0
    import matplotlib.image as mpimg

    image = mpimg.imread(io.BytesIO(data), format="png")
    assert image.shape[0] == height and image.shape[1] == width
    assert image.std() > 0  # something was drawn


@pytest.fixture(scope="module")
def store_url(tmp_path_factory):
    return (tmp_path_factory.mktemp("report") / "store").as_uri()


@pytest.fixture(scope="module")
def docs(store_url):
    """A small fused run and a small ensemble, side by side, each on its own embedded pool."""
    return tt_json_many(("run", "--mode", "fused", "--recipe", "digits-mlp", "--rounds", "2",
                         "--shards", "2", "--sync-every", "3", "--local-workers", "1",
                         "--store", store_url, "--json"),
                        ("run", "--mode", "ensemble", "--recipe", "digits-mlp", "--members", "2",
                         "--segments", "1", "--segment-steps", "5", "--local-workers", "1",
                         "--store", store_url, "--json"))


@pytest.fixture(scope="module")
def fused_doc(docs):
    return docs[0]


@pytest.fixture(scope="module")
def ensemble_doc(docs):
    return docs[1]


@pytest.mark.e2e
def test_fused_report_is_saved_beside_the_manifest(fused_doc, store_url):
    store = open_store(store_url)
    uris = save_report(fused_doc, store)
    run_id = fused_doc["run_id"]
    assert uris == [store.uri(layout.key("report", run_id, name)) for name in NAMES]
    for name in NAMES:
        key = f"runs/{run_id}/report/{name}.png"
        assert store.exists(f"runs/{run_id}/manifest.json") and store.exists(key)
        check_png(store.get_bytes(key))


@pytest.mark.e2e
def test_fused_rates_come_from_the_attempts(fused_doc):
    # every shard trains H=3 batches of the recipe's 32: rounds[r].samples / shards each
    samples = task_samples(fused_doc)
    assert samples == {f"r{r}/shard-{k}": 3 * 32 for r in range(2) for k in range(2)}
    (stats,) = worker_stats(fused_doc)  # one agent
    assert stats["worker"].startswith("local1@")
    assert stats["tasks"] == 4 and stats["samples"] == 4 * 96
    assert stats["samples_per_s"] > 0


@pytest.mark.e2e
def test_ensemble_report(ensemble_doc, store_url):
    figures = plots(ensemble_doc)
    assert list(figures) == list(NAMES)
    for data in figures.values():
        check_png(data)
    assert {s["tasks"] for s in worker_stats(ensemble_doc)} == {2}  # two members × one segment
    store = open_store(store_url)
    for uri in save_report(ensemble_doc, store):
        assert uri.startswith("file://") and uri.endswith(".png")
    assert store.list(f"runs/{ensemble_doc['run_id']}/report/") == sorted(
        layout.key("report", ensemble_doc["run_id"], n) for n in NAMES)


@pytest.mark.e2e
def test_a_run_without_results_still_gets_every_figure(fused_doc):
    # the description of the same run as it looked when it was queued: no rounds, no attempts
    queued = {**fused_doc, "state": "queued", "rounds": [], "attempts": [], "metrics": {}}
    figures = plots(queued)
    assert list(figures) == list(NAMES)
    for data in figures.values():
        check_png(data)


@pytest.mark.e2e
def test_figures_are_deterministic(fused_doc):
    assert plots(fused_doc) == plots(fused_doc)


def test_not_a_run_description_is_refused():
    from tensorturn.errors import TensorTurnError

    with pytest.raises(TensorTurnError, match="not a run description"):
        plots({"hello": "world"})
