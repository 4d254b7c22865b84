"""``--sync async``'s updates: their Celery tasks, the unit that trains, stores and waits for
one (:class:`UpdateUnit`), and the queuing of what the policy (:mod:`.sync.asynchronous`) asks
for (:class:`~.plans.QueueUpdates`, which the driver hands to :func:`queue_updates`). Celery
includes this module through the driver (:mod:`.driver`, which :mod:`.tasks` imports); the task
names are what queued messages carry, and never change.

Each worker trains its update from the **latest** weights it can get, stores the
pseudo-gradient, and queues it to be applied (:class:`~tensorturn.state.ledger.AsyncLedger`).
Whoever holds the apply lock applies the stored updates one at a time, in arrival order
(:mod:`.async_apply`), so a fast machine never waits for a slow one.

Safety: an update is applied at most once and never lost. Its pseudo-gradient is stored before
it is queued for applying; the applier commits each new version in one Redis script that checks
it still holds the lock, so an applier stopped past its lock's time to live cannot commit (its
objects carry its own token and are never pointed at); and the task that queued an update
returns only once it is applied (the run's last ones: once the run is finished), trying for the
lock meanwhile — so a machine killed while applying leaves tasks waiting that take over when its
lock runs out, and its own task is redelivered.

Where an agent beside the store serves the run's outer queue (``agent --role outer``), it
applies the updates: each stored update also queues a drain there (:func:`async_drain`), and the
trainers waiting for their update leave the applying to it — θ and the outer state then never
cross a trainer's uplink. When that agent stops answering (its advertisement goes stale, about
three heartbeats) or applies nothing for ``BESIDE_PATIENCE_S``, the waiting trainers apply
again themselves, as above.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from tensorturn import layout
from tensorturn.config import mask_text
from tensorturn.modes.fused import backups
from tensorturn.modes.fused.async_apply import drain
from tensorturn.modes.fused.async_versions import fetch_version, ledger, total_updates, trusted_latest
from tensorturn.modes.fused.options import options
from tensorturn.modes.fused.shard import train_and_store
from tensorturn.pool import routing
from tensorturn.pool.capacity import queue_for
from tensorturn.pool.celery_app import app
from tensorturn.recipes import Recipe
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.clock import broker_now
from tensorturn.state.ledger import AsyncLedger
from tensorturn.state.manifest import load_spec
from tensorturn.store.tensors import StateDict
from tensorturn.tasks.attempt import SUCCEEDED, agent_store, authentic, board_for, execute, signed

log = logging.getLogger(__name__)

APPLY_WAIT_S = 0.1  # the longest pause of a task whose update waits to be applied
BESIDE_LOOK_S = 1.0  # how often it looks whether an agent beside the store applies instead
BESIDE_PATIENCE_S = 30.0  # no new version for this long while one applies: apply here too
DRAIN = "drain"      # what an async_drain message's signature names
WARM_UP_ROUNDS = 1   # versions < this × S: an update one version behind is copied already (§12c: 1 round
                     # of copies, 0.68× rounds' wall; 2, 0.71×; the same test loss on average)


def queue_updates(spec: RunSpec, updates: Iterable[int]) -> None:
    """Queue updates ``updates`` (what :class:`~.plans.QueueUpdates` asks the driver for)."""
    queue = queue_for(spec.memory_needed_bytes)
    run_id = spec.run_id
    for j in updates:
        async_step.s(run_id, j, **signed(run_id, str(layout.update_label(j)))).apply_async(queue=queue)


@app.task(bind=True, name="tensorturn.fused.async_update", max_retries=None)
def async_step(self: Any, run_id: str, j: int, sig: str | None = None) -> dict[str, Any]:
    """Train update j from the latest weights, store it, and apply what is stored."""
    return execute(self, run_id, layout.update_label(j), UpdateUnit, sig)


@app.task(bind=True, name="tensorturn.fused.async_backup", max_retries=None)
def async_backup(self: Any, run_id: str, j: int, sig: str | None = None) -> dict[str, Any]:
    """A backup copy of update j, queued when j straggles (still training once every update is
    handed out, or a round behind the latest weights before that): the first copy stored is
    applied, the other stops at its next look."""
    return execute(self, run_id, layout.update_backup_label(j), UpdateUnit, sig)


class UpdateUnit(backups.CopyAwareUnit):
    """Update j (or a copy of it): trained and stored once, then applied by whoever holds the
    apply lock — this task waits until it is."""

    def done(self) -> bool:
        book = ledger(self.board, self.spec.run_id)
        return (book.is_applied(self.j) and not book.pending()
                and book.latest()["version"] < total_updates(self.spec))

    @property
    def j(self) -> int:
        return self.a.label.numbers[0]

    def run(self) -> str:
        spec, book = self.spec, ledger(self.board, self.spec.run_id)
        out_key = layout.key("update", spec.run_id, self.j)
        outcome = SUCCEEDED
        if not book.is_applied(self.j) and not book.stored(self.j):
            if not self.store.exists(out_key):
                r, k = divmod(self.j, options(spec).shards)

                def theta_of(recipe: Recipe) -> tuple[StateDict, int, dict[str, str]]:
                    latest = trusted_latest(spec, self.store, self.board, book, self.a.worker)
                    book.start(self.j, latest["version"])
                    theta, moved = fetch_version(spec, recipe, self.store, latest)
                    return theta, moved, {"base_version": f"{latest['version']:010d}"}

                outcome = train_and_store(self, r, k, theta_of, out_key, lambda: book.stored(self.j))
            if self.store.exists(out_key):  # this copy's, or another's: queued to be applied once
                book.push(self.j, self.a.worker, broker_now(self.board.r))
        if not book.is_applied(self.j):  # (a copy that found it stored too: its first may have died)
            queue_drain_beside_store(spec, self.board)
        # Returns only once its update is applied (and, for the run's last, the run finished):
        # if the machine applying dies, its lock runs out and a waiting task takes over — with
        # no task left waiting, stored updates could stay unapplied and the run would hang.
        total = total_updates(spec)
        beside, looked = False, 0.0
        version, moved = -1, time.monotonic()
        # the attempt's pacing (pauses doubling to APPLY_WAIT_S), with its look between them
        for _ in self.a.waits(cap=APPLY_WAIT_S):
            now = time.monotonic()
            if now - looked >= BESIDE_LOOK_S:
                beside, looked = applier_beside_store(spec, self.board) is not None, now
            # no agent beside the store, or one that has applied nothing for a while (failing,
            # say): apply here — under the apply lock, so never beside another applier
            if not beside or now - moved > BESIDE_PATIENCE_S:
                drain(spec, self.store, self.board, self.a.worker)
            applied = book.is_applied(self.j)
            latest = book.latest()["version"]  # read after: the last update waits for the finish
            if latest != version:
                version, moved = latest, time.monotonic()
            if self.board.runs.is_finished(spec.run_id) or (applied and latest < total):
                break
        try:  # only an optimisation: a failure here must not fail an update that is applied
            queue_update_backup(spec, self.board, book, self.a.worker)
        except Exception as exc:  # noqa: BLE001
            log.warning("run %s: no backup copy queued (%s)", spec.run_id, exc)
        return outcome


def applier_beside_store(spec: RunSpec, board: RunBoard) -> str | None:
    """The outer queue of an agent beside the store that serves this run's capacity queue (it
    applies the updates), or None."""
    queue = queue_for(spec.memory_needed_bytes)
    outer = routing.queue_for_outer(board.r, queue)
    return outer if outer != queue else None


def queue_drain_beside_store(spec: RunSpec, board: RunBoard) -> None:
    """A stored update: have the agent beside the store apply what is stored, if one serves."""
    queue = applier_beside_store(spec, board)
    if queue is not None:
        async_drain.s(spec.run_id, **signed(spec.run_id, DRAIN)).apply_async(queue=queue)


@app.task(bind=True, name="tensorturn.fused.async_drain", max_retries=5)
def async_drain(self: Any, run_id: str, sig: str | None = None) -> None:
    """On the agent beside the store: apply every stored update of run ``run_id`` (and evaluate
    the rounds due). Whoever holds the apply lock applies what is stored meanwhile, so a drain
    finding it held ends; a failure is retried (the trainers waiting apply themselves once this
    agent stops answering, or it applies nothing for BESIDE_PATIENCE_S)."""
    if not authentic(self, run_id, DRAIN, sig):
        return
    board = board_for(self.app.conf.broker_url)
    if board.runs.is_finished(run_id) or board.runs.state(run_id) is None:
        return
    try:
        store = agent_store()
        spec = load_spec(store, run_id)
        drain(spec, store, board, self.request.hostname or "?")
    except Exception as exc:  # noqa: BLE001 - the update stays pending: another drain applies it
        worker = self.request.hostname or "?"
        log.warning("run %s: applying stored updates beside the store failed: %s", run_id, exc)
        if self.request.retries >= (self.max_retries or 0):  # the trainers apply, after their patience
            board.incidents.add(run_id, "apply_failed", DRAIN, worker,
                                f"applying updates beside the store failed {self.request.retries + 1} times; "
                                f"the trainers apply them: {mask_text(str(exc))}")
            return
        raise self.retry(countdown=2) from None


def queue_update_backup(spec: RunSpec, board: RunBoard, book: AsyncLedger, worker: str) -> None:
    """A backup copy of a straggler (:func:`~..backups.queue_backup`), when this worker would
    train a whole copy before the straggler ends: once every update is handed out, of any
    update still training (this worker would otherwise idle until the run's slowest update is
    in); before that, of one already a round (S versions) behind the latest weights — landing
    later still, it would be weighted down by its staleness (:func:`~tensorturn.train.diloco.staleness_scale`)
    and pull the model back to where it trained. During the first ``WARM_UP_ROUNDS`` rounds'
    versions, of one a single version behind: early updates move the weights most, so a late
    one there costs most — on two machines 4× slower than a third (3 shards, digits) async
    ended +1 to +10 % in test loss against rounds without this, and −4 to +5 % (mean +0.3 %)
    at 0.68× rounds' wall with a round of copies (two rounds: 0.71×, mean 0.0 %;
    docs/benchmarks/mixed-speeds.md §12c). The copy trains from the latest weights (a
    different pseudo-gradient); whichever copy is stored first is applied, the other stops at
    its next look."""
    shards = options(spec).shards
    handed_out = book.begun() >= total_updates(spec)
    latest = book.latest()["version"]
    bases = {} if handed_out else book.bases()
    behind = 1 if latest < WARM_UP_ROUNDS * shards else shards

    def straggler(named: layout.Label) -> int | None:
        if named.kind != "update":
            return None
        j = named.numbers[0]
        if not handed_out and latest - bases.get(j, latest) < behind:
            return None
        return None if book.stored(j) else j

    def why(j: int) -> str:
        if handed_out:
            return (f"every update is handed out and u{j} is still training: {worker} trains a "
                    f"backup copy, by its rate sooner")
        late = latest - bases.get(j, latest)
        return (f"u{j} trains from version {bases.get(j)}, {late} version{'s' * (late != 1)} behind "
                f"the latest: {worker} trains a backup copy from the latest, by its rate sooner")

    backups.queue_backup(
        spec, board, worker, backups.running(board, spec.run_id, straggler),
        claim=layout.update_backup_claim, label=layout.update_backup_label,
        task=async_backup, args=lambda j: (spec.run_id, j), why=why)
