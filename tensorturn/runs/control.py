"""Changing a run's course: cancelling a live run, and resuming a stopped one (its chain lost,
cancelled, or failed for a cause since fixed) from what the store holds.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any

from tensorturn import config
from tensorturn.errors import NotFound, SpecError
from tensorturn.runs.records import stored_manifest
from tensorturn.spec import Outcome, RunState
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import check_broker
from tensorturn.state.queues import drop_queued


def resume(run_id: str, broker_url: str, store_url: str,
           allow: Collection[str] = (), replan: bool = False) -> tuple[dict[str, Any], str]:
    """Continue a run whose chain was lost (Redis lost its data, the embedded pool was stopped)
    or that failed and whose cause is fixed, from the store alone. ``allow``: recipe names this
    process may build besides the machine's allowlist (:func:`tensorturn.recipes.resolve`).

    With ``replan`` (a fused run started with ``--plan auto``), the plan is made again from
    today's figures before anything is queued (:func:`tensorturn.modes.fused.timing.replan`):
    the spec keeps it, and the run records it as an incident.

    Returns the run's description and a sentence on what was resumed.
    """
    from tensorturn.modes import get_mode
    from tensorturn.pool.celery_app import configure
    from tensorturn.state.manifest import fail_run, load_spec, save_spec
    from tensorturn.store.objects import ObjectMissing, open_store

    store = open_store(store_url)
    try:
        spec = load_spec(store, run_id)
    except ObjectMissing:
        raise NotFound(f"no run {run_id!r} in the store {config.mask_url(store_url)}") from None
    if replan:
        check_replan(spec)
    client = check_broker(broker_url)
    configure(broker_url)
    board = RunBoard(client)
    if board.runs.exists(run_id):
        # the board's state is not signed: "succeeded" is believed when the signed manifest says
        # it too (saved before the board's state moves); a run that did end unsaved (the store
        # was down) finalizes again, its outputs stored already
        if board.runs.state(run_id) == RunState.SUCCEEDED and succeeded_in(store, run_id):
            raise SpecError(f"run {run_id} already succeeded; nothing to resume")
        board.reopen(run_id)
    else:  # lost, or partly: what is left of the chain (queued, or written since) goes first
        manifest = stored_manifest(store, run_id)
        if manifest and manifest.get("state") == RunState.SUCCEEDED:
            raise SpecError(f"run {run_id} already succeeded; nothing to resume")
        drop_queued(client, run_id)
        board.restore(spec, manifest)
    if spec.store_url != store.url:  # the store moved: tasks follow the one given here
        spec.store_url = store.url
        save_spec(store, spec)
        board.runs.update_spec(spec)
    try:
        if replan:
            from tensorturn.modes.fused.timing import replan as plan_again

            note = plan_again(spec, client, allow)
            save_spec(store, spec)
            board.runs.update_spec(spec)
            board.incidents.add(run_id, "replanned", "", "", note)
        what = get_mode(spec.mode).resume(spec, store, board, allow)
    except Exception as exc:
        # reopened but nothing queued: say so on the run rather than leave it `running`
        fail_run(store, board, run_id, f"resume failed: {type(exc).__name__}: {exc}; try "
                                       f"`tensorturn resume {run_id}` again once the cause is fixed")
        raise
    return board.describe(run_id), what


def check_replan(spec: Any) -> None:
    """SpecError unless ``resume --replan`` can plan ``spec``'s run again: a fused run started
    with ``--plan auto``."""
    if spec.mode != "fused":
        raise SpecError(f"--replan makes a fused run's plan again; run {spec.run_id} is not fused "
                        f"(--mode {spec.mode})")
    if getattr(spec.options, "plan", "auto") != "auto":
        raise SpecError(f"run {spec.run_id} was started with --plan off: there is no plan to make "
                        f"again (resume it without --replan)")


def succeeded_in(store: Any, run_id: str) -> bool:
    """Whether the run's manifest in ``store``, signed with the pool key, says it succeeded."""
    from tensorturn.state.manifest import read_manifest
    from tensorturn.store.objects import ObjectMissing
    from tensorturn.trust import UntrustedError

    try:
        return read_manifest(store, run_id, verify=True).get("state") == RunState.SUCCEEDED
    except (ObjectMissing, UntrustedError):
        return False


CANCEL_WAIT_S = 30.0  # how long `cancel` waits for running attempts to stop before it answers


def cancel(run_id: str, broker_url: str, store_url: str, by: str,
           wait_s: float = CANCEL_WAIT_S) -> tuple[dict[str, Any], str]:
    """Cancel a live run: it is ``cancelled`` at once, its queued task messages are dropped, and
    its running attempts stop at their next look (about a second) and store nothing; then
    its manifest is saved. Returns the run's description and a sentence on what happened.

    ``resume`` continues a cancelled run from its last complete round or checkpoints."""
    from tensorturn.config import mask_text
    from tensorturn.state.manifest import end_run, try_write_manifest
    from tensorturn.store.objects import open_store

    client = check_broker(broker_url)
    board = RunBoard(client)
    if not board.runs.exists(run_id):
        raise NotFound(board.runs.absent(run_id))
    store = open_store(store_url)
    # the manifest says cancelled before the board does (whoever sees it cancelled finds the
    # store agreeing), and again once the running attempts stopped
    if not end_run(store, board, run_id, RunState.CANCELLED, cancelled_by=mask_text(by)):
        state = board.runs.state(run_id)
        if state == RunState.CANCELLED:
            return board.describe(run_id), f"run {run_id} was cancelled already"
        raise SpecError(f"run {run_id} has {state}: there is nothing to cancel")
    dropped = drop_queued(client, run_id)
    deadline = time.monotonic() + wait_s
    running = running_attempts(board, run_id)
    while running and time.monotonic() < deadline:
        time.sleep(0.25)
        running = running_attempts(board, run_id)
    try_write_manifest(store, board, run_id)
    what = f"run {run_id} cancelled; {dropped} queued task{'s' * (dropped != 1)} dropped"
    if running:  # their machines stopped answering: those attempts end when the machine does
        what += (f"; {len(running)} attempt{'s' * (len(running) != 1)} still marked running "
                 f"({', '.join(a['task'] + ' on ' + a['worker'] for a in running)}): "
                 f"nothing they finish is used")
    return board.describe(run_id), what


def running_attempts(board: RunBoard, run_id: str) -> list[dict[str, Any]]:
    """The run's attempts recorded as running (on a live machine or not)."""
    return [a for a in board.attempts.all(run_id) if a["outcome"] == Outcome.RUNNING]
