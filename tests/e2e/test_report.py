"""Run reports: PNG figures and a one-file HTML page drawn from real runs' descriptions and saved
beside the manifest — a fused run on a pushed dataset, an ensemble and a run that failed."""

from __future__ import annotations

import base64
import copy
import csv
import io
import json
import struct
from html.parser import HTMLParser

import numpy as np
import pytest
from conftest import clean_env, tt_here, tt_here_json, tt_many

from tensorturn import layout
from tensorturn.runs.report import (
    NAMES,
    PAGE,
    machines,
    plots,
    report_files,
    save_report,
    task_samples,
    timeline,
    worker_stats,
)
from tensorturn.runs.report import page as report_page
from tensorturn.runs.report.facts import size
from tensorturn.store.objects import open_store

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# matplotlib's tab10 colours of the timeline's outcomes (report.OUTCOME_STYLE), as RGB 0..1
RED, ORANGE, PURPLE = (0.839, 0.153, 0.157), (1.0, 0.498, 0.055), (0.580, 0.404, 0.741)


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, after checking the signature."""
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def decode(data: bytes) -> np.ndarray:
    import matplotlib.image as mpimg

    return mpimg.imread(io.BytesIO(data), format="png")


def check_png(data: bytes) -> None:
    width, height = png_size(data)
    assert width > 0 and height > 0
    image = decode(data)
    assert image.shape[0] == height and image.shape[1] == width
    assert image.std() > 0  # something was drawn


def has_colour(data: bytes, rgb: tuple[float, float, float]) -> bool:
    """Whether the PNG has pixels of this colour (a bar's fill; antialiased edges aside)."""
    image = decode(data)[..., :3]
    return bool((np.abs(image - np.array(rgb)).max(axis=-1) < 0.01).any())


class Page(HTMLParser):
    """What a test reads of report.html: section ids, table cells' text, images' sources,
    and every start tag (to find one that should not be there)."""

    def __init__(self, text: str):
        super().__init__()
        self.sections: list[str] = []
        self.images: dict[str, str] = {}
        self.tags: list[tuple[str, dict]] = []
        self.summary: dict[str, str] = {}
        self.cells: list[str] = []
        self._figure = self._th = None
        self._text: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "section":
            self.sections.append(attrs.get("id"))
        if tag == "figure":
            self._figure = attrs["id"].removeprefix("figure-")
        if tag == "img":
            self.images[self._figure] = attrs["src"]
        if tag in ("td", "th"):
            self._text = []

    def handle_data(self, data):
        self._text.append(data)

    def handle_endtag(self, tag):
        text = "".join(self._text).strip()
        if tag == "th":
            self._th = text
        if tag == "td":
            self.cells.append(text)
            if self.sections[-1] == "summary":
                self.summary[self._th] = text


def figures_of(page: Page) -> dict[str, bytes]:
    prefix = "data:image/png;base64,"
    assert all(src.startswith(prefix) for src in page.images.values())
    return {name: base64.b64decode(src.removeprefix(prefix)) for name, src in page.images.items()}


@pytest.fixture(scope="module")
def store_url(tmp_path_factory):
    return (tmp_path_factory.mktemp("report") / "store").as_uri()


@pytest.fixture(scope="module")
def docs(store_url, tmp_path_factory):
    """Side by side, each on its own embedded pool: a small fused run of the tabular recipe on a
    pushed dataset (so it has dataset bytes), a small ensemble, and a fused run whose recipe's
    evaluate raises (its shards succeed; its evaluations and last outer step fail twice each)."""
    table = tmp_path_factory.mktemp("table") / "t.csv"
    rng = np.random.default_rng(0)
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["a", "b", "c", "y"])
        for _ in range(600):
            w.writerow([*rng.normal(size=3).round(5), int(rng.integers(0, 3))])
    tt_here_json("data", "push", str(table), "--name", "tab", "--label", "y", "--store", store_url, "--json")
    small = ("--rounds", "2", "--shards", "2", "--sync-every", "3", "--local-workers", "1", "--store", store_url,
             "--json")
    procs = tt_many(("run", "--mode", "fused", "--recipe", "tabular", "--recipe-option", "dataset=tab",
                     "--batch-size", "32", *small),
                    ("run", "--mode", "ensemble", "--recipe", "digits-mlp", "--members", "2",
                     "--segments", "1", "--segment-steps", "5", "--local-workers", "1",
                     "--store", store_url, "--json"),
                    ("run", "--mode", "fused", "--recipe", "failing:Failing", "--max-attempts", "2", *small),
                    # a chunk cache of its own: the dataset is downloaded, not found from an earlier run
                    envs=[clean_env(TENSORTURN_CACHE_DIR=str(table.parent / "cache")), None,
                          clean_env(TT_FAIL_IN="evaluate", TT_FAIL_OVER_ROWS="16", TT_FAIL_AS="RuntimeError")])
    assert [p.returncode for p in procs] == [0, 0, 1], [p.stderr[-2000:] for p in procs]
    return [json.loads(p.stdout) for p in procs]


@pytest.fixture(scope="module")
def fused_doc(docs):
    return docs[0]


@pytest.fixture(scope="module")
def ensemble_doc(docs):
    return docs[1]


@pytest.fixture(scope="module")
def failed_doc(docs):
    return docs[2]


@pytest.fixture(scope="module")
def fused_page(fused_doc, store_url):
    store = open_store(store_url)
    uris = save_report(fused_doc, store)
    return uris, store.get_bytes(layout.key("report_page", fused_doc["run_id"])).decode()


@pytest.mark.e2e
def test_fused_report_is_saved_beside_the_manifest(fused_doc, fused_page, store_url):
    store = open_store(store_url)
    uris, _ = fused_page
    run_id = fused_doc["run_id"]
    assert uris == [store.uri(layout.key("report", run_id, name)) for name in NAMES] + [
        store.uri(f"runs/{run_id}/report/{PAGE}")]
    for name in NAMES:
        key = f"runs/{run_id}/report/{name}.png"
        assert store.exists(f"runs/{run_id}/manifest.json") and store.exists(key)
        check_png(store.get_bytes(key))


@pytest.mark.e2e
def test_fused_rates_come_from_the_attempts(fused_doc):
    # every shard trains H=3 batches of 32: rounds[r].samples / shards each
    samples = task_samples(fused_doc)
    assert samples == {f"r{r}/shard-{k}": 3 * 32 for r in range(2) for k in range(2)}
    (stats,) = worker_stats(fused_doc)  # one agent
    assert stats["worker"].startswith("local1@")
    assert stats["tasks"] == 4 and stats["samples"] == 4 * 96
    assert stats["samples_per_s"] > 0


@pytest.mark.e2e
def test_the_page_holds_the_figures_and_the_runs_figures(fused_doc, fused_page, store_url):
    _, html = fused_page
    page = Page(html)
    assert page.sections == ["summary", "figures", "rounds", "machines", "problems", "attempts"]
    # the page is one file: its figures are the PNGs, embedded, and nothing is fetched from elsewhere
    store = open_store(store_url)
    assert figures_of(page) == {n: store.get_bytes(layout.key("report", fused_doc["run_id"], n)) for n in NAMES}
    assert not [t for t in page.tags if t[0] in ("script", "link", "iframe")]
    s = page.summary
    assert s["run"] == fused_doc["run_id"] and s["state"] == "succeeded"
    assert s["mode"] == "fused (--sync rounds)" and s["recipe"] == "tabular"
    assert s["recipe options"] == "dataset=tab, version=1"
    assert "batch_size=32" in s["options"] and "rounds=2" in s["options"] and "shards=2" in s["options"]
    assert s["rounds"] == "2 of 2"
    assert f"test_accuracy {fused_doc['metrics']['test_accuracy']:.4g}" in s["final metrics"]
    (worker,) = fused_doc["data_bytes"]
    downloaded, read = fused_doc["data_bytes"][worker], fused_doc["data_read_bytes"][worker]
    assert downloaded > 0 and read >= downloaded
    assert s["dataset bytes"] == f"{size(downloaded)} downloaded, {size(read)} read by tasks"
    assert s["machines"] == f"1: {worker}"
    # the rounds table: validation accuracy beside the losses, and when each round ended
    for r in fused_doc["rounds"]:
        assert f"{r['val_accuracy']:.4g}" in page.cells and f"{r['val_loss']:.4g}" in page.cells
    assert "Nothing: no attempt failed" in html


@pytest.mark.e2e
def test_the_figures_show_accuracy_bytes_and_the_timeline(fused_doc):
    (machine,) = machines(fused_doc)
    assert machine["data_downloaded"] == sum(fused_doc["data_bytes"].values())
    assert machine["store_up"] == fused_doc["store_bytes_up"]
    assert machine["attempts"] == {"succeeded": len(fused_doc["attempts"])}
    bars = timeline(fused_doc)
    assert {b["task"] for b in bars} == {a["task"] for a in fused_doc["attempts"]}
    assert all(0 <= b["start"] <= b["end"] and b["ended"] == "succeeded" for b in bars)
    # outer steps and evaluations are told from training: r0/outer, r1/outer (and r0/eval, when a task of its own)
    assert {b["task"] for b in bars if not b["training"]} >= {"r0/outer", "r1/outer"}
    assert {b["task"] for b in bars if b["training"]} == {f"r{r}/shard-{k}" for r in range(2) for k in range(2)}
    figures = plots(fused_doc)
    assert not has_colour(figures["timeline"], RED)  # nothing failed


@pytest.mark.e2e
def test_a_failed_run_shows_what_failed(failed_doc, store_url, tmp_path):
    assert failed_doc["state"] == "failed"
    failed = [b for b in timeline(failed_doc) if b["ended"] == "failed"]
    assert sorted((b["task"], b["attempt"]) for b in failed) == [("r0/eval", 1), ("r0/eval", 2),
                                                               ("r1/outer", 1), ("r1/outer", 2)]
    # `report --out`: the store's copy and a local one, read from the store's manifest
    uris = tt_here_json("report", failed_doc["run_id"], "--store", store_url, "--out", str(tmp_path / "r"),
                        "--json")
    assert uris[-1] == (tmp_path / "r" / PAGE).as_uri() and len(uris) == 2 * (len(NAMES) + 1)
    html = (tmp_path / "r" / PAGE).read_text()
    assert html.encode() == open_store(store_url).get_bytes(f"runs/{failed_doc['run_id']}/report/{PAGE}")
    page = Page(html)
    assert "rounds" not in page.sections  # none was recorded
    assert page.summary["attempts"] == "9: 4 failed, 5 succeeded"
    assert 'id="error"' in html and "RuntimeError: boom in evaluate" in html
    assert html.count("<summary>traceback</summary>") == 4  # each failed attempt's, folded
    assert "evaluation_given_up" in page.cells  # the incident
    figures = figures_of(page)
    assert has_colour(figures["timeline"], RED)  # the failed attempts' bars
    assert (tmp_path / "r" / "timeline.png").read_bytes() == figures["timeline"]


@pytest.mark.e2e
def test_report_out_that_is_a_file_is_one_line(failed_doc, store_url, tmp_path):
    (tmp_path / "a-file").write_text("mine")
    proc = tt_here("report", failed_doc["run_id"], "--store", store_url, "--out", str(tmp_path / "a-file"))
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [f"error: --out {tmp_path / 'a-file'}: not a folder (the report is "
                                        f"several files)"]
    assert (tmp_path / "a-file").read_text() == "mine"


@pytest.mark.e2e
def test_requeued_and_handed_back_attempts_are_marked(fused_doc):
    """The same run as if a second machine had lost one attempt (requeued) and handed another
    back to its owner: their bars and the incident are on that machine's row, and listed."""
    doc = copy.deepcopy(fused_doc)
    t = doc["attempts"][0]["started_at"]
    doc["attempts"] += [
        {"attempt": 1, "task": "r0/shard-1", "worker": "local2@vm", "started_at": t, "finished_at": t + 0.05,
         "outcome": "lost: requeued to another attempt"},
        {"attempt": 2, "task": "r1/shard-0", "worker": "local2@vm", "started_at": t + 0.06, "finished_at": t + 0.1,
         "outcome": "handed back: owner: game night"}]
    doc["incidents"] = [{"kind": "requeued", "task": "r0/shard-1", "worker": "local2@vm", "at": t + 0.2,
                         "detail": "attempt 1 was lost (its worker stopped answering)"}]
    second = [m for m in machines(doc) if m["worker"] == "local2@vm"]
    assert second[0]["attempts"] == {"handed back": 1, "lost": 1} and second[0]["tasks"] == 0
    figures = report_files(doc)
    page = Page(figures[PAGE].decode())
    timeline_png = figures["timeline.png"]
    assert has_colour(timeline_png, ORANGE) and has_colour(timeline_png, PURPLE)
    assert "lost: requeued to another attempt" in page.cells and "handed back: owner: game night" in page.cells
    assert "requeued" in page.cells and page.summary["machines"].startswith("2: ")


@pytest.mark.e2e
def test_user_controlled_values_are_escaped_and_secrets_masked(fused_doc):
    doc = copy.deepcopy(fused_doc)
    doc["spec"]["recipe_options"] = {"note": "<script>alert(1)</script>", "q": '"><img src=x onerror=alert(2)>'}
    doc["recipe"] = "evil:<b>Recipe</b>"
    for a in doc["attempts"]:
        a["worker"] = "<i>w</i>@host"
    doc["store_bytes_by_worker"] = {"<i>w</i>@host": {"up": 1, "down": 2}}
    doc["data_bytes"] = doc["data_read_bytes"] = {}
    doc["error"] = "cannot reach redis://default:hunter2@10.0.0.5:6379/0 </table>"
    doc["warnings"] = ["store s3://AKIAEXAMPLE:wJalrSECRET@minio:9000/bucket"]
    doc["spec"]["store_url"] = "s3://key:sEcReT@minio:9000/bucket"
    html = report_page.render(doc, {})  # the page's text alone: no figure needs drawing
    page = Page(html)
    assert {t for t, _ in page.tags} <= {"html", "head", "meta", "title", "style", "body", "header", "h1", "code",
                                        "span", "p", "section", "h2", "h3", "table", "tr", "th", "td", "figure",
                                        "img", "figcaption", "details", "summary", "pre", "ul", "li", "footer"}
    assert "<script>" not in html and "<b>Recipe" not in html and "<i>w" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "&lt;i&gt;w&lt;/i&gt;@host" in html
    assert page.summary["recipe options"] == 'note=<script>alert(1)</script>, q="><img src=x onerror=alert(2)>'
    for secret in ("hunter2", "wJalrSECRET", "sEcReT"):
        assert secret not in html
    assert "redis://default:***@10.0.0.5:6379/0" in html


@pytest.mark.e2e
def test_a_machine_name_that_looks_like_math_is_drawn_as_text(fused_doc):
    """`$…$` in a name is matplotlib's math text: parsed, `gpu$\\foo$box` broke every figure."""
    doc = copy.deepcopy(fused_doc)
    name = "gpu$\\foo$box@host"
    for a in doc["attempts"]:
        a["worker"] = name
    doc["store_bytes_by_worker"] = {name: {"up": 1, "down": 2}}
    doc["data_bytes"] = doc["data_read_bytes"] = {}
    files = report_files(doc)
    for figure in NAMES:
        check_png(files[f"{figure}.png"])


@pytest.mark.e2e
def test_ensemble_report(ensemble_doc, store_url):
    assert {s["tasks"] for s in worker_stats(ensemble_doc)} == {2}  # two members × one segment
    assert [b["task"] for b in timeline(ensemble_doc) if not b["training"]] == ["vote"]
    store = open_store(store_url)
    uris = save_report(ensemble_doc, store)
    assert all(uri.startswith("file://") for uri in uris) and uris[-1].endswith(PAGE)
    assert store.list(f"runs/{ensemble_doc['run_id']}/report/") == sorted(
        [layout.key("report", ensemble_doc["run_id"], n) for n in NAMES]
        + [layout.key("report_page", ensemble_doc["run_id"])])
    page = Page(store.get_bytes(layout.key("report_page", ensemble_doc["run_id"])).decode())
    figures = figures_of(page)
    assert list(figures) == list(NAMES)
    for name, data in figures.items():
        check_png(data)
        assert data == store.get_bytes(layout.key("report", ensemble_doc["run_id"], name))
    assert page.sections == ["summary", "figures", "members", "machines", "problems", "attempts"]
    assert page.summary["mode"] == "ensemble" and page.summary["members"] == "2: 2 succeeded"
    for m in ensemble_doc["members"]:
        assert f"{m['metrics']['test_accuracy']:.4g}" in page.cells


@pytest.mark.e2e
def test_a_run_without_results_still_gets_every_figure(fused_doc):
    # the description of the same run as it looked when it was queued: no rounds, no attempts
    queued = {**fused_doc, "state": "queued", "rounds": [], "attempts": [], "metrics": {},
              "store_bytes_by_worker": {}, "data_bytes": {}, "data_read_bytes": {}}
    files = report_files(queued)
    assert list(files) == [f"{n}.png" for n in NAMES] + [PAGE]
    for name in NAMES:
        check_png(files[f"{name}.png"])
    assert "No machine has worked on this run yet." in files[PAGE].decode()


@pytest.mark.e2e
def test_a_running_attempt_ends_at_the_latest_time_known(fused_doc):
    doc = copy.deepcopy(fused_doc)
    doc["state"], doc["finished_at"] = "running", None
    last = doc["attempts"][-1]
    last["outcome"], last["finished_at"] = "running", None
    bar = [b for b in timeline(doc) if b["task"] == last["task"]][-1]
    assert bar["running"] and bar["end"] == pytest.approx(doc["progress_at"] - doc["created_at"])
    assert "running" in Page(report_page.render(doc, {})).cells


@pytest.mark.e2e
def test_reports_are_deterministic(fused_doc, fused_page):
    # the page holds every figure: drawn again, it is the same bytes as the one saved
    assert report_files(fused_doc)[PAGE] == fused_page[1].encode()


