"""Figures of one run, drawn from its description (the JSON of ``status --json``, the manifest),
and a page that holds them.

:func:`plots` returns PNG bytes by name and needs nothing but the description; :func:`save_report`
puts them beside the run's manifest, at ``runs/<id>/report/<name>.png``, with ``report.html``
(:mod:`.page`: the figures embedded and the run's figures as tables, one
file to share), through the store — and, when asked, in a local folder too.

* ``loss`` — fused: the shards' mean training loss and the validation loss per round, with the
  validation accuracy beside it; a second axis gives each round's time since the run was created
  (broker clock, so rounds written by different machines line up). Ensemble: each member's test
  loss and accuracy as bars, with the vote's as a line.
* ``timeline`` — who ran what, when: every task attempt as a bar on its machine's row, coloured
  by how it ended (succeeded, failed, lost and requeued, handed back to its machine's owner,
  cancelled, late, still running); outer steps, evaluations and the vote hatched; the run's
  incidents as crosses and each fused round's end as a dotted line.
* ``samples_per_worker`` — samples/s of each worker while it trained, from the task attempts
  (samples of a task / its duration), with the number of tasks it did.
* ``bytes`` — the model's bytes (fused: uploaded and downloaded per round; ensemble: per task,
  or the mean per task when the description carries only the run's totals) beside, per machine,
  what it moved through the store and the dataset bytes it downloaded and its tasks read.

Only successful attempts count towards rates. A run that has not produced a figure yet (no round
finished, no member evaluated) still gets its PNG, saying so, so the set of names is fixed.
Drawing uses matplotlib's Agg renderer through :class:`matplotlib.figure.Figure` (no pyplot, no
display, no global state), and PNGs carry no timestamp or version metadata. Times on the figures
are seconds since the run was created, on the broker's clock (every ``at``, ``started_at`` and
``finished_at`` of a description is).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tensorturn import layout
from tensorturn.errors import TensorTurnError
from tensorturn.runs.report import page
from tensorturn.runs.report.facts import machines, origin, task_samples, timeline, worker_stats
from tensorturn.runs.report.figures import NAMES, OUTCOME_STYLE, draw

__all__ = ["NAMES", "OUTCOME_STYLE", "PAGE", "machines", "origin", "plots", "report_files", "save_report",
           "task_samples", "timeline", "worker_stats"]

PAGE = "report.html"


def _check(doc: Any) -> None:
    if not isinstance(doc, dict) or not doc.get("run_id") or doc.get("mode") not in ("fused", "ensemble"):
        raise TensorTurnError("not a run description: expected the JSON of `tensorturn status --json`")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise TensorTurnError("reports need matplotlib: pip install matplotlib") from None


def plots(doc: dict[str, Any]) -> dict[str, bytes]:
    """PNG bytes by name (:data:`NAMES`) for one run's description."""
    _check(doc)
    return draw(doc)


def report_files(doc: dict[str, Any]) -> dict[str, bytes]:
    """The report's files by name: ``<name>.png`` for each of :data:`NAMES`, then :data:`PAGE`
    (the page holds the PNGs too, so it can be shared alone)."""
    figures = plots(doc)
    html = page.render(doc, figures)
    return {**{f"{name}.png": png for name, png in figures.items()}, PAGE: html.encode()}


def save_report(doc: dict[str, Any], store, out: str | Path | None = None) -> list[str]:
    """Draw the run's figures and page and put them at ``runs/<id>/report/`` in ``store``
    (a :class:`tensorturn.store.objects.Store`): ``<name>.png`` for each of :data:`NAMES`, then
    :data:`PAGE`. With ``out``, the same files are written to that local folder too (made if
    missing; files of the same names are replaced). Returns the store's URIs in that order, then
    the local files' ``file://`` URIs."""
    folder = _local_folder(out) if out is not None else None  # refused before anything is drawn
    files = report_files(doc)
    uris = []
    for name, data in files.items():
        key = (layout.key("report_page", doc["run_id"]) if name == PAGE
               else layout.key("report", doc["run_id"], name.removesuffix(".png")))
        store.put_bytes(key, data)
        uris.append(store.uri(key))
    if folder is not None:
        for name, data in files.items():
            path = folder / name
            try:
                path.write_bytes(data)
            except OSError as exc:
                raise TensorTurnError(f"cannot write the report to {path}: {exc.strerror or exc}") from None
            uris.append(path.resolve().as_uri())
    return uris


def _local_folder(out: str | Path) -> Path:
    folder = Path(out).expanduser()
    if folder.exists() and not folder.is_dir():
        raise TensorTurnError(f"--out {out}: not a folder (the report is several files)")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise TensorTurnError(f"--out {out}: cannot make the folder: {exc.strerror or exc}") from None
    return folder
