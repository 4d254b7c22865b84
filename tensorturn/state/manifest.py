"""A run in the object store: its spec, its manifest (the board's description, saved), and who
serves it.

With these and the outputs a run can be rebuilt without Redis (``tensorturn resume``).
``tensorturn serve`` needs only the store, so the store is where a server says that it serves a
run (:func:`serving`): ``tensorturn runs rm`` refuses to delete it meanwhile.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from tensorturn import layout, trust
from tensorturn.config import mask_text
from tensorturn.errors import NotFound, StoreError
from tensorturn.spec import FINISHED, Outcome, RunSpec, RunState
from tensorturn.state.clock import broker_now
from tensorturn.store.objects import ObjectMissing, Store

if TYPE_CHECKING:  # a type only: `serve` marks a run as served without loading Redis's client (0.2 s)
    from tensorturn.state.board import RunBoard

log = logging.getLogger(__name__)


def load_spec(store: Store, run_id: str) -> RunSpec:
    """The run's spec, refused (UntrustedError) unless it is signed by this pool's key: a spec
    names the recipe every agent imports."""
    doc = trust.pool_key().check_doc("spec", store.get_json(layout.key("spec", run_id)),
                                     f"the spec of run {run_id}")
    if doc.get("run_id") != run_id:  # another run's signed spec, copied here
        raise trust.UntrustedError(f"the spec stored for run {run_id} is run {doc.get('run_id')!r}'s; refused")
    return RunSpec.from_json(doc)


def save_spec(store: Store, spec: RunSpec) -> None:
    store.put_json(layout.key("spec", spec.run_id), trust.pool_key().sign_doc("spec", spec.to_json()))


def read_manifest(store: Store, run_id: str, verify: bool = False) -> dict[str, Any]:
    """The run's manifest, without its signature; ``verify``: refused unless signed by this
    pool's key (what a server trusts). ObjectMissing when there is none."""
    doc = store.get_json(layout.key("manifest", run_id))
    if verify:
        checked = trust.pool_key().check_doc("manifest", doc, f"the manifest of run {run_id}")
        if checked.get("run_id") != run_id:  # another run's signed manifest, copied here
            raise trust.UntrustedError(f"the manifest stored for run {run_id} is run "
                                       f"{checked.get('run_id')!r}'s; refused")
        return checked
    return {k: v for k, v in doc.items() if k != trust.SIGNATURE} if isinstance(doc, dict) else doc


def write_manifest(store: Store, board: RunBoard, run_id: str) -> dict[str, Any]:
    """Save the run's description beside its weights (rebuildable without Redis), signed. Once
    it holds the run's final state, the run's keys on the broker expire (:meth:`RunBoard.expire`:
    the store has its record). NotFound when the broker has no whole record of the run."""
    doc = board.describe(run_id)
    store.put_json(layout.key("manifest", run_id), trust.pool_key().sign_doc("manifest", doc))
    if doc["state"] in FINISHED:
        board.expire(run_id)
    return doc


def try_write_manifest(store: Store | None, board: RunBoard, run_id: str) -> None:
    """Write the manifest if the store answers; a store that is down (the reason a run may be
    failing) must not hide the failure, which the board already holds — and keeps, without
    expiry. A record the broker lost leaves the store's last manifest as it is."""
    if store is None:
        return
    try:
        write_manifest(store, board, run_id)
    except StoreError as exc:
        log.warning("run %s: manifest not saved (%s); the broker keeps the run's state", run_id, exc)
        board.runs.keep(run_id)
    except NotFound as exc:
        log.warning("run %s: manifest not saved: %s", run_id, exc)


def ahead_of(manifest: dict[str, Any], attempts: list[dict[str, Any]]) -> bool:
    """Whether a run's ``manifest`` says it finished with an attempt finished that the board's
    ``attempts`` lack or still call running: the board went back in time (Redis restarted from
    an old AOF) or lost part of the record. A manifest is saved from the board, whose entries
    only move forward (a resume keeps or restores them), so neither happens otherwise."""
    if manifest.get("state") not in FINISHED:
        return False
    board = {(a.get("task"), a.get("attempt")): a.get("outcome") for a in attempts}
    return any(a.get("outcome") != Outcome.RUNNING and board.get((a.get("task"), a.get("attempt")))
               in (None, Outcome.RUNNING) for a in manifest.get("attempts") or [])


def settle_from_store(store: Store, board: RunBoard, run_id: str, unit: str | None = None) -> bool:
    """When the store's signed manifest says the run finished and the board is behind it
    (:func:`ahead_of`), drop the board's record: the manifest is the run's record from then on,
    as once a finished run's keys expire — ``status``, ``runs``, ``report`` read it, and a task
    of the run writes nothing. Whether it was dropped; a store that does not answer, or holds
    no signed manifest, leaves the board as it is.

    With ``unit`` (one whose output is stored), the store is read only when the board has no
    attempt of it succeeded: a late or backup copy of a unit the board saw done costs nothing."""
    if unit is not None and board.attempts.has_succeeded(run_id, unit):
        return False
    try:
        manifest = read_manifest(store, run_id, verify=True)
    except (ObjectMissing, StoreError, trust.UntrustedError, ValueError, TypeError):
        return False
    if not ahead_of(manifest, board.attempts.all(run_id)):
        return False
    log.warning("run %s: the broker's record is behind its manifest, which says %s (Redis went back "
                "in time?); the store's record stands", run_id, manifest.get("state"))
    board.runs.forget(run_id)
    return True


def end_run(store: Store | None, board: RunBoard, run_id: str, state: str, **fields: Any) -> bool:
    """Finish the run (``board.finish``'s arguments), its manifest first: the manifest holding
    the final state is saved, then the board's state moves — so whoever sees the run finished
    on the broker (``run`` and ``status`` print it, the next stage of a launch starts) finds the
    store saying so too (``serve``, ``export``, a distillation read the store). A run that
    finished meanwhile (a cancel, a duplicate task) keeps its first end, and its manifest is
    saved again as the board holds it. A store that does not answer does not keep the run from
    ending: the board holds its only record, kept (:func:`try_write_manifest`). Whether this
    call finished the run."""
    if board.runs.is_finished(run_id):  # a duplicate task's end, or a cancel after the end
        return False
    if store is not None and settle_from_store(store, board, run_id):  # it ended before, and Redis forgot
        return False
    fields.setdefault("finished_at", broker_now(board.r))
    saved = store is None
    if store is not None:
        try:
            doc = board.describe_finished(run_id, state, **fields)
            store.put_json(layout.key("manifest", run_id), trust.pool_key().sign_doc("manifest", doc))
            saved = True
        except StoreError as exc:
            log.warning("run %s: manifest not saved (%s); the broker keeps the run's state", run_id, exc)
        except NotFound:  # no whole record: the board's finish below changes nothing either
            pass
    finished = board.finish(run_id, state, **fields)
    if not finished:
        try_write_manifest(store, board, run_id)
    elif not saved:
        board.runs.keep(run_id)
    return finished


def fail_run(store: Store | None, board: RunBoard, run_id: str, error: str) -> bool:
    """Fail the run with ``error`` (masked), its manifest first (:func:`end_run`)."""
    return end_run(store, board, run_id, RunState.FAILED, error=mask_text(error))


def finished_ensemble(store: Store, run_id: str, merge: str) -> dict[str, Any]:
    """The signed manifest of ensemble ``run_id``, refused in one line unless it is a finished
    ensemble (what ``merge`` — distill, soup — turns into one model)."""
    from tensorturn.errors import SpecError
    from tensorturn.store.objects import ObjectMissing

    try:
        manifest = read_manifest(store, run_id, verify=True)
    except ObjectMissing:
        raise NotFound(f"no run {run_id!r} in the store (see `tensorturn runs`)") from None
    if manifest.get("mode") != "ensemble":
        raise SpecError(f"run {run_id} is a {manifest.get('mode')} run, not an ensemble: it is one "
                        f"model already ({merge} turns an ensemble into one model)")
    if manifest.get("state") != RunState.SUCCEEDED or not manifest.get("model_uri"):
        raise SpecError(f"run {run_id} is {manifest.get('state')}, not a finished ensemble: {merge} "
                        f"it once it has succeeded (`tensorturn status {run_id}`)")
    return manifest


SERVING_EVERY_S = 30.0    # how often a server refreshes its mark
SERVING_STALE_S = 300.0   # an older mark is a server that stopped without removing it (SIGKILL);
                          # reckoned on the store's clock (servers), generous for a read-only store


@contextmanager
def serving(store: Store, run_id: str, where: str) -> Iterator[None]:
    """Mark ``run_id`` as served (at ``where``, host:port) by this process while the block runs:
    a mark in the store, refreshed every SERVING_EVERY_S, removed at the end — a SIGTERM's too
    (it is an exception meanwhile: uvicorn raises it again, once it has shut down, to the
    handler it found; the default one would end the process before the mark is removed)."""
    key = layout.key("serving", run_id, f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}")

    def mark() -> None:
        store.put_json(key, {"where": where, "host": socket.gethostname(), "pid": os.getpid(),
                             "at": time.time()})

    try:
        mark()
    except StoreError as exc:  # a server with read-only store keys serves all the same
        log.warning("run %s: served without a mark in the store (%s): `runs rm` cannot see that "
                    "it is served", run_id, exc)
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(SERVING_EVERY_S):
            try:
                mark()
            except StoreError as exc:  # the next refresh may get through; the mark is old meanwhile
                log.warning("run %s: the mark that it is served was not refreshed (%s)", run_id, exc)

    thread = threading.Thread(target=refresh, name="tt-serving-mark", daemon=True)
    thread.start()
    main = threading.current_thread() is threading.main_thread()  # where signals can be handled
    previous = signal.signal(signal.SIGTERM, _terminated) if main else None
    try:
        yield
    finally:
        if main:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        stop.set()
        thread.join(timeout=10)
        try:
            store.delete(key)
        except StoreError as exc:  # it goes stale: `runs rm` ignores it after SERVING_STALE_S
            log.warning("run %s: the mark that it is served was not removed (%s)", run_id, exc)


def _terminated(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def servers(store: Store, run_id: str) -> list[dict[str, Any]]:
    """The servers that marked ``run_id`` as served within SERVING_STALE_S (with ``age_s``).
    A mark's age is reckoned on the store's clock — when the store wrote it, against an object
    written now (:meth:`Store.now`) — as a server may be another machine, whose clock is its own
    (a store this command cannot write to: this machine's clock, and the tolerance above)."""
    written = store.modified(layout.prefix("serving", run_id))
    if not written:
        return []
    try:
        now = store.now()
    except StoreError:
        now = time.time()
    out = []
    for key, at in written.items():
        try:
            mark = store.get_json(key)
        except (ObjectMissing, ValueError, TypeError):  # gone meanwhile, or not a mark
            continue
        age = now - at
        if age < SERVING_STALE_S:
            out.append({**mark, "age_s": round(max(age, 0.0), 1)})
    return out
