"""The fused rounds' driver: the Celery tasks of a round (a slot, a named shard, a backup copy,
the outer step, the evaluation), and the queuing of what the run's sync policy returns.

Each task builds its unit with the policy's plan and a :class:`Driver` (the unit's
:class:`~.plans.Wires`): a unit does its work and hands the result to the driver
(:meth:`Driver.follow`), which asks the policy what follows (:meth:`~.sync.base.SyncPolicy.on_output`,
:meth:`~.sync.base.SyncPolicy.on_step`) and queues it (:meth:`Driver.queue`). So the policy
decides and the units stay plain: neither looks the other up. Celery includes this module
through :mod:`.tasks`, and with it the asynchronous updates' tasks (:mod:`.update`, whose
:func:`~.update.queue_updates` queues :class:`~.plans.QueueUpdates`); the task names are what
queued messages carry, and never change.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from tensorturn import layout
from tensorturn.modes.fused import backups
from tensorturn.modes.fused.ahead import ReadAhead
from tensorturn.modes.fused.options import evaluated, options
from tensorturn.modes.fused.outer import EvalUnit, OuterUnit
from tensorturn.modes.fused.plans import (
    AnnounceGlobal,
    BackupCopy,
    Context,
    HandOver,
    QueueEval,
    QueueRound,
    QueueShard,
    QueueStep,
    QueueUpdates,
    SendStep,
    ShardDone,
    StepDone,
    Work,
)
from tensorturn.modes.fused.policies import policy
from tensorturn.modes.fused.shard import ShardUnit
from tensorturn.modes.fused.sync.base import SyncPolicy
from tensorturn.modes.fused.update import queue_updates
from tensorturn.pool import routing
from tensorturn.pool.capacity import queue_for
from tensorturn.pool.celery_app import app, publishing
from tensorturn.recipes import recipe_of
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.store.objects import Store
from tensorturn.tasks.attempt import Attempt, Unit, execute, run_here, signed

log = logging.getLogger(__name__)


def start(spec: RunSpec, store: Store, board: RunBoard) -> None:
    """Queue the run's first work, as its policy plans it."""
    driver = Driver.of_run(Context(spec, store, board))
    driver.queue(driver.policy.start(driver.run))


def resume(spec: RunSpec, store: Store, board: RunBoard) -> str:
    """Queue whatever is missing from the store, as the run's policy says; what it resumed."""
    driver = Driver.of_run(Context(spec, store, board))
    works, said = driver.policy.resume(driver.run)
    driver.queue(works)
    return said


class Driver:
    """The run's policy and the queues, for one unit (:class:`~.plans.Wires`): a result goes to
    the policy, and what it returns is queued here."""

    def __init__(self, policy: SyncPolicy, run: Context):
        self.policy, self.run = policy, run

    @classmethod
    def of_run(cls, run: Context) -> Driver:
        """The driver of ``run``, with the policy its ``--sync`` names."""
        return cls(policy(options(run.spec).sync), run)

    def follow(self, done: ShardDone | StepDone) -> None:
        if isinstance(done, ShardDone):
            self.queue(self.policy.on_output(self.run, done))
        else:
            self.queue(self.policy.on_step(self.run, done))

    def outer_unit(self, deferred: list[Callable[[], None]] | None = None,
                   ahead: ReadAhead | None = None) -> Callable[[Attempt], Unit]:
        def build(attempt: Attempt) -> Unit:
            r = attempt.label.numbers[0]
            return OuterUnit(attempt, self.policy.step_plan(r), self, deferred=deferred, ahead=ahead)
        return build

    def queue(self, works: Sequence[Work]) -> None:
        """Queue ``works``, in order (a failure stops there: the task that follows is retried,
        and the one-time claims keep what was queued from being queued twice)."""
        spec, store, board = self.run.spec, self.run.store, self.run.board
        for work in works:
            match work:
                case QueueRound(r, again=True):  # a start or resume: whoever queued it before
                    board.claims.claim(spec.run_id, layout.dispatch_claim(r))
                    dispatch_round(spec, r, board)
                case QueueRound(r):
                    queue_round(spec, board, r)
                case QueueShard(r, k, countdown):
                    queue_shard(spec, r, k, countdown=countdown)
                case QueueStep(r, here):
                    queue_outer(spec, board, r, here, self.outer_unit())
                case SendStep(r):
                    send_outer(spec, board, r)
                case HandOver(r, here):  # queued ahead: else the step here, else wake the slot standing by
                    if not queue_round(spec, board, r + 1) and not queue_outer(spec, board, r, here, self.outer_unit()):
                        board.announcements.announce_complete(spec.run_id, r)
                case QueueEval(r):
                    queue_eval(spec, board, r)
                case AnnounceGlobal(r):
                    board.announcements.announce_global(spec.run_id, r)
                case BackupCopy(r, worker):
                    try:  # only an optimisation: a failure here must not fail a shard that is done
                        queue_shard_backup(spec, store, board, r, worker)
                    except Exception as exc:  # noqa: BLE001
                        log.warning("run %s: no backup copy queued (%s)", spec.run_id, exc)
                case QueueUpdates(updates):
                    queue_updates(spec, updates)
                case _:
                    raise TypeError(f"no such work: {work!r}")


def shard_unit(attempt: Attempt) -> Unit:
    """A round's shard (a slot once bound, a named shard, a backup copy), planned by the run's
    policy."""
    driver = Driver.of_run(Context(attempt.spec, attempt.store, attempt.board))
    return ShardUnit(attempt, driver.policy.shard_plan(*attempt.label.numbers[:2]), driver)


def outer_unit(attempt: Attempt) -> Unit:
    """A round's outer step, planned by the run's policy."""
    return Driver.of_run(Context(attempt.spec, attempt.store, attempt.board)).outer_unit()(attempt)


# ---- what the driver queues ---------------------------------------------------------------------

def dispatch_round(spec: RunSpec, r: int, board: RunBoard) -> None:
    """Queue round r: a slot per shard, on machines that can hold the model. A slot trains the
    shard its first worker claims (:meth:`tensorturn.state.claims.Claims.claim_shard`): one it trained before where it
    can, so its cached chunks are read again rather than downloaded."""
    queue = queue_for(spec.memory_needed_bytes)
    run_id = spec.run_id
    with publishing() as producer:  # one round trip for the round
        for i in range(options(spec).shards):
            train_slot.s(run_id, r, i, **signed(run_id, str(layout.slot_label(r, i)))).apply_async(
                queue=queue, producer=producer)


def queue_round(spec: RunSpec, board: RunBoard, r: int) -> bool:
    """Queue round r once (whoever comes first: the outer step that stores the weights it
    trains from, or round r−1's last or second-to-last shard, ahead); whether this call queued
    it."""
    return board.claims.once(spec.run_id, layout.dispatch_claim(r), lambda: dispatch_round(spec, r, board))


def queue_outer(spec: RunSpec, board: RunBoard, r: int, here: Attempt | None,
                outer: Callable[[Attempt], Unit]) -> bool:
    """Round r's outer step, once: beside the store while an agent there serves it
    (:mod:`tensorturn.pool.routing`), else on machines that can hold the model — and there,
    when the round's last shard task calls (``here``, its attempt), taken by that task itself
    (:func:`~tensorturn.tasks.attempt.run_here`): it holds the model and is free, and no queue
    hop or machine's pick-up stands between the round's last shard and the next round. Its
    message is queued only when that attempt fails, or what follows it could not be queued
    (then retries and the attempt cap work as for any task; past the cap the run fails there,
    as the message would). The claim names the task, so the same task delivered again after its
    machine was lost takes the step again. The last round's outer step finishes the run, and
    is taken here only once every earlier round's evaluation is recorded: else it goes behind
    them in the queue rather than evaluate such a round again itself. (A task applied in a
    caller's process — tests that drive each unit — queues it, as it queues what else follows.)
    ``outer``: the step's unit, as :meth:`Driver.outer_unit` builds it. Whether this call took
    or queued the step: False when another holds its claim (a slot of round r+1 standing by,
    :func:`~tensorturn.modes.fused.standby.take_step`)."""
    run_id = spec.run_id
    anywhere = queue_for(spec.memory_needed_bytes)
    queue = routing.queue_for_outer(board.r, anywhere)

    def send() -> None:
        send_outer(spec, board, r, queue)

    if here is None or here.task.request.is_eager:
        return board.claims.once(run_id, layout.outer_claim(r), send)
    if not board.claims.claim_for(run_id, layout.outer_claim(r), f"task:{here.task.request.id}"):
        return False  # another task has it (this one's earlier delivery would hold it)
    last = r + 1 == options(spec).rounds
    if queue != anywhere or (last and len(board.rounds.all(run_id)) < r):
        try:
            send()
        except BaseException:
            board.claims.release(run_id, layout.outer_claim(r))
            raise
        return True
    if not run_here(here, layout.outer_label(r), outer):
        send()
    return True


def send_outer(spec: RunSpec, board: RunBoard, r: int, queue: str | None = None) -> None:
    """Queue round r's outer step on ``queue`` (by default where outer steps go: beside the store
    while an agent there serves them, :func:`~tensorturn.pool.routing.queue_for_outer`)."""
    run_id = spec.run_id
    if queue is None:
        queue = routing.queue_for_outer(board.r, queue_for(spec.memory_needed_bytes))
    outer_step.s([], run_id, r, **signed(run_id, str(layout.outer_label(r)))).apply_async(queue=queue)


def queue_shard(spec: RunSpec, r: int, k: int, countdown: float = 0) -> None:
    """Queue shard k of round r as a named shard task (in ``countdown`` seconds)."""
    run_id = spec.run_id
    train_shard.s(run_id, r, k, **signed(run_id, str(layout.shard_label(r, k)))).apply_async(
        queue=queue_for(spec.memory_needed_bytes), countdown=countdown)


def queue_eval(spec: RunSpec, board: RunBoard, r: int) -> None:
    """Queue the evaluation of round r's weights, once, where its outer step would go: behind
    the next round's shards, so a machine takes it when its shard is done (a round
    ``--eval-every`` skips has none: its outer step records it)."""
    if not evaluated(spec, r):
        return
    run_id = spec.run_id
    queue = routing.queue_for_outer(board.r, queue_for(spec.memory_needed_bytes))
    board.claims.once(run_id, layout.eval_claim(r), lambda: evaluate.s(
        run_id, r, **signed(run_id, str(layout.eval_label(r)))).apply_async(queue=queue))


def queue_shard_backup(spec: RunSpec, store: Store, board: RunBoard, r: int, worker: str) -> None:
    """When round r has no shard left to hand out but some still training, queue a backup copy
    of a straggler (:func:`~.backups.queue_backup`)."""
    run_id = spec.run_id
    if (board.claims.unclaimed_shards(run_id, r, options(spec).shards)
            or store.exists(layout.key("global", run_id, r + 1))):
        return
    stored = board.claims.stored(run_id, r)

    def straggler(named: layout.Label) -> int | None:
        if named.kind == "shard" and named.round == r and named.shard is not None and named.shard not in stored:
            return named.shard
        return None

    backups.queue_backup(
        spec, board, worker, backups.running(board, run_id, straggler),
        claim=lambda k: layout.backup_claim(r, k), label=lambda k: layout.backup_label(r, k),
        task=train_backup, args=lambda k: (run_id, r, k),
        why=lambda k: f"round {r} waits for shard {k}: {worker} trains a backup copy, by its rate sooner")


# ---- the round's tasks -------------------------------------------------------------------------

@app.task(bind=True, name="tensorturn.fused.train_slot", max_retries=None)
def train_slot(self: Any, run_id: str, r: int, i: int, sig: str | None = None) -> dict[str, Any]:
    """What a round queues: train the shard slot i of round r is bound to (claimed on its first
    delivery, preferring a shard whose data this machine holds)."""
    def claim(board: RunBoard, spec: RunSpec, worker: str) -> layout.Label:
        shards = options(spec).shards
        try:
            held = recipe_of(spec).cached_shards(shards)
        except Exception:  # noqa: BLE001 - the shard's own attempt meets it again, and records it
            held = []
        return layout.shard_label(r, board.claims.claim_shard(run_id, r, i, worker, shards, held))

    return execute(self, run_id, layout.slot_label(r, i), shard_unit, sig, resolve=claim)


@app.task(bind=True, name="tensorturn.fused.train_shard", max_retries=None)
def train_shard(self: Any, run_id: str, r: int, k: int, sig: str | None = None) -> dict[str, Any]:
    """Train shard k for one round from θ_r and upload its pseudo-gradient (a named shard: what
    a slot becomes once bound; rounds queue slots)."""
    return execute(self, run_id, layout.shard_label(r, k), shard_unit, sig)


@app.task(bind=True, name="tensorturn.fused.train_backup", max_retries=None)
def train_backup(self: Any, run_id: str, r: int, k: int, sig: str | None = None) -> dict[str, Any]:
    """A backup copy of shard k of round r: whichever copy stores the shard first counts, the
    other stops at its next look (:class:`~.shard.Superseded`) or is discarded as late."""
    return execute(self, run_id, layout.backup_label(r, k), shard_unit, sig)


@app.task(bind=True, name="tensorturn.fused.outer_step", max_retries=None)
def outer_step(self: Any, _receipts: list, run_id: str, r: int, sig: str | None = None) -> dict[str, Any]:
    """Average round r's pseudo-gradients, step θ, then dispatch r+1 or finish (queued by the
    round's last shard stored; the first argument, once a chord's receipts, is empty)."""
    return execute(self, run_id, layout.outer_label(r), outer_unit, sig)


@app.task(bind=True, name="tensorturn.fused.evaluate", max_retries=None)
def evaluate(self: Any, run_id: str, r: int, sig: str | None = None) -> dict[str, Any]:
    """Evaluate round r's weights θ_{r+1} and record the round (queued by its outer step)."""
    return execute(self, run_id, layout.eval_label(r), EvalUnit, sig)
