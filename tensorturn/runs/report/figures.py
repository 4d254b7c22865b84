"""The report's PNG figures, drawn from a run's description with matplotlib's Agg renderer through
:class:`matplotlib.figure.Figure` (no pyplot, no display, no global state); PNGs carry no
timestamp or version metadata. What each shows: :mod:`tensorturn.runs.report`."""

from __future__ import annotations

import io
from typing import Any

from tensorturn.runs.report.facts import clock, machines, origin, timeline, worker_stats
from tensorturn.spec import FINISHED, Outcome

NAMES = ("loss", "timeline", "samples_per_worker", "bytes")

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
    from matplotlib.text import Text

    # every string on a figure is text, never math: a machine called `gpu$\\foo$box`, a recipe's
    # metric or an incident's words are drawn as written (mathtext would parse `$…$` and fail)
    for text in fig.findobj(Text):
        text.set_parse_math(False)
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


def none_yet(doc: dict[str, Any], running: str) -> str:
    """What an empty chart says: ``running`` while there may be more, else why there is none (a
    weight soup trains nothing of its own)."""
    souped = (doc.get("lineage") or {}).get("souped_from")
    if souped:
        return f"a weight soup of run {souped}: it trained nothing itself"
    return running if doc.get("state") not in FINISHED else "none recorded"


def _loss_plot(doc: dict[str, Any]) -> bytes:
    if doc.get("mode") == "fused":
        fig = _figure(9.6, 4.2)
        ax_loss, ax_metric = fig.subplots(1, 2)
        rounds = doc.get("rounds") or []
        if not rounds:
            _empty(ax_loss, none_yet(doc, "no round finished yet"))
            _empty(ax_metric, none_yet(doc, "no round finished yet"))
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
        _empty(ax, none_yet(doc, "no task attempt yet"))
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
    ax.set_title(_title(doc, "who ran what"), fontsize=9, pad=14 if rounds else 6)  # above the round labels
    return _png(fig)


def no_rate(doc: dict[str, Any]) -> str:
    """Why a run has no training rate: what did finish, when something did."""
    done = sum(1 for a in doc.get("attempts") or [] if str(a.get("outcome")) == "succeeded")
    if not done:
        return "no training rate yet (no task finished)"
    return (f"no training rate: {done} task{'s' if done != 1 else ''} finished, but the samples "
            f"they trained are unknown (no round recorded)")


def _rate_plot(doc: dict[str, Any]) -> bytes:
    fig = _figure()
    ax = fig.add_subplot()
    stats = [s for s in worker_stats(doc) if s["samples_per_s"]]
    if not stats:
        _empty(ax, no_rate(doc))
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


def draw(doc: dict[str, Any]) -> dict[str, bytes]:
    """PNG bytes by name (:data:`NAMES`)."""
    return {"loss": _loss_plot(doc), "timeline": _timeline_plot(doc),
            "samples_per_worker": _rate_plot(doc), "bytes": _bytes_plot(doc)}
