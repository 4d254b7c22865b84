"""Figures of one run, drawn from its description (the JSON of ``status --json``, the manifest).

:func:`plots` returns PNG bytes by name and needs nothing but the description; :func:`save_report`
puts them beside the run's manifest, at ``runs/<id>/report/<name>.png``, through the store.

* ``loss`` — fused: the shards' mean training loss and the validation loss per round;
  ensemble: each member's test loss and accuracy as bars, with the vote's as a line.
* ``samples_per_worker`` — samples/s of each worker while it trained, from the task attempts
  (samples of a task / its duration), with the number of tasks it did.
* ``bytes`` — fused: bytes uploaded and downloaded per round; ensemble: per task (the mean per
  task when the description carries only the run's totals).

Only successful attempts count towards rates. A run that has not produced a figure yet (no round
finished, no member evaluated) still gets its PNG, saying so, so the set of names is fixed.
Drawing uses matplotlib's Agg renderer through :class:`matplotlib.figure.Figure` (no pyplot, no
display, no global state), and PNGs carry no timestamp or version metadata.
"""

from __future__ import annotations

import io
from collections import defaultdict
from typing import Any

from tensorturn import layout
from tensorturn.errors import TensorTurnError
from tensorturn.layout import parse_label
from tensorturn.spec import Outcome, options_json

NAMES = ("loss", "samples_per_worker", "bytes")



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


def _short(worker: str) -> str:
    return worker.split("@", 1)[0]


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


def _loss_plot(doc: dict[str, Any]) -> bytes:
    if doc.get("mode") == "fused":
        fig = _figure()
        ax = fig.add_subplot()
        rounds = doc.get("rounds") or []
        if not rounds:
            _empty(ax, "no round finished yet")
        else:
            xs = [r["round"] for r in rounds]
            ax.plot(xs, [r.get("loss") for r in rounds], "o-", label="training loss (shards' mean)")
            validated = [r for r in rounds if r.get("val_loss") is not None]  # --eval-every skips some
            ax.plot([r["round"] for r in validated], [r["val_loss"] for r in validated], "s-",
                    label="validation loss")
            ax.set_xlabel("round")
            ax.set_ylabel("loss (NLL, nats)")
            ax.set_xticks(xs)
            ax.grid(alpha=0.3)
            ax.legend()
        ax.set_title(_title(doc, "loss per round"), fontsize=9)
        return _png(fig)

    fig = _figure(8.0, 4.0)
    ax_loss, ax_acc = fig.subplots(1, 2)
    members = [m for m in doc.get("members") or [] if (m.get("metrics") or {}).get("test_loss") is not None]
    if not members:
        _empty(ax_loss, "no member evaluated yet")
        _empty(ax_acc, "no member evaluated yet")
    else:
        labels = [f"m{m['member']}" for m in members]
        vote = doc.get("metrics") or {}
        for ax, key, name in ((ax_loss, "test_loss", "test loss (NLL)"),
                              (ax_acc, "test_accuracy", "test accuracy")):
            values = [m["metrics"].get(key) or 0.0 for m in members]
            ax.bar(labels, values, color="tab:blue", label="member")
            if vote.get(key) is not None:
                ax.axhline(vote[key], color="tab:red", linestyle="--", label="vote")
            ax.set_ylabel(name)
            ax.set_xlabel("member")
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=8)
        lo = min(m["metrics"].get("test_accuracy") or 0.0 for m in members)
        ax_acc.set_ylim(max(0.0, min(lo, vote.get("test_accuracy") or 1.0) - 0.05), 1.0)
    fig.suptitle(_title(doc, "members' test loss and accuracy"), fontsize=9)
    return _png(fig)


def _rate_plot(doc: dict[str, Any]) -> bytes:
    fig = _figure()
    ax = fig.add_subplot()
    stats = [s for s in worker_stats(doc) if s["samples_per_s"]]
    if not stats:
        _empty(ax, "no task finished yet")
    else:
        names = [_short(s["worker"]) for s in stats]
        bars = ax.bar(names, [s["samples_per_s"] for s in stats], color="tab:green")
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


def _bytes_plot(doc: dict[str, Any]) -> bytes:
    fig = _figure()
    ax = fig.add_subplot()
    if doc.get("mode") == "fused":
        rounds = doc.get("rounds") or []
        labels = [str(r["round"]) for r in rounds]
        up = [float(r.get("bytes_up") or 0) for r in rounds]
        down = [float(r.get("bytes_down") or 0) for r in rounds]
        xlabel, what = "round", "bytes per round"
    else:
        done = [a for a in doc.get("attempts", []) if a.get("outcome") == Outcome.SUCCEEDED]
        if done and all("bytes_up" in a for a in done):
            labels = [a["task"] for a in done]
            up = [float(a["bytes_up"] or 0) for a in done]
            down = [float(a.get("bytes_down") or 0) for a in done]
            xlabel, what = "task", "bytes per task"
        elif done:
            labels = [f"mean of {len(done)} tasks"]
            up = [float(doc.get("bytes_up") or 0) / len(done)]
            down = [float(doc.get("bytes_down") or 0) / len(done)]
            xlabel, what = "", "bytes per task"
        else:
            labels, up, down, xlabel, what = [], [], [], "", "bytes per task"
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
    ax.set_title(_title(doc, what), fontsize=9)
    return _png(fig)


def plots(doc: dict[str, Any]) -> dict[str, bytes]:
    """PNG bytes by name (:data:`NAMES`) for one run's description."""
    if not isinstance(doc, dict) or not doc.get("run_id") or doc.get("mode") not in ("fused", "ensemble"):
        raise TensorTurnError("not a run description: expected the JSON of `tensorturn status --json`")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise TensorTurnError("reports need matplotlib: pip install matplotlib") from None
    return {"loss": _loss_plot(doc), "samples_per_worker": _rate_plot(doc),
            "bytes": _bytes_plot(doc)}


def save_report(doc: dict[str, Any], store) -> list[str]:
    """Draw the run's figures and put them at ``runs/<id>/report/<name>.png`` in ``store``
    (a :class:`tensorturn.store.objects.Store`); returns their URIs in :data:`NAMES` order."""
    uris = []
    for name, png in plots(doc).items():
        key = layout.key("report", doc["run_id"], name)
        store.put_bytes(key, png)
        uris.append(store.uri(key))
    return uris
