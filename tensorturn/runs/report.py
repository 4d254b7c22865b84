"""Figures of one run, drawn from its description (the JSON of ``status --json``, the manifest),
and a page that holds them.

:func:`plots` returns PNG bytes by name and needs nothing but the description; :func:`save_report`
puts them beside the run's manifest, at ``runs/<id>/report/<name>.png``, with ``report.html``
(:mod:`tensorturn.runs.report_page`: the figures embedded and the run's figures as tables, one
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

import io
from collections import defaultdict
from pathlib import Path
from typing import Any

from tensorturn import layout
from tensorturn.errors import TensorTurnError
from tensorturn.layout import parse_label
from tensorturn.runs import report_page
from tensorturn.runs.report_page import clock
from tensorturn.spec import Outcome, options_json

NAMES = ("loss", "timeline", "samples_per_worker", "bytes")
PAGE = "report.html"

# the task kinds that train (a bar of their own colour); the others — outer steps, evaluations,
# the vote — are hatched, so a machine's coordination work stands out from its training
TRAINING = frozenset({"shard", "backup", "update", "update_backup", "segment"})

# how an attempt's bar looks, by the first word of its outcome (spec.Outcome)
OUTCOME_STYLE: dict[str, tuple[str, str]] = {
    Outcome.SUCCEEDED: ("tab:green", "succeeded"),
    Outcome.RUNNING: ("#9fd89f", "running"),
    Outcome.FAILED: ("tab:red", "failed"),
    Outcome.LOST: ("tab:orange", "lost (requeued)"),
    Outcome.HANDED_BACK: ("tab:purple", "handed back (owner)"),
    Outcome.CANCELLED: ("tab:gray", "cancelled"),
    Outcome.LATE: ("tab:olive", "late (ignored)"),
    Outcome.REFUSED: ("tab:brown", "refused"),
}


# ---- figures from the description ---------------------------------------------------------------

def _batch_size(doc: dict[str, Any]) -> int | None:
    spec = doc.get("spec") or {}
    if spec.get("batch_size"):
        return int(spec["batch_size"])
    try:  # the recipe's default; an unimportable recipe only costs the fallback estimate
        from tensorturn.recipes import resolve

        return int(resolve(spec["recipe"], spec.get("recipe_options") or {}).batch_size)
    except Exception:  # noqa: BLE001
        return None


def task_samples(doc: dict[str, Any]) -> dict[str, int]:
    """Samples trained by each task of the run, by task name (``r3/shard-2``, ``m1/seg-0``).

    Fused: a round's samples divided by its shard count (every shard takes H full batches), or
    H × batch size for a round not recorded yet. Ensemble: segment steps × batch size.
    """
    spec = doc.get("spec") or {}
    tasks = {a["task"] for a in doc.get("attempts", [])}
    options = options_json(spec)
    out: dict[str, int] = {}
    batch = None
    if doc.get("mode") == "fused":
        shards = int(options.get("shards") or 1)
        per_round = {int(r["round"]): int(r["samples"]) // shards
                     for r in doc.get("rounds", []) if r.get("samples") is not None}
        for task in tasks:
            label = parse_label(task)
            if label is None or label.kind != "shard" or label.round is None:
                continue
            r = label.round
            if r in per_round:
                out[task] = per_round[r]
            else:
                batch = batch or _batch_size(doc)
                if batch:
                    out[task] = int(options.get("sync_every") or 0) * batch
    else:
        batch = _batch_size(doc)
        if batch:
            for task in tasks:
                label = parse_label(task)
                if label is not None and label.kind == "segment":
                    out[task] = int(options.get("segment_steps") or 0) * batch
    return out


def worker_stats(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per worker, from its successful training attempts (shards, segments): tasks, samples,
    seconds busy, samples/s.

    Sorted by worker name. ``samples_per_s`` is the worker's rate while it trained (samples over
    the summed durations of its tasks), so idle time between tasks does not lower it.
    """
    samples = task_samples(doc)
    acc: dict[str, dict[str, Any]] = defaultdict(lambda: {"tasks": 0, "samples": 0, "busy_s": 0.0})
    for a in doc.get("attempts", []):
        if a.get("outcome") != Outcome.SUCCEEDED or a.get("finished_at") is None:
            continue
        label = parse_label(a["task"])
        if label is None or label.kind not in ("shard", "segment"):
            continue
        w = acc[a.get("worker") or "?"]
        w["tasks"] += 1
        w["samples"] += samples.get(a["task"], 0)
        w["busy_s"] += max(0.0, float(a["finished_at"]) - float(a["started_at"]))
    return [{"worker": name, **v,
             "samples_per_s": v["samples"] / v["busy_s"] if v["busy_s"] > 0 else None}
            for name, v in sorted(acc.items())]


def machines(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per machine that worked on the run: its training rate (:func:`worker_stats`), its attempts
    by how they ended, what it moved through the store and the dataset bytes it downloaded and
    its tasks read. Sorted by name."""
    stats = {s["worker"]: s for s in worker_stats(doc)}
    ended: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for a in doc.get("attempts", []):
        word = Outcome.of(a.get("outcome") or "")
        ended[a.get("worker") or "?"][word.value if word else "other"] += 1
    store = doc.get("store_bytes_by_worker") or {}
    downloaded, read = doc.get("data_bytes") or {}, doc.get("data_read_bytes") or {}
    names = sorted(set(stats) | set(ended) | set(store) | set(downloaded) | set(read))
    out = []
    for name in names:
        s = stats.get(name, {})
        out.append({"worker": name, "tasks": s.get("tasks", 0), "samples": s.get("samples", 0),
                    "busy_s": s.get("busy_s", 0.0), "samples_per_s": s.get("samples_per_s"),
                    "attempts": dict(sorted(ended[name].items())),
                    "store_up": int((store.get(name) or {}).get("up", 0)),
                    "store_down": int((store.get(name) or {}).get("down", 0)),
                    "data_downloaded": int(downloaded.get(name, 0)),
                    "data_read": int(read.get(name, 0))})
    return out


def origin(doc: dict[str, Any]) -> float | None:
    """Time zero of the run's figures: when it was created (broker clock), else its first start."""
    for key in ("created_at", "started_at"):
        if doc.get(key) is not None:
            return float(doc[key])
    starts = [float(a["started_at"]) for a in doc.get("attempts", []) if a.get("started_at") is not None]
    return min(starts, default=None)


def _latest(doc: dict[str, Any]) -> float | None:
    """The latest time the description knows: where a still-running attempt's bar ends."""
    times = [doc.get(k) for k in ("finished_at", "progress_at", "started_at", "created_at")]
    for a in doc.get("attempts", []):
        times += [a.get("started_at"), a.get("finished_at")]
    times += [i.get("at") for i in doc.get("incidents", [])]
    times += [r.get("at") for r in doc.get("rounds", [])]
    known = [float(t) for t in times if t is not None]
    return max(known, default=None)


def timeline(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Every task attempt as a bar: worker, task, attempt number, whether it trains, the first word
    of its outcome and the whole of it, and start and end in seconds since :func:`origin` (an
    attempt still running ends at the latest time the description knows). In start order."""
    t0, now = origin(doc), _latest(doc)
    bars = []
    for a in doc.get("attempts", []):
        if a.get("started_at") is None or t0 is None:
            continue
        label = parse_label(a["task"])
        word = Outcome.of(a.get("outcome") or "")
        end = a.get("finished_at")
        running = end is None
        end = float(end if end is not None else (now or a["started_at"]))
        bars.append({"worker": a.get("worker") or "?", "task": a["task"], "attempt": a.get("attempt"),
                     "training": label is not None and label.kind in TRAINING,
                     "ended": word.value if word else "other", "outcome": a.get("outcome") or "",
                     "start": float(a["started_at"]) - t0, "end": end - t0, "running": running})
    return sorted(bars, key=lambda b: (b["start"], b["worker"], b["task"]))


def _short(worker: str) -> str:
    return worker.split("@", 1)[0]


def _names(workers: list[str]) -> dict[str, str]:
    """Each worker's name on a figure: before the ``@`` where that stays unique, else whole."""
    shorts = [_short(w) for w in workers]
    return {w: s if shorts.count(s) == 1 else w for w, s in zip(workers, shorts)}


def _scale(values: list[float]) -> tuple[float, str]:
    top = max(values, default=0)
    for factor, unit in ((1024 ** 3, "GiB"), (1024 ** 2, "MiB"), (1024, "KiB")):
        if top >= factor:
            return factor, unit
    return 1, "B"


def _figure(width: float = 6.4, height: float = 4.0):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", metadata={"Software": None})
    return buf.getvalue()


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def _title(doc: dict[str, Any], what: str) -> str:
    return f"{what} — run {doc.get('run_id', '?')} ({doc.get('mode', '?')}, {doc.get('state', '?')})"


def _spread(items: list, most: int) -> list:
    """At most ``most`` of ``items``, evenly spread, the first and last kept."""
    if len(items) <= most:
        return items
    step = (len(items) - 1) / (most - 1)
    return [items[round(i * step)] for i in range(most)]


def _time_axis(ax, rounds: list[dict[str, Any]], t0: float | None) -> None:
    """A second x axis on top of a per-round plot: each round's time since the run was created
    (its ``at``, broker clock), at a few rounds so the labels do not overlap."""
    timed = [(r["round"], float(r["at"]) - t0) for r in rounds if r.get("at") is not None and t0 is not None]
    if not timed:
        return
    shown = _spread(timed, 6)
    top = ax.secondary_xaxis("top")
    top.set_xticks([r for r, _ in shown], labels=[clock(t) for _, t in shown], fontsize=7)
    top.set_xlabel("time since the run was created", fontsize=8)


def _round_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("round")
    ax.grid(alpha=0.3)


def _metric(keys: set[str], prefix: str) -> str | None:
    """The metric shown beside the loss: accuracy where the recipe reports it, else its first
    other metric (a regression's MAE), under ``prefix`` (``val_``, ``test_``)."""
    if f"{prefix}accuracy" in keys:
        return f"{prefix}accuracy"
    others = sorted(k for k in keys if k.startswith(prefix) and k not in (f"{prefix}loss", f"{prefix}rows"))
    return others[0] if others else None


def _loss_plot(doc: dict[str, Any]) -> bytes:
    if doc.get("mode") == "fused":
        fig = _figure(9.6, 4.2)
        ax_loss, ax_metric = fig.subplots(1, 2)
        rounds = doc.get("rounds") or []
        if not rounds:
            _empty(ax_loss, "no round finished yet")
            _empty(ax_metric, "no round finished yet")
        else:
            xs = [r["round"] for r in rounds]
            ax_loss.plot(xs, [r.get("loss") for r in rounds], "o-", label="training loss (shards' mean)")
            validated = [r for r in rounds if r.get("val_loss") is not None]  # --eval-every skips some
            ax_loss.plot([r["round"] for r in validated], [r["val_loss"] for r in validated], "s-",
                         label="validation loss")
            ax_loss.set_ylabel("loss (NLL, nats)")
            ax_loss.legend(fontsize=8)
            key = _metric({k for r in rounds for k, v in r.items() if v is not None}, "val_")
            if key is None:
                _empty(ax_metric, "no validation metric recorded")
            else:
                scored = [r for r in rounds if r.get(key) is not None]
                ax_metric.plot([r["round"] for r in scored], [r[key] for r in scored], "s-",
                               color="tab:orange", label=key.replace("_", " "))
                ax_metric.set_ylabel(key.replace("val_", "validation "))
                ax_metric.legend(fontsize=8)
                _round_axis(ax_metric)
                _time_axis(ax_metric, rounds, origin(doc))
            _round_axis(ax_loss)
            _time_axis(ax_loss, rounds, origin(doc))
        fig.suptitle(_title(doc, "loss and validation metric per round"), fontsize=9)
        return _png(fig)

    fig = _figure(8.0, 4.0)
    ax_loss, ax_acc = fig.subplots(1, 2)
    members = [m for m in doc.get("members") or [] if (m.get("metrics") or {}).get("test_loss") is not None]
    key = _metric({k for m in members for k in m["metrics"]}, "test_")
    if not members:
        _empty(ax_loss, "no member evaluated yet")
        _empty(ax_acc, "no member evaluated yet")
    else:
        labels = [f"m{m['member']}" for m in members]
        vote = doc.get("metrics") or {}
        for ax, name, title in ((ax_loss, "test_loss", "test loss (NLL)"),
                                (ax_acc, key, (key or "").replace("test_", "test "))):
            if name is None:
                _empty(ax, "no test metric recorded")
                continue
            values = [m["metrics"].get(name) or 0.0 for m in members]
            ax.bar(labels, values, color="tab:blue", label="member")
            if vote.get(name) is not None:
                ax.axhline(vote[name], color="tab:red", linestyle="--", label="vote")
            ax.set_ylabel(title)
            ax.set_xlabel("member")
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=8)
        if key == "test_accuracy":
            lo = min(m["metrics"].get(key) or 0.0 for m in members)
            ax_acc.set_ylim(max(0.0, min(lo, vote.get(key) or 1.0) - 0.05), 1.0)
    fig.suptitle(_title(doc, "members' test loss and accuracy"), fontsize=9)
    return _png(fig)


def _timeline_plot(doc: dict[str, Any]) -> bytes:
    bars = timeline(doc)
    incidents = [i for i in doc.get("incidents", []) if i.get("at") is not None]
    workers = sorted({b["worker"] for b in bars} | {i.get("worker") or "?" for i in incidents})
    fig = _figure(9.6, max(3.0, 1.6 + 0.45 * len(workers)))
    ax = fig.add_subplot()
    t0 = origin(doc)
    if not bars or t0 is None:
        _empty(ax, "no task attempt yet")
        ax.set_title(_title(doc, "who ran what"), fontsize=9)
        return _png(fig)
    from matplotlib.patches import Patch

    row = {w: i for i, w in enumerate(workers)}
    span = max(max(b["end"] for b in bars), max((float(i["at"]) - t0 for i in incidents), default=0.0))
    span = max(span, 1e-3)
    seen: dict[str, Any] = {}
    for b in bars:
        colour, name = OUTCOME_STYLE.get(b["ended"], ("black", b["ended"]))
        # a bar no narrower than 0.3 % of the axis: a 5 ms evaluation stays visible
        width = max(b["end"] - b["start"], span * 0.003)
        hatch = None if b["training"] else "////"
        ax.broken_barh([(b["start"], width)], (row[b["worker"]] - 0.35, 0.7), facecolors=colour,
                       edgecolor="black", linewidth=0.4, hatch=hatch)
        seen.setdefault(name, Patch(facecolor=colour, edgecolor="black", linewidth=0.4))
        if width > span * 0.08:  # named where the name fits
            ax.text(b["start"] + width / 2, row[b["worker"]], b["task"], ha="center", va="center",
                    fontsize=6, clip_on=True, bbox={"facecolor": "white", "alpha": 0.7, "linewidth": 0, "pad": 1})
    handles = list(seen.values())
    labels = list(seen)
    if any(not b["training"] for b in bars):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="////", linewidth=0.4))
        labels.append("outer step / evaluation / vote")
    if incidents:
        kinds = sorted({i.get("kind", "?") for i in incidents})
        marks = ax.scatter([float(i["at"]) - t0 for i in incidents],
                           [row[i.get("worker") or "?"] + 0.42 for i in incidents],
                           marker="X", color="black", s=36, zorder=3)
        handles.append(marks)
        labels.append("incident: " + ", ".join(kinds)[:60])
    rounds = [r for r in doc.get("rounds") or [] if r.get("at") is not None]
    for r in rounds:
        ax.axvline(float(r["at"]) - t0, color="gray", linestyle=":", linewidth=0.8)
    for r in _spread(rounds, 12):
        ax.text(float(r["at"]) - t0, 1.0, f"r{r['round']}", transform=ax.get_xaxis_transform(),
                ha="center", va="bottom", fontsize=7, color="gray")
    names = _names(workers)
    ax.set_yticks(range(len(workers)), labels=[names[w] for w in workers])
    ax.set_ylim(-0.6, len(workers) - 0.4)
    ax.invert_yaxis()
    ax.set_xlim(0, span * 1.02)
    ax.set_xlabel("seconds since the run was created (broker clock)"
                  + ("; dotted: a round's end" if rounds else ""))
    ax.grid(alpha=0.3, axis="x")
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(_title(doc, "who ran what"), fontsize=9)
    return _png(fig)


def _rate_plot(doc: dict[str, Any]) -> bytes:
    fig = _figure()
    ax = fig.add_subplot()
    stats = [s for s in worker_stats(doc) if s["samples_per_s"]]
    if not stats:
        _empty(ax, "no task finished yet")
    else:
        names = _names([s["worker"] for s in stats])
        bars = ax.bar([names[s["worker"]] for s in stats], [s["samples_per_s"] for s in stats], color="tab:green")
        for bar, s in zip(bars, stats):
            ax.annotate(f"{s['tasks']} task{'s' if s['tasks'] != 1 else ''}",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("samples/s while training")
        ax.set_xlabel("worker")
        ax.grid(alpha=0.3, axis="y")
        ax.margins(y=0.15)
    ax.set_title(_title(doc, "samples/s per worker"), fontsize=9)
    return _png(fig)


def _model_bytes(doc: dict[str, Any]) -> tuple[list[str], list[float], list[float], str, str]:
    """Labels, bytes up and down, x label and title of the model-bytes panel."""
    if doc.get("mode") == "fused":
        rounds = doc.get("rounds") or []
        return ([str(r["round"]) for r in rounds], [float(r.get("bytes_up") or 0) for r in rounds],
                [float(r.get("bytes_down") or 0) for r in rounds], "round", "model bytes per round")
    done = [a for a in doc.get("attempts", []) if a.get("outcome") == Outcome.SUCCEEDED]
    if done and all("bytes_up" in a for a in done):
        return ([a["task"] for a in done], [float(a["bytes_up"] or 0) for a in done],
                [float(a.get("bytes_down") or 0) for a in done], "task", "model bytes per task")
    if done:
        return ([f"mean of {len(done)} tasks"], [float(doc.get("bytes_up") or 0) / len(done)],
                [float(doc.get("bytes_down") or 0) / len(done)], "", "model bytes per task")
    return [], [], [], "", "model bytes per task"


def _bytes_plot(doc: dict[str, Any]) -> bytes:
    fig = _figure(11.2, 4.2)
    ax, ax_machines = fig.subplots(1, 2, width_ratios=[1.2, 1])
    labels, up, down, xlabel, what = _model_bytes(doc)
    if not labels:
        _empty(ax, "nothing transferred yet")
    else:
        factor, unit = _scale([u + d for u, d in zip(up, down)])
        ax.bar(labels, [u / factor for u in up], label="uploaded")
        ax.bar(labels, [d / factor for d in down], bottom=[u / factor for u in up],
               label="downloaded")
        ax.set_ylabel(f"{unit}")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3, axis="y")
        ax.margins(y=0.25)
        ax.legend(loc="upper right", fontsize=8)
        if len(labels) > 12:
            ax.tick_params(axis="x", labelrotation=90, labelsize=6)
    ax.set_title(what, fontsize=9)

    rows = [m for m in machines(doc) if m["store_up"] or m["store_down"] or m["data_downloaded"] or m["data_read"]]
    if not rows:
        _empty(ax_machines, "nothing moved through the store yet")
    else:
        series = (("store_up", "stored (all objects)", "tab:blue"),
                  ("store_down", "fetched (all objects)", "tab:orange"),
                  ("data_downloaded", "dataset downloaded", "tab:green"),
                  ("data_read", "dataset read by its tasks", "tab:olive"))
        factor, unit = _scale([float(m[k]) for m in rows for k, _, _ in series])
        names = _names([m["worker"] for m in rows])
        width = 0.8 / len(series)
        for i, (key, name, colour) in enumerate(series):
            ax_machines.bar([j + (i - 1.5) * width for j in range(len(rows))],
                            [m[key] / factor for m in rows], width, label=name, color=colour)
        ax_machines.set_xticks(range(len(rows)), labels=[names[m["worker"]] for m in rows])
        ax_machines.set_ylabel(unit)
        ax_machines.set_xlabel("machine")
        ax_machines.grid(alpha=0.3, axis="y")
        ax_machines.margins(y=0.3)
        ax_machines.legend(loc="upper right", fontsize=7)
    ax_machines.set_title("per machine: store traffic and dataset bytes", fontsize=9)
    fig.suptitle(_title(doc, "bytes moved"), fontsize=9)
    return _png(fig)


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
    return {"loss": _loss_plot(doc), "timeline": _timeline_plot(doc),
            "samples_per_worker": _rate_plot(doc), "bytes": _bytes_plot(doc)}


def report_files(doc: dict[str, Any]) -> dict[str, bytes]:
    """The report's files by name: ``<name>.png`` for each of :data:`NAMES`, then :data:`PAGE`
    (the page holds the PNGs too, so it can be shared alone)."""
    figures = plots(doc)
    page = report_page.render(doc, figures, machines(doc), timeline(doc), origin(doc))
    return {**{f"{name}.png": png for name, png in figures.items()}, PAGE: page.encode()}


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
