"""What a live run is doing now: the progress inside a round, the phase of an outer step, each
ensemble member's segment and loss.

Running tasks report into the run's live hash (:func:`tensorturn.layout.live_key`): a training
task its step and loss at most once a second, in the round trip it already makes for
``tensorturn workers`` (:class:`tensorturn.pool.telemetry.TaskReporter`); an outer step its phase
when it changes. :func:`view` joins that with the run's attempts into what ``describe`` shows;
the modes turn it into one line (``Mode.live_line``); :class:`Progress` reads and writes the
hash. How a run's figures read in those lines is here too (:func:`figure`, :func:`figures`).
No torch, no Celery here.
"""

from __future__ import annotations

import json
from typing import Any

from tensorturn import layout
from tensorturn.spec import MemberState, Outcome, options_json
from tensorturn.state.clock import broker_now

WIDTH = 80  # a progress line fits a terminal of this many columns


def fit(text: str, width: int = WIDTH) -> str:
    """``text`` cut to ``width`` columns, ending in "…" when cut."""
    return text if len(text) <= width else text[:max(width - 1, 0)] + "…"


def figure(value: Any) -> str:
    """A figure as a person reads it: a float to 4 significant digits (``0.975``, not float32's
    ``0.9750000238418579``; ``2941``; ``1.234e-05``), anything else as it is. Only printed
    lines round: the records and ``--json`` keep every digit."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def figures(values: dict[str, Any], prefix: str, brief: bool = False) -> str:
    """The metrics among ``values`` named ``<prefix><metric>`` (``val_``, ``test_``) as words
    for a line — ``val_loss 2941  val_acc 0.975  val_mae 43.2`` —: loss and accuracy (as
    ``acc``) first, then the recipe's other metrics by name (its own ``evaluate``'s, in the
    user's units: a regression's MAE, R²…), not the rows they were read from. ``brief``: the
    accuracy alone where there is one (a classifier's headline)."""
    named = {k[len(prefix):]: v for k, v in values.items()
             if k.startswith(prefix) and k != f"{prefix}rows" and isinstance(v, (int, float))}
    if brief and "accuracy" in named:
        named = {"accuracy": named["accuracy"]}
    order = sorted(named, key=lambda m: (m != "loss", m != "accuracy", m))
    return "  ".join(f"{prefix}{'acc' if m == 'accuracy' else m} {figure(named[m])}" for m in order)


def place(label: str, shards: int) -> tuple[int, int] | None:
    """(round, shard) a training task's label works on: a shard, its backup copy, or an
    asynchronous update (shard j mod S of round j div S); None for any other task."""
    named = layout.parse_label(label)
    if named is None:
        return None
    if named.kind in ("shard", "backup") and named.round is not None and named.shard is not None:
        return named.round, named.shard
    if named.kind in ("update", "update_backup") and named.update is not None and shards:
        return divmod(named.update, shards)
    return None


def live_field(label: layout.Label, shards: int = 0) -> str:
    """Where a training task reports in the live hash: its place, not its label (``shard-3``,
    ``backup-3``, ``m1``), so the next round's task of that place replaces it and the hash
    stays as small as the work running at once."""
    if label.kind == "segment":
        return f"m{label.member}"
    where = place(str(label), shards)
    if where is None:
        return str(label)
    return f"{'backup' if 'backup' in label.kind else 'shard'}-{where[1]}"


def view(doc: dict[str, Any], entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """What to add to a live run's description (``doc``, from the board) given its live hash's
    ``entries``: ``in_round`` and ``outer_steps`` for a fused run, each member's ``live`` for
    an ensemble."""
    if doc.get("mode") == "ensemble":
        return {"members": _members(doc.get("members") or [], entries)}
    return {"in_round": in_round(doc, entries), "outer_steps": outer_steps(doc, entries)}


def in_round(doc: dict[str, Any], entries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The round being trained — the latest one a shard attempt began, or the one after the
    last recorded (round 0 before any) — with its shards done and the inner steps taken by all
    of its shards (a finished shard counts whole; a running one its last reported step)."""
    opts = options_json(doc.get("spec") or {})
    shards, per_shard = int(opts.get("shards") or 0), int(opts.get("sync_every") or 0)
    begun = [(where, a) for a in doc.get("attempts", [])
             if (where := place(a["task"], shards)) is not None]
    after = min(max((rec["round"] + 1 for rec in doc.get("rounds", [])), default=0),
                max(int(opts.get("rounds") or 1) - 1, 0))
    r = max([after, *(where[0] for where, _ in begun)])
    done = {where[1] for where, a in begun if where[0] == r and a["outcome"] == Outcome.SUCCEEDED}
    steps = dict.fromkeys(done, per_shard)
    for entry in entries.values():
        where = place(entry.get("label", ""), shards)
        if where is not None and where[0] == r and where[1] not in done:
            steps[where[1]] = max(steps.get(where[1], 0), min(int(entry.get("step") or 0), per_shard))
    return {"round": r, "shards_done": len(done), "shards": shards,
            "steps_done": sum(steps.values()), "steps_total": shards * per_shard}


def outer_steps(doc: dict[str, Any], entries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The outer steps and round evaluations running now: round, what (``outer step`` or
    ``evaluation``), phase (averaging, evaluating, testing; "starting" before the first),
    worker, and since when (the phase's start)."""
    out = []
    for a in doc.get("attempts", []):
        named = layout.parse_label(a["task"])
        if a["outcome"] != Outcome.RUNNING or named is None or named.kind not in ("outer", "eval"):
            continue
        entry = entries.get(a["task"]) or {}
        fresh = entry.get("worker") == a["worker"] and float(entry.get("at") or 0) >= a["started_at"]
        starting = "starting" if named.kind == "outer" else "evaluating"  # (an evaluation says no phase)
        out.append({"round": named.round, "what": "outer step" if named.kind == "outer" else "evaluation",
                    "phase": entry["phase"] if fresh else starting,
                    "worker": a["worker"], "since": entry["at"] if fresh else a["started_at"]})
    return sorted(out, key=lambda o: o["round"])


def _members(members: list[dict[str, Any]], entries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each member, a training one with ``live``: the segment it trains, its step and loss."""
    out = []
    for m in members:
        entry = entries.get(f"m{m['member']}")
        named = layout.parse_label(entry.get("label", "")) if entry else None
        if entry and named is not None and m.get("state") == MemberState.RUNNING:
            m = {**m, "live": {"segment": named.segment, "step": entry.get("step") or 0,
                               "steps": entry.get("steps") or 0, "loss": entry.get("loss")}}
        out.append(m)
    return out


class Progress:
    """The run's live hash (:func:`tensorturn.layout.live_key`): what its running tasks are doing."""

    def __init__(self, client: Any):
        self.r = client

    def mark_phase(self, run_id: str, label: str, phase: str, worker: str) -> None:
        """Say what the task ``label`` is doing now (an outer step: averaging, evaluating)."""
        self.r.hset(layout.live_key(run_id), label, json.dumps(
            {"label": label, "phase": phase, "worker": worker, "at": broker_now(self.r)}))

    def write(self, run_id: str, field: str, entry: dict[str, Any], pipe: Any) -> None:
        """A training task's report (``entry``: label, step, loss, worker, time) at ``field``
        (:func:`live_field`), in ``pipe``."""
        pipe.hset(layout.live_key(run_id), field, json.dumps(entry))

    def clear(self, run_id: str, pipe: Any, *fields: str) -> None:
        """``fields``' reports go (their tasks are over), in ``pipe``."""
        pipe.hdel(layout.live_key(run_id), *fields)

    def entries(self, run_id: str) -> dict[str, dict[str, Any]]:
        return {k: json.loads(v) for k, v in self.r.hgetall(layout.live_key(run_id)).items()}

    def forget(self, run_id: str, pipe: Any) -> None:
        """Every report goes (a resume starts afresh), in ``pipe``."""
        pipe.delete(layout.live_key(run_id))
