"""What the dashboard shows, as JSON: the pool (its machines, its runs, the served models) and
one run (progress, rounds, a per-machine timeline of attempts and incidents, bytes).

Built from the functions behind ``workers``, ``runs`` and ``status`` (:mod:`tensorturn.runs.records`),
so the page says what the CLI says. Every field is picked by name — a new field in a run's
description or a heartbeat does not reach the page until it is added here — and every string
is masked (:func:`tensorturn.config.mask_text`) on the way out: no pool key, password, token or
signature can reach the page, whatever a recipe or an error message quoted.
"""

from __future__ import annotations

import math
import time
from typing import Any

from tensorturn import config, layout
from tensorturn.errors import BrokerError, StoreError
from tensorturn.runs import records
from tensorturn.runs.follow import TRAINING_KINDS
from tensorturn.spec import FINISHED, MemberState, Outcome

# what a machine's row shows (``tensorturn workers --json`` has more: queues, incarnation, ...)
MACHINE_FIELDS = (
    "name", "state", "verified", "role", "device", "device_name", "cpu_count", "device_memory_gb",
    "memory_total_gb", "vram_gb", "cpu_percent", "memory_used_gb", "gpu_util_percent",
    "gpu_memory_used_gb", "task", "samples_per_s", "tasks_done", "quarantined", "paused",
    "last_seen_s", "stopped", "stopped_s", "hostname", "os", "link_up_bps", "link_down_bps", "link_stale",
    "broker_rtt_s", "cap_up_bps", "cap_down_bps", "data_cap_bytes", "data_cap_period", "data_used_bytes",
)
RUN_SUMMARY_FIELDS = ("run_id", "mode", "state", "recipe", "created_at", "finished_at", "metrics",
                      "error", "note")
ROUND_FIELDS = ("round", "loss", "val_loss", "val_accuracy", "val_metric", "samples", "bytes", "at",
                "seconds", "shards")
ATTEMPT_FIELDS = ("task", "attempt", "worker", "started_at", "finished_at", "outcome", "error")
INCIDENT_FIELDS = ("kind", "task", "worker", "at", "detail")
MEMBER_FIELDS = ("member", "state", "workers", "segments_done", "reason", "metrics", "live")
# what ended an attempt without its output: red on the timeline
FAILURES = (Outcome.FAILED, Outcome.LOST, Outcome.REFUSED, Outcome.LATE)


def public(value: Any) -> Any:
    """``value`` safe to show: every string masked, and any field named like a secret
    (:func:`tensorturn.config.secret_name`) dropped — the last line of defence behind the field
    lists above."""
    if isinstance(value, str):
        return config.mask_text(value)
    if isinstance(value, dict):
        return {k: public(v) for k, v in value.items()
                if not config.secret_name(k)}
    if isinstance(value, (list, tuple)):
        return [public(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):  # a diverged loss: JSON has no NaN
        return None
    return value


def pick(doc: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    return {f: doc[f] for f in fields if f in doc}


def machines(broker_url: str) -> list[dict[str, Any]]:
    """The pool's machines as ``tensorturn workers`` lists them, the page's fields only."""
    return [{**pick(w, MACHINE_FIELDS), "links": records.link_summary(w)} for w in records.workers(broker_url)]


def served_models(store_url: str, run_ids: list[str]) -> list[dict[str, Any]]:
    """The servers (``tensorturn serve``) that marked one of ``run_ids`` as served lately:
    run, address, host, the mark's age."""
    from tensorturn.state.manifest import servers
    from tensorturn.store.objects import open_store

    store = open_store(store_url)
    out = []
    for run_id in run_ids:
        for mark in servers(store, run_id):
            out.append({"run_id": run_id, "where": mark.get("where"), "host": mark.get("host"),
                        "age_s": mark.get("age_s")})
    return out


def pool_view(broker_url: str | None, store_url: str, runs_shown: int = 30,
              served: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The page's top half: machines (with a broker), the newest ``runs_shown`` runs, and the
    served models (``served``, computed less often by the caller: it lists the store)."""
    out: dict[str, Any] = {"as_of": time.time(), "broker": config.mask_url(broker_url) if broker_url else None,
                           "store": config.mask_url(store_url), "machines": [], "problems": []}
    if broker_url:
        try:
            out["machines"] = machines(broker_url)
            total, _ = records.refusals(broker_url)
            out["refused_messages"] = total
        except BrokerError as exc:
            out["problems"].append(f"broker: {exc}")
    else:
        out["problems"].append("no broker given (--broker or --join-file): machines are not shown, "
                               "runs are read from the store")
    try:
        listed = records.list_runs(broker_url, store_url, on_broker_down=lambda exc: None)
    except (BrokerError, StoreError) as exc:
        out["problems"].append(f"runs: {exc}")
        listed = []
    out["runs"] = [_summary(m) for m in listed[:runs_shown]]
    out["served"] = served or []
    return public(out)


def _summary(m: dict[str, Any]) -> dict[str, Any]:
    out = pick(m, RUN_SUMMARY_FIELDS)
    metrics = m.get("metrics") or {}
    out["metrics"] = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    return out


def run_view(run_id: str, broker_url: str | None, store_url: str) -> dict[str, Any]:
    """One run as the page draws it (``NotFound`` for an unknown run): its state and progress,
    rounds (loss and accuracy curves), members, attempts and incidents (the timeline), and the
    bytes each machine moved."""
    if not layout.RUN_ID.fullmatch(run_id):
        from tensorturn.errors import SpecError

        raise SpecError(f"{run_id!r} is not a run id")
    doc = records.describe(run_id, broker_url, store_url, on_broker_down=lambda exc: None)
    spec = doc.get("spec") or {}
    options = spec.get("options") or {}
    attempts = [pick(a, ATTEMPT_FIELDS) for a in doc.get("attempts") or []]
    incidents = [pick(i, INCIDENT_FIELDS) for i in doc.get("incidents") or []]
    out: dict[str, Any] = {
        **pick(doc, ("run_id", "mode", "state", "recipe", "note", "error", "created_at", "started_at",
                     "finished_at", "model_sha256", "warnings", "in_round", "outer_steps", "cancelled")),
        "as_of": _now(broker_url, doc),
        "finished": doc.get("state") in FINISHED,
        "metrics": {k: v for k, v in (doc.get("metrics") or {}).items() if isinstance(v, (int, float))},
        "options": {k: v for k, v in options.items() if isinstance(v, (int, float, str, bool)) or v is None},
        "rounds": [pick(r, ROUND_FIELDS) for r in doc.get("rounds") or []],
        "members": [pick(m, MEMBER_FIELDS) for m in doc.get("members") or []],
        "attempts": attempts,
        "incidents": incidents,
        "progress": _progress(doc, options),
        "bytes": {k: doc.get(k) for k in ("bytes_up", "bytes_down", "store_bytes_up", "store_bytes_down",
                                          "data_bytes", "data_read_bytes")},
        "machines": _per_machine(doc, attempts, incidents),
    }
    out["kept_round"] = out["metrics"].get("kept_round")
    return public(out)


def _now(broker_url: str | None, doc: dict[str, Any]) -> float:
    """Now on the clock the run's times were written on (the broker's), for running bars."""
    if doc.get("as_of"):
        return float(doc["as_of"])
    if broker_url and doc.get("state") not in FINISHED:
        from tensorturn.state.broker import check_broker
        from tensorturn.state.clock import broker_now

        try:
            return broker_now(check_broker(broker_url))
        except BrokerError:
            pass
    return time.time()


def _progress(doc: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """How far the run is: rounds recorded of rounds planned (fused), members finished of
    members (ensemble)."""
    if doc.get("mode") == "ensemble":
        members = doc.get("members") or []
        done = sum(1 for m in members if m.get("state") in (MemberState.SUCCEEDED, MemberState.DROPPED))
        return {"done": done, "total": len(members) or options.get("members"), "unit": "members"}
    total = options.get("rounds")
    if options.get("sync") == "async" and doc.get("updates") is not None:
        shards = int(options.get("shards") or 1)
        return {"done": len(doc["updates"]), "total": (total or 0) * shards or None, "unit": "updates"}
    return {"done": len(doc.get("rounds") or []), "total": total, "unit": "rounds"}


def _per_machine(doc: dict[str, Any], attempts: list[dict[str, Any]],
                 incidents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each machine that took part: its attempts (how many failed, how many run now), the
    seconds its finished training attempts took (their mean shows a slow machine: a run's
    training tasks are of one size), its incidents, the bytes it moved through the store and the dataset bytes it
    downloaded."""
    by: dict[str, dict[str, Any]] = {}

    def row(name: str) -> dict[str, Any]:
        return by.setdefault(name, {"name": name, "attempts": 0, "failed": 0, "running": 0,
                                    "finished": 0, "busy_s": 0.0, "incidents": 0,
                                    "store_bytes_up": 0, "store_bytes_down": 0, "data_bytes": 0})

    for a in attempts:
        if not a.get("worker"):
            continue
        r = row(str(a["worker"]))
        r["attempts"] += 1
        word = Outcome.of(str(a.get("outcome") or ""))
        if word == Outcome.RUNNING:
            r["running"] += 1
        elif word in FAILURES:
            r["failed"] += 1
        named = layout.parse_label(str(a.get("task")))
        if word == Outcome.SUCCEEDED and named is not None and named.kind in TRAINING_KINDS \
                and a.get("finished_at") and a.get("started_at"):
            r["finished"] += 1
            r["busy_s"] += max(0.0, float(a["finished_at"]) - float(a["started_at"]))
    for i in incidents:
        if i.get("worker"):
            row(str(i["worker"]))["incidents"] += 1
    for name, moved in (doc.get("store_bytes_by_worker") or {}).items():
        if isinstance(moved, dict):
            r = row(str(name))
            r["store_bytes_up"], r["store_bytes_down"] = int(moved.get("up") or 0), int(moved.get("down") or 0)
    data = doc.get("data_bytes")
    if isinstance(data, dict):
        for name, n in data.items():
            if isinstance(n, (int, float)):
                row(str(name))["data_bytes"] = int(n)
    for r in by.values():
        r["busy_s"] = round(r["busy_s"], 2)
        r["mean_attempt_s"] = round(r["busy_s"] / r["finished"], 2) if r["finished"] else None
    return sorted(by.values(), key=lambda r: r["name"])
