"""The one attempt protocol every task of every mode goes through.

A task names one *unit* of a run's work — a shard of a round, an outer step, a member's segment,
the vote — and :func:`execute` runs it in this order:

0. **Signed?** A message whose signature (:func:`signed`, an HMAC of the run and unit under the
   pool key) does not verify is refused before anything is read: someone with access to the
   broker but not the key queued it. The agent's own store is used, never one named in a message.
1. **Finished run?** A task of a succeeded or failed run returns at once. A message that names
   a *slot* (a fused round's) is then bound to its unit, once (:meth:`tensorturn.state.claims.Claims.claim_shard`).
2. **Already done?** A unit whose output is stored (a duplicate or late delivery, a retry of work
   another attempt finished) writes *no* state: it only makes sure its follow-up is queued
   (:meth:`Unit.then`, guarded by one-time claims), and records a ``duplicate_ignored`` incident.
3. **Attempt record**, capped at the spec's ``max_attempts`` (a task that keeps killing its worker
   is redelivered without end; the cap ends that). A copy of a message whose attempt runs under a
   live lease (a replay) begins none: ``duplicate_ignored``, acknowledged.
4. **Work** (:meth:`Unit.run`); output stored at a key fixed by the unit, never overwritten.
5. **Failure**, anywhere — the spec unreadable, the store down, the recipe raising in any hook —
   is recorded on the attempt, then retried with backoff; past the cap the unit gives up
   (:meth:`Unit.give_up`): the run fails with the error in one line, or an ensemble member drops.

Steps 2–5 are one function (:func:`_attempt`) for both ways a unit is delivered: a message taken
from a queue (:func:`execute`), and a unit run in place in the task of another whose work made it
ready (:func:`run_here`: no lease of its own, no duplicate incident; retries, quarantine and the
cap's failure are left to the unit's own message, which its caller queues when needed). What each
delivery does about the attempt's end is the :class:`~tensorturn.tasks.ending.Ending`'s to say.

So every failure ends in a recorded state; none is left only in an agent's log. An agent whose
store calls keep failing while other machines' succeed (wrong credentials, say) is taken out of
rotation (:func:`~tensorturn.tasks.quarantine.quarantine`) with an incident, so it cannot burn the run's attempts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from celery import Task
from celery.exceptions import Retry

from tensorturn import config, tracebacks, trust
from tensorturn.config import mask_text, mask_url
from tensorturn.errors import RecipeError, RecipeFault, StoreError, TensorTurnError
from tensorturn.layout import Label
from tensorturn.pool.owner import HandedBack
from tensorturn.spec import FINISHED, Outcome, RunSpec, RunState
from tensorturn.state.attempts import Figures, Held
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import redis_client
from tensorturn.state.clock import broker_now
from tensorturn.state.manifest import end_run, fail_run, load_spec, settle_from_store, try_write_manifest
from tensorturn.state.refusals import refuse
from tensorturn.store.objects import ObjectMissing, Store, open_store
from tensorturn.tasks.ending import Delivery, End, Ending, InPlace, Queued
from tensorturn.tasks.quarantine import machine_fault, worker_store_failed, worker_succeeded
from tensorturn.tasks.unit import (
    CANCEL_LOOK_S,
    CANCELLED,
    LATE,
    SUCCEEDED,
    Attempt,
    NotYet,
    RunCancelled,
    Tally,
    Unit,
    watch_cancelled,
)

log = logging.getLogger(__name__)

# the protocol as the modes' units and tasks import it (the unit's side lives in .unit)
__all__ = ["CANCEL_LOOK_S", "CANCELLED", "LATE", "SUCCEEDED", "Attempt", "NotYet", "RunCancelled", "Tally", "Unit",
           "watch_cancelled", "agent_store", "authentic", "board_for", "broker_time", "execute", "refuse",
           "run_here", "signed", "store_for"]

DEFAULT_MAX_ATTEMPTS = 3      # when the spec itself cannot be read


@lru_cache(maxsize=8)
def store_for(url: str) -> Store:
    return open_store(url)


def agent_store() -> Store:
    """This machine's own store (its --store, join file or TENSORTURN_STORE_URL)."""
    return store_for(config.current().resolved_store_url())


def signed(run_id: str, what: str) -> dict[str, str]:
    """The keyword arguments that prove a task message about ``what`` of ``run_id`` was queued
    by a holder of the pool key."""
    return {"sig": trust.pool_key().sign("task", {"run_id": run_id, "task": what})}


def authentic(task: Task, run_id: Any, what: str, sig: Any) -> bool:
    """Whether a message's signature verifies; a refusal is logged and kept on the broker
    (``tt:refused``), and nothing else is read or written."""
    key = trust.find_key()
    if key is not None and isinstance(run_id, str) and key.verify(
            "task", {"run_id": run_id, "task": what}, sig):
        return True
    worker = task.request.hostname or "?"
    reason = ("this agent has no pool key" if key is None else
              "missing or bad signature: queued by someone without the pool key")
    log.warning("refused %s of run %r on %s: %s", task.name, run_id, worker, reason)
    refuse(board_for(task.app.conf.broker_url).r, worker, task.name, run_id, reason)
    return False


@lru_cache(maxsize=1)
def board_for(broker_url: str) -> RunBoard:
    return RunBoard(redis_client(broker_url))


def broker_time() -> float:
    """Now on the broker's clock, as this process's tasks reckon it: what a record that other
    machines' records are compared with says (:mod:`tensorturn.state.clock`)."""
    from tensorturn.pool.celery_app import app

    return broker_now(board_for(app.conf.broker_url).r)


def describe_failure(exc: BaseException, worker: str | None) -> str:
    """One line for a failure: the user's own words for TensorTurn errors, else type and text."""
    if isinstance(exc, (RecipeError, trust.UntrustedError)):
        return f"{exc} (on worker {worker})"
    if isinstance(exc, TensorTurnError):
        return str(exc)
    text = " ".join(str(exc).split())  # one line, whatever the exception's message holds
    return mask_text(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


def _tail(exc: BaseException) -> str | None:
    """The failure's last frames for its attempt record (``status --debug`` shows them)."""
    try:
        return tracebacks.tail(exc)
    except Exception as err:  # noqa: BLE001 - a traceback that cannot be formatted loses only itself
        log.debug("traceback not recorded: %s", err)
        return None


def _spec_here(store: Store, run_id: str) -> RunSpec:
    """The run's spec from this agent's store. None there means this machine's store is not the
    pool's (a wrong --store): a fault of the machine, not of the task, so it is a store failure
    (the machine is quarantined when others succeed) rather than a missing object."""
    try:
        return load_spec(store, run_id)
    except ObjectMissing:
        raise StoreError(f"store {mask_url(store.url)}: no run {run_id} here (no spec); is this "
                         f"agent's --store the pool's?") from None


def execute(task: Task, run_id: str, label: Label, unit_class: Callable[[Attempt], Unit], sig: str | None,
            resolve: Callable[[RunBoard, RunSpec, str], Label] | None = None) -> dict[str, Any]:
    """Run ``label``'s unit through the protocol; returns a small deterministic receipt (a
    duplicate returns exactly what the first attempt returned; Celery stores no result).

    ``resolve`` (board, spec, worker) → the label of the unit a message for ``label`` works on,
    when the message names a slot bound to a unit on first delivery (a fused round's shards)."""
    receipt = {"run_id": run_id, "task": str(label)}
    if not authentic(task, run_id, str(label), sig):
        return receipt
    board = board_for(task.app.conf.broker_url)
    try:
        state, quarantined, paused = board.state_and_standing(run_id, task.request.hostname or "?")
    except Exception as exc:  # noqa: BLE001 - the broker did not answer: nothing began; no round may lose this task
        log.warning("run %s %s: the broker did not answer (%s); retrying", run_id, label, exc)
        raise task.retry(countdown=2, max_retries=None) from None
    if state in FINISHED:
        return receipt
    if state is None:  # no whole record (Redis lost it, or its keys were deleted): write nothing
        log.warning("run %s: %s ignored: the broker has no record of the run; `tensorturn "
                    "resume %s` rebuilds it from the store", run_id, label, run_id)
        return receipt
    if quarantined or paused:  # a task it held when taken out of rotation, or when its owner came
        raise task.retry(countdown=1, max_retries=None)   # back to the queue, for another machine
    tally = Tally()
    try:
        return _queued(task, board, run_id, label, unit_class, resolve, receipt, tally)
    finally:  # every byte the attempt moved through the store, whatever became of it
        try:
            board.traffic.add_store_bytes(run_id, *tally.take(), task.request.hostname or "?")
        except Exception as exc:  # noqa: BLE001 - a figure; the broker may be down
            log.debug("store bytes not recorded: %s", exc)


def _queued(task: Task, board: RunBoard, run_id: str, label: Label, unit_class: Callable[[Attempt], Unit],
            resolve: Callable[[RunBoard, RunSpec, str], Label] | None,
            receipt: dict[str, Any], tally: Tally) -> dict[str, Any]:
    """A queued message's attempt: its unit built from this agent's store (a failure there is
    recorded as the attempt's), run by :func:`_attempt`, and its ending answered the queue's
    way — retried with backoff, handed to another machine, given up past the cap."""
    worker, delivery = task.request.hostname or "?", Queued(task)
    store: Store | None = None
    unit: Unit | None = None
    max_attempts: int | None = None  # the spec's, once read
    try:
        store = agent_store()
        spec = _spec_here(store, run_id)
        max_attempts = spec.max_attempts
        if resolve is not None:
            label = resolve(board, spec, worker)
        unit = unit_class(Attempt(task, board, store, spec, label, worker, tally=tally))
    except Exception as exc:  # noqa: BLE001 - the spec or store unreadable: recorded as an attempt's failure
        max_attempts = max_attempts or _cap_on_the_broker(board, run_id)
        ending = _failed(board, store, run_id, label, worker, exc, delivery, max_attempts)
    else:
        ending = _attempt(unit.a, unit, delivery)
    if ending.end == End.FOLLOW_UP_FAILED:  # the unit is done and recorded: a retry queues what follows
        raise task.retry(countdown=2, max_retries=None)
    if ending.end == End.HANDED_BACK:  # another machine takes the task
        raise task.retry(countdown=0, max_retries=None)
    if ending.end == End.MACHINE_FAULT:  # not the task's fault: its failed attempts were given back
        raise task.retry(countdown=1, max_retries=None)
    if ending.end == End.FAILED and ending.number < max_attempts:
        raise task.retry(countdown=min(2 ** (ending.number - 1), 8), max_retries=None)
    if ending.end == End.FAILED:
        final = (f"{label} failed {ending.number} attempts; last: {ending.message}"
                 if ending.number <= max_attempts else f"{label} failed {max_attempts} attempts")
        unit.give_up(final) if unit is not None else fail_run(store, board, run_id, final)
    if ending.end in (End.FAILED, End.RUN_FAILED):
        try_write_manifest(store, board, run_id)
    return receipt


def _cap_on_the_broker(board: RunBoard, run_id: str) -> int:
    """The run's attempt cap where this machine could not read its spec (a wrong --store, its
    store unreachable): the broker's copy, so that a machine failing on its own store spends no
    more of a task's attempts than the run allows, until quarantine takes it out of rotation."""
    try:
        return board.runs.max_attempts(run_id) or DEFAULT_MAX_ATTEMPTS
    except Exception as exc:  # noqa: BLE001 - the broker stumbled too: the default cap
        log.debug("the run's attempt cap not read from the broker: %s", exc)
        return DEFAULT_MAX_ATTEMPTS


def _attempt(attempt: Attempt, unit: Unit, delivery: Delivery) -> Ending:
    """Steps 2–5 of the protocol for ``unit``, however it was delivered: done already, or an
    attempt begun under the cap, run, recorded and followed; every way it can end is recorded
    here, and what the delivery must still do is the :class:`Ending`'s to say."""
    board, run_id, label, worker = attempt.board, attempt.run_id, attempt.label, attempt.worker
    try:
        if unit.done():
            if isinstance(delivery, Queued):
                if settle_from_store(attempt.store, board, run_id, str(label)):  # it ended; the broker went back
                    return Ending(End.SKIPPED)
                board.incidents.add(run_id, "duplicate_ignored", str(label), worker,
                                    "the unit's output was already stored; nothing was redone or counted")
        else:
            cap, lease = attempt.spec.max_attempts, lease_of(delivery.task) if isinstance(delivery, Queued) else ()
            try:
                begun = board.attempts.begin(run_id, str(label), worker, cap, *lease)
            except Held as held:  # a replayed copy: the attempt running it goes on, uncounted here
                board.incidents.add(run_id, "duplicate_ignored", str(label), worker, str(held))
                return Ending(End.SKIPPED)
            if begun is None:  # past the cap: given up, once
                unit.give_up(f"{label} failed {cap} attempts")
                try_write_manifest(attempt.store, board, run_id)
                return Ending(End.GAVE_UP)
            attempt.key, attempt.number, state = begun
            attempt.looked_at = time.monotonic()  # the begin read the run's state
            if state == RunState.CANCELLED:  # cancelled since the last look: stop before any download
                raise RunCancelled(f"run {run_id} was cancelled")
            record_outcome(unit, unit.run(), attempt.tally or Tally())
    except Retry:
        raise
    except NotYet as exc:  # queued again already: given back, not retried here
        if attempt.key:
            end_given_back(board, run_id, attempt.key, Outcome.REFUSED.says(str(exc)), worker)
        return Ending(End.NOT_YET)
    except HandedBack as exc:  # the machine's owner needs it: another machine takes the unit
        end_handed_back(board, run_id, label, attempt.key, str(exc), worker)
        return Ending(End.HANDED_BACK)
    except RunCancelled:  # not a failure: recorded, never retried; the run is finished
        if attempt.key:
            board.attempts.finish(run_id, attempt.key, CANCELLED, figures=Figures(worker))
        try_write_manifest(attempt.store, board, run_id)
        return Ending(End.CANCELLED)
    except Exception as exc:  # noqa: BLE001 - every failure is recorded; the delivery retries it or gives up
        return _failed(board, attempt.store, run_id, label, worker, exc, delivery, attempt.spec.max_attempts,
                       attempt.key, attempt.number, attempt.ended)
    try:
        unit.then()
    except Exception as exc:  # noqa: BLE001 - the unit is done and recorded: what follows is queued again
        log.warning("run %s %s: queuing what follows failed (%s); %s", run_id, label, exc, delivery.fallback)
        return Ending(End.FOLLOW_UP_FAILED)
    return Ending(End.DONE)


def _failed(board: RunBoard, store: Store | None, run_id: str, label: Label, worker: str, exc: Exception,
            delivery: Delivery, max_attempts: int, key: str = "", number: int = 0, ended: bool = False) -> Ending:
    """Record a failure on its attempt (a queued one that failed before its attempt began gets
    one: the spec or store was unreadable); a store failing only on this machine quarantines it
    (queued); the recipe's own fault fails the run at once, since every attempt would fail alike."""
    message = describe_failure(exc, worker)
    queued = isinstance(delivery, Queued)
    log.warning("run %s %s failed on %s: %s%s", run_id, label, worker, message,
                "" if queued else "; queued for a retry")
    if queued and not key:
        begun = board.attempts.begin(run_id, str(label), worker, max_attempts)
        key, number = begun[:2] if begun else (f"{label}#refused", max_attempts + 1)
    if key and not ended:  # (a run's end that failed is retried, its attempt kept)
        end_failed(board, run_id, key, message, exc, worker)
    if isinstance(delivery, Queued):  # (in place, the unit's message is queued: its delivery sees to it)
        cause = machine_fault(exc)
        if not cause:
            worker_succeeded(board, worker)  # the store answered: this is not the machine's fault
        elif worker_store_failed(delivery.task, board, run_id, str(label), worker, key, message, cause):
            return Ending(End.MACHINE_FAULT, message, number)
    if isinstance(exc, RecipeFault):  # the recipe's code: every attempt would fail the same way
        fail_run(store, board, run_id, f"{label} failed: {message}")
        return Ending(End.RUN_FAILED, message, number)
    return Ending(End.FAILED, message, number)


def lease_of(task: Task) -> tuple[str | None, float]:
    """The delivery tag of the message ``task`` runs under (None run in-process) and how long
    its lease lives unrefreshed."""
    tag = (getattr(task.request, "properties", None) or {}).get("delivery_tag")
    return (tag if isinstance(tag, str) else None), config.current().visibility_timeout_s


def end_given_back(board: RunBoard, run_id: str, key: str, outcome: str, worker: str) -> None:
    """End attempt ``key`` with ``outcome`` at no cost to its task's attempts: refused or handed
    back, the task is taken again (its message queued again)."""
    board.attempts.give_back(run_id, key.rpartition("#")[0])
    board.attempts.finish(run_id, key, outcome, figures=Figures(worker))


def end_handed_back(board: RunBoard, run_id: str, label: Label, key: str, why: str, worker: str) -> None:
    """End attempt ``key`` (if it began) handed back, at no cost; a broker that stumbles leaves
    it unrecorded: the task goes to another machine all the same."""
    log.warning("run %s %s: handed back (%s)", run_id, label, why)
    try:
        if key:
            end_given_back(board, run_id, key, Outcome.HANDED_BACK.says(why), worker)
    except Exception as exc:  # noqa: BLE001 - the broker stumbled: the task goes back all the same
        log.warning("run %s %s: the hand-back was not recorded (%s)", run_id, label, exc)


def end_failed(board: RunBoard, run_id: str, key: str, message: str, exc: BaseException, worker: str) -> None:
    """End attempt ``key`` failed with ``message`` and ``exc``'s traceback."""
    board.attempts.finish(run_id, key, Outcome.FAILED.says(message), traceback=_tail(exc),
                          figures=Figures(worker, store_ok=False))


def record_outcome(unit: Unit, outcome: str, tally: Tally) -> None:
    """Record the end of ``unit``'s attempt with ``outcome`` and its figures (the store bytes
    ``tally`` has not recorded yet among them); the run's end with it when the attempt finishes
    the run (:meth:`Unit.finish_run`), then the manifest, then the run's state."""
    a, board, run_id = unit.a, unit.board, unit.spec.run_id
    if outcome == LATE:
        board.incidents.add(run_id, "late_ignored", str(a.label), a.worker,
                            "a late attempt finished after another stored the output; discarded")
    ending = unit.final
    store_up, store_down = tally.pending()
    figures = Figures(a.worker, a.bytes_up, a.bytes_down, store_up, store_down, store_ok=True, rate=a.rate,
                      trained_from=a.trained_from, trained_s=a.trained_s, step=a.step)

    board.attempts.finish(run_id, a.key, outcome, figures=figures)
    a.ended = True
    tally.settle()  # recorded with the outcome (were it not, the end of execute() adds them)
    if ending is not None:  # the run's records complete, then its manifest, then its state
        end_run(unit.store, board, run_id, **ending)
        tally.take()  # the manifest holds the run's figures, complete; its own bytes are not among them


def run_here(parent: Attempt, label: Label, unit_class: Callable[[Attempt], Unit]) -> bool:
    """Run ``label``'s unit in the task of ``parent``, whose work made it ready: no queue hop,
    no wait for a machine to take a message. Its attempt is recorded as a queued one's would be.

    True when the unit is done (now or before), or ended in a way that needs nothing more (the
    run cancelled; ``NotYet``: queued again by whoever raised it; past its attempt cap: given
    up, as a queued message would). False when this attempt failed (recorded, with its
    traceback), was handed back (:class:`HandedBack`: no attempt spent), or what follows a unit
    done could not be queued (its record stays): the caller then queues the unit's message,
    whose retries, cap and failure handling take over (a delivery that finds the unit done
    queues what follows). The parent's message is acknowledged only when its task ends, so a
    machine lost meanwhile has the parent delivered again, which runs the unit again (its
    unfinished attempt recorded lost). The same protocol as :func:`execute` (:func:`_attempt`),
    with no lease of its own and no duplicate incident."""
    unit = unit_class(Attempt(parent.task, parent.board, parent.store, parent.spec, label, parent.worker,
                              tally=parent.tally or Tally()))
    return _attempt(unit.a, unit, InPlace()).well
