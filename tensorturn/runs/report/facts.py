"""What a run's report says, read from its description (the JSON of ``status --json``): samples
per task, each machine's rate, attempts and bytes, every attempt as a bar in time — and how a
duration and a byte count read. The figures (:mod:`.figures`) and the page (:mod:`.page`) draw
from these; nothing here draws."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from tensorturn.layout import parse_label
from tensorturn.spec import Outcome, options_json

# the task kinds that train (a bar of their own colour); the others — outer steps, evaluations,
# the vote — are hatched, so a machine's coordination work stands out from its training
TRAINING = frozenset({"shard", "backup", "update", "update_backup", "segment"})


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
    H × batch size for a round not recorded yet; an asynchronous run's update ``u<j>`` (and its
    backup copy) the samples its applied record holds, or H × batch size before it is applied.
    Ensemble: segment steps × batch size.
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
        per_update = {int(u["update"]): int(u["samples"])
                      for u in doc.get("updates") or [] if u.get("samples") is not None}
        for task in tasks:
            label = parse_label(task)
            if label is not None and label.kind in ("update", "update_backup") and label.update is not None:
                if label.update in per_update:
                    out[task] = per_update[label.update]
                else:
                    batch = batch or _batch_size(doc)
                    if batch:
                        out[task] = int(options.get("sync_every") or 0) * batch
                continue
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
    """Per worker, from its successful training attempts (shards, an asynchronous run's updates,
    segments): tasks, samples, seconds busy, samples/s.

    Sorted by worker name. ``samples_per_s`` is the worker's rate while it trained (samples over
    the summed durations of its tasks), so idle time between tasks does not lower it.
    """
    samples = task_samples(doc)
    acc: dict[str, dict[str, Any]] = defaultdict(lambda: {"tasks": 0, "samples": 0, "busy_s": 0.0})
    for a in doc.get("attempts", []):
        if a.get("outcome") != Outcome.SUCCEEDED or a.get("finished_at") is None:
            continue
        label = parse_label(a["task"])
        if label is None or label.kind not in ("shard", "update", "update_backup", "segment"):
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


def clock(seconds: float) -> str:
    """A duration as a person reads it: ``8.2s``, ``4m05s``, ``2h03m``."""
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


def size(n: float | int | None) -> str:
    """Bytes as a person reads them: ``1.2 MiB``."""
    value = float(n or 0)
    for factor, unit in ((1024 ** 3, "GiB"), (1024 ** 2, "MiB"), (1024, "KiB")):
        if value >= factor:
            return f"{value / factor:.1f} {unit}"
    return f"{int(value)} B"
