"""What the broker and the store hold about runs and machines: a run's description, the list
of runs, the pool's agents and the task messages they refused; removing a finished run and pruning
the broker's leftovers — the functions behind ``status``, ``runs``, ``runs rm`` and ``workers``.

A run the broker no longer knows is read from its manifest in the store. Nothing here imports
torch, Celery or boto3 until a function needs them: ``runs`` and ``status`` answer at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tensorturn import layout
from tensorturn.errors import BrokerError, NotFound, SpecError, StoreError
from tensorturn.runs.follow import annotate
from tensorturn.spec import FINISHED
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import check_broker


def stored_manifest(store: Any, run_id: str) -> dict[str, Any] | None:
    """The run's manifest in ``store``; None when it has none (yet, or any more)."""
    from tensorturn.state.manifest import read_manifest
    from tensorturn.store.objects import ObjectMissing

    try:
        return read_manifest(store, run_id)
    except ObjectMissing:
        return None


def refusals(broker_url: str) -> tuple[int, list[dict[str, Any]]]:
    """How many task messages agents refused (bad signatures, and the like) since the broker
    started, and the last hundred of them, newest first. The count is kept apart from the list
    so that a flood of refusals cannot hide how many there were, or that the first ones came."""
    from tensorturn.state.refusals import refusals as kept

    return kept(check_broker(broker_url))


def workers(broker_url: str) -> list[dict[str, Any]]:
    """The pool's agents with their inventory, live figures and state; one offline for longer
    than ``TENSORTURN_AGENT_TTL_S`` is forgotten (:mod:`tensorturn.state.housekeeping`), not listed."""
    from tensorturn.state.housekeeping import forgotten
    from tensorturn.state.roster import list_workers

    return [w for w in list_workers(check_broker(broker_url)) if not forgotten(w)]


def link_summary(w: dict[str, Any]) -> str:
    """A machine's links in words, as ``workers`` and the dashboard show them: the measured
    rates against the owner's caps (Mbit/s), the broker's round trip, and the data budget used:
    ``up 18.2/20 down 95.1 Mbit/s, rtt 41 ms, data 12.3/200 GB this month``. What was never
    measured is said so, and a measurement older than ten minutes is said to be stale."""
    def way(name: str) -> str:
        measured, cap = w.get(f"link_{name}_bps"), w.get(f"cap_{name}_bps") or 0
        text = "not measured" if measured is None else f"{measured * 8 / 1e6:.1f}"
        return f"{name} {text}" + (f"/{cap * 8 / 1e6:g}" if cap else "")

    parts = [f"{way('up')} {way('down')} Mbit/s" + (" (stale)" if w.get("link_stale") else "")]
    rtt = w.get("broker_rtt_s")
    parts.append("rtt not measured" if rtt is None else f"rtt {rtt * 1000:.0f} ms")
    if w.get("data_cap_bytes"):
        parts.append(f"data {w.get('data_used_bytes', 0) / 1e9:.3g}/{w['data_cap_bytes'] / 1e9:g} GB "
                     f"this {w.get('data_cap_period') or 'period'}")
    return ", ".join(parts)


def prune(broker_url: str) -> dict[str, Any]:
    """Prune the broker's leftovers now (:func:`tensorturn.state.housekeeping.prune`)."""
    from tensorturn.state.housekeeping import prune as prune_now

    return prune_now(check_broker(broker_url))


BrokerDown = Callable[[BrokerError], None]


def _board(broker_url: str | None, on_broker_down: BrokerDown | None
           ) -> tuple[RunBoard | None, BrokerError | None]:
    """The broker's runs, and why there are none: (None, None) without a broker; (None, the
    error) when it does not answer and the caller reads the store instead (``on_broker_down``
    is told; without it, BrokerError is raised)."""
    if not broker_url:
        return None, None
    try:
        return RunBoard(check_broker(broker_url)), None
    except BrokerError as exc:
        if on_broker_down is None:
            raise
        on_broker_down(exc)
        return None, exc


def describe(run_id: str, broker_url: str | None, store_url: str,
             on_broker_down: BrokerDown | None = None) -> dict[str, Any]:
    """A run's description from the broker, or from its manifest in the store when the broker
    has no record of it (after an embedded run, whose Redis is gone, or a Redis that lost its
    data — then ``note`` says so and how to continue), or a finished record behind the run's
    manifest (:func:`~tensorturn.state.manifest.settle_from_store`: Redis went back in time).
    With ``on_broker_down``, a broker that does not answer is reported to it and the store is
    read too."""
    from tensorturn.state.manifest import settle_from_store
    from tensorturn.store.objects import open_store

    board, down = _board(broker_url, on_broker_down)
    if board is not None and board.runs.exists(run_id):
        settled = False  # a running run's record is settled by its own tasks, which come back with it
        if board.runs.is_finished(run_id):
            try:
                settled = settle_from_store(open_store(store_url), board, run_id)
            except StoreError:  # the broker's record is all there is to show now
                pass
        if not settled:
            return annotate(board.describe(run_id), board)
    doc = stored_manifest(open_store(store_url), run_id)
    if doc is None and down:  # it may well be on the broker: that is what went wrong
        raise BrokerError(f"{down}; and the store has no run {run_id!r}")
    if doc is None:
        where = "on the broker or in the store" if board is not None else "in the store"
        raise NotFound(f"no run {run_id!r} {where} (see `tensorturn runs`)")
    if doc.get("state") not in FINISHED:
        if board is not None:
            why = "the broker has no record of the run (Redis lost its data, or its keys were deleted?)"
        elif broker_url:
            why = "the broker does not answer (start the coordinator again to follow it)"
        else:
            why = "no broker is following it"
        doc["note"] = (f"the last saved state is '{doc.get('state')}', but {why}; "
                       f"continue it with `tensorturn resume {run_id}`")
    return doc


SUMMARY = ("run_id", "mode", "state", "recipe", "created_at", "finished_at", "metrics", "error")


def list_runs(broker_url: str | None, store_url: str,
              on_broker_down: BrokerDown | None = None) -> list[dict[str, Any]]:
    """Runs known to the broker and the manifests in the store, newest first; a run the store
    knows but the broker lost says so in ``note``. With ``on_broker_down``, a broker that does
    not answer is reported to it and the store's runs are listed."""
    from tensorturn.store.objects import open_store

    runs: dict[str, dict[str, Any]] = {}
    board, _ = _board(broker_url, on_broker_down)
    if board is not None:
        runs = {m["run_id"]: m for m in board.runs.list_runs()}
    store = open_store(store_url)
    for key in store.list(layout.RUNS):
        parts = layout.parse("manifest", key)
        run_id = parts["run_id"] if parts else None
        if run_id is None or run_id in runs:
            continue
        try:
            m = store.get_json(key)
        except StoreError:
            continue
        summary = {k: m.get(k) for k in SUMMARY}  # the signature is not among them
        if board is not None and summary["state"] not in FINISHED:
            summary["note"] = f"not on this broker; `tensorturn resume {run_id}` continues it"
        runs[run_id] = summary
    return sorted(runs.values(), key=lambda m: m.get("created_at") or 0, reverse=True)


Confirm = Callable[[dict[str, Any]], bool]


def remove_run(run_id: str, broker_url: str | None, store_url: str,
               confirm: Confirm | None = None, force: bool = False) -> dict[str, Any] | None:
    """Delete a run: every object under ``runs/<id>/`` in the store, then its keys on the broker.

    Refused (SpecError, nothing deleted) while the run may still be used: unless it finished —
    by the broker's record, or, where the broker has none, by its manifest (an unfinished one
    only with ``force``: the broker asked may be another pool's) — while a live run on the
    broker reads it (its ``--init-from``, the teacher of a distillation), and while a server marks it as served
    (:func:`tensorturn.state.manifest.servers`). ``confirm`` is asked last, with what would go:
    False deletes nothing and returns None. Returns what was deleted."""
    from tensorturn.state.manifest import servers
    from tensorturn.store.objects import open_store

    if not layout.RUN_ID.fullmatch(run_id):
        raise SpecError(f"{run_id!r} is not a run id (see `tensorturn runs`)")
    store = open_store(store_url)
    board, _ = _board(broker_url, None)  # a broker that does not answer: BrokerError, nothing deleted
    sizes = store.sizes(f"{layout.RUNS}{run_id}/")
    if not sizes and not (board and board.runs.keys(run_id)):
        where = "on the broker or in the store" if board else "in the store"
        raise NotFound(f"no run {run_id!r} {where} (see `tensorturn runs`)")
    plan = {"run_id": run_id, "state": _removable_state(run_id, board, store, force),
            "objects": len(sizes), "bytes": sum(sizes.values())}
    readers = [other for other, spec in (board.runs.live_specs() if board else {}).items()
               if run_id in _runs_read(spec)]
    if readers:
        raise SpecError(f"run {run_id} is read by run{'s' * (len(readers) > 1)} "
                        f"{', '.join(readers)}, still running; nothing was removed")
    serving = servers(store, run_id)
    if serving:
        mark = serving[0]
        raise SpecError(f"run {run_id} is being served ({mark.get('where')} on {mark.get('host')}, "
                        f"seen {mark['age_s']:.0f}s ago): stop that server first; nothing was removed")
    if confirm is not None and not confirm(plan):
        return None
    store.delete_folder(f"{layout.RUNS}{run_id}/")
    plan["broker_keys"] = board.runs.forget(run_id) if board else 0
    return plan


def _removable_state(run_id: str, board: RunBoard | None, store: Any, force: bool = False) -> str:
    """The state of a run ``remove_run`` may delete; SpecError for one that may be running."""
    if board is not None and board.runs.exists(run_id):
        state = board.runs.state(run_id) or "unknown"
        if state not in FINISHED:
            raise SpecError(f"run {run_id} is {state}: cancel it first (`tensorturn cancel {run_id}`); "
                            f"nothing was removed")
        return state
    manifest = stored_manifest(store, run_id)
    state = str(manifest.get("state")) if isinstance(manifest, dict) else "unknown"
    if state in FINISHED:
        return state
    if not force:
        where = ("the broker has no record of it (is it this run's pool?)" if board is not None
                 else "without its pool's broker (--join-file or --broker) nothing says whether it still runs")
        raise SpecError(f"run {run_id}'s last saved state is '{state}', and {where}; nothing was "
                        f"removed (--force removes it all the same)")
    return f"{state} (removed by --force: no broker record says it finished)"


def _runs_read(spec: dict[str, Any]) -> set[str]:
    """The runs whose files a run with ``spec`` reads as it trains."""
    options = spec.get("options") or {}
    recipe_options = spec.get("recipe_options") or {}
    return {str(v) for v in (options.get("init_from"), recipe_options.get("teacher")) if v}
