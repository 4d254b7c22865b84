"""``--sync rounds`` (the default): a barrier per round, as DiLoCo's.

A round is one task per shard — a *slot*, bound to a shard by the first worker that runs it,
which takes a shard it trained before where it can (its chunks are cached there) — and the outer
step (:class:`~tensorturn.modes.fused.outer.OuterUnit`), taken once by whichever shard task finds
the round's last shard stored: in that task itself, unless an agent beside the store serves
outer steps (then queued there; also queued when the step failed in the task, for its retries).
Once a run's rounds end quickly (under a second from a round's second-to-last shard stored to
the next weights), the next round is queued ahead — when a round's second-to-last shard is
stored — and the first of its slots to start claims the step and stands by; the last shard
stored wakes it, and it takes the step in its own task (:func:`take_step`). A machine already
free steps while the one that trained the last shard takes its own next slot, and the machines
start round r+1 together (its records wait until the slot that stepped trains).
The outer step queues the next round once θ_{r+1} is stored, then the round's evaluation
(:class:`~tensorturn.modes.fused.outer.EvalUnit`) behind it: the first machine done with round
r+1's shard evaluates θ_{r+1} while the others finish theirs. The result depends on (S, H, seed,
threads) only: the same weights on 1 or N machines.

Why not a Celery chord: its counter lives in the result backend — every header task stores a
result, and the chord's bookkeeping adds about 17 broker commands a shard task (a round trip
each on a home link, ``benchmarks/broker_commands.py``) — and a count of returned tasks is no
proof that a shard is stored. Here a shard task that ends with its shard stored (or finds it
stored: a redelivery after a crash) marks it in ``stored-r<r>`` and reads how many are, in one
round trip; the one that sees all S takes the outer step under a one-time claim that names its
task. A crash before the claim is harmless (the redelivered task marks and counts again); a
crash during an outer step taken in the task delivers that task again (its message is
acknowledged only when it ends), which holds the claim already and steps again; a dispatch
that fails gives the claim back.

The round's Celery tasks are defined here; ``--sync backup`` (:mod:`.backup`) queues the same.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from tensorturn import config, layout
from tensorturn.modes.fused.ahead import ReadAhead
from tensorturn.modes.fused.options import evaluated, options
from tensorturn.modes.fused.outer import EvalUnit, OuterUnit, shard_figures, unevaluated_round
from tensorturn.modes.fused.shard import ShardUnit
from tensorturn.modes.fused.sync.base import SyncPolicy
from tensorturn.modes.fused.weights import cache
from tensorturn.pool import routing
from tensorturn.pool.capacity import queue_for
from tensorturn.pool.celery_app import app, publishing
from tensorturn.recipes import recipe_of
from tensorturn.spec import Outcome, RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.store import seals
from tensorturn.store.objects import Store
from tensorturn.tasks.attempt import Attempt, NotYet, Unit, execute, run_here, signed

log = logging.getLogger(__name__)

STEP_GRACE_S = 2.0  # how long a slot waits for θ_r once round r−1's outer step is not seen running
WAIT_CAP_S = 20.0   # how long a slot waits for θ_r at most (a step's process may die unseen)
NOT_YET_S = 3.0     # a slot that stopped waiting is queued again this much later

class Rounds(SyncPolicy):
    """A barrier per round: the task that stores its last shard takes the outer step (or queues
    it, :func:`queue_outer`), and round r+1 is queued once θ_{r+1} is stored — or, once rounds
    end quickly, round r+1 is queued first and one of its slots takes the step
    (:meth:`after_shard`, :func:`take_step`) while the others wait for θ_{r+1}
    (:meth:`await_global`)."""

    name = "rounds"
    queues_ahead = True  # the next round queued when all but one of a round's shards are stored

    def start(self, spec: RunSpec, store: Store, board: RunBoard) -> None:
        board.claim(spec.run_id, layout.dispatch_claim(0))
        dispatch_round(spec, 0, board)

    def resume(self, spec: RunSpec, store: Store, board: RunBoard) -> str:
        """Continue from the last round whose global weights are in the store."""
        r, rounds = last_stored_round(spec, store, board), options(spec).rounds
        board.claims.forget_stored(spec.run_id, range(r, rounds))  # counted again from the store
        board.claim(spec.run_id, layout.dispatch_claim(r))
        dispatch_round(spec, r, board)
        return f"resumed at round {r} of 0..{rounds - 1}"

    def after_shard(self, spec: RunSpec, store: Store, board: RunBoard, r: int, k: int,
                    worker: str, here: Attempt | None = None) -> None:
        """Once the previous round ended quickly (:func:`hands_over_step`): the round's
        second-to-last shard stored queues the next round ahead, and its last wakes the slot
        standing by to take the step (:func:`take_step`), or takes it itself where none does —
        or queues the next round, whose first slot takes it. Else the last takes the step
        (:func:`queue_outer`)."""
        shards = options(spec).shards
        stored, last_end = board.claims.note_stored(spec.run_id, r, k, worker, shards)
        if stored + 1 < shards:
            return
        quick = hands_over_step(spec, board, r, here, last_end)
        if stored + 1 == shards:
            if quick and self.queues_ahead:
                queue_round(spec, board, r + 1)  # ahead: the machines free already wait in its slots
            return
        if not quick:
            queue_outer(spec, board, r, here)
        elif not queue_round(spec, board, r + 1) and not queue_outer(spec, board, r, here):
            board.claims.announce_complete(spec.run_id, r)  # queued ahead: wake the slot standing by

    def after_outer(self, spec: RunSpec, board: RunBoard, r: int) -> None:
        if r + 1 < options(spec).rounds:
            board.claims.announce_global(spec.run_id, r + 1)  # for slots queued ahead of θ_{r+1}
            queue_round(spec, board, r + 1)
            queue_eval(spec, board, r)

    def await_global(self, unit: Unit, r: int) -> None:
        """Round r's slots may be queued before θ_r is stored — by round r−1's last shard task,
        or its second-to-last (:meth:`after_shard`), once rounds end quickly — so the machines
        free at the barrier take them, read their data and wait here for θ_r, announced the
        moment it is stored, rather than be queued and picked up after it. The first such slot
        takes round r−1's outer step itself (:func:`take_step`), at once when the round is
        complete, else once its last shard is stored. A wait lasts while round r−1's outer step
        runs on a machine that is not offline, for at most :data:`WAIT_CAP_S`; a step that
        failed, or whose machine went offline, is waited for :data:`STEP_GRACE_S` more, and a
        round still incomplete for :func:`incomplete_wait_s` (its last shard late: a straggler,
        or a machine lost, whose shard comes back to the queue for a machine free to take it).
        Then the shard is queued again a few seconds later (behind
        whatever the round needs first: the outer step's message queued again, or the shard
        task that was taking it, delivered again), and its machine takes the next message. A
        machine whose owner pauses it, or whose agent stops, hands the slot back within about a
        second of waiting."""
        spec, store, board = unit.spec, unit.store, unit.board
        held = cache.get(spec.run_id)
        if r == 0 or (held is not None and held[0] >= r):  # θ_r is here already: no look at the store
            return
        key, label = layout.key("global", spec.run_id, r), str(layout.outer_label(r - 1))
        if not store.exists(key) and take_step(unit, r - 1):
            return
        began, unsure_since = time.monotonic(), None
        while not store.exists(key):
            if board.claims.await_global(spec.run_id, r, 1):
                if store.exists(key):
                    return
                time.sleep(0.2)  # announced but not there: a store that lags, or an old announcement
            unit.a.check_standing()  # a cancel; the owner, who may need the machine back
            if take_step(unit, r - 1):  # left to nobody: the slot that stood by gave up
                return
            complete = round_complete(unit, r - 1)
            step = board.attempt_log.latest(spec.run_id, label)
            running = complete and (step is not None and step["outcome"] == Outcome.RUNNING
                                    and step["worker"] in board.workers.not_offline())
            unsure_since = None if running else (unsure_since or time.monotonic())
            now = time.monotonic()
            grace = STEP_GRACE_S if complete else incomplete_wait_s()
            if now - began >= WAIT_CAP_S or (unsure_since is not None and now - unsure_since >= grace):
                if store.exists(key):
                    return
                queue_shard(spec, r, unit.a.label.numbers[1], countdown=NOT_YET_S)
                raise NotYet(f"θ_{r} is not stored yet (round {r - 1}'s outer step "
                             + ("still runs" if running else "is not running") + f"); queued again in {NOT_YET_S:g} s")


def last_stored_round(spec: RunSpec, store: Store, board: RunBoard) -> int:
    """For a resume: the last round whose global weights θ_r are stored (the last round itself
    when every round is: its outer step finalizes again), the records of the rounds before it
    rebuilt on the board from the store (a broker may have forgotten them), each as it was
    recorded. A round before it with no record — its evaluation was queued behind the next
    round's shards when the run was cancelled or its chain lost — is recorded now, ahead of
    the rounds to come: its evaluation queued first (:func:`queue_eval`), or, where
    ``--eval-every`` skips it, its training figures. Were it left to the run's last outer step,
    its record would wait for the whole run, and every round line after it with it."""
    stored = [layout.parse("global", key) for key in store.list(layout.prefix("global", spec.run_id))]
    r = max((parts["round"] for parts in stored if parts), default=0)
    for past in range(r):
        key = layout.key("round", spec.run_id, past)
        if store.exists(key):
            board.record_round(spec.run_id, past, seals.get_json(store, key))
        elif not evaluated(spec, past):
            info = unevaluated_round(past, shard_figures(spec, store, past))
            seals.put_json(store, key, info)
            board.record_round(spec.run_id, past, info)
        elif past + 1 < options(spec).rounds:  # (the last round's outer step evaluates it)
            queue_eval(spec, board, past)
    return min(r, options(spec).rounds - 1)


def dispatch_round(spec: RunSpec, r: int, board: RunBoard) -> None:
    """Queue round r: a slot per shard, on machines that can hold the model. A slot trains the
    shard its first worker claims (:meth:`RunBoard.claim_shard`): one it trained before where it
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
    return board.once(spec.run_id, layout.dispatch_claim(r), lambda: dispatch_round(spec, r, board))


def queue_outer(spec: RunSpec, board: RunBoard, r: int, here: Attempt | None = None) -> bool:
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
    Whether this call took or queued the step: False when another holds its claim (a slot of
    round r+1 standing by, :func:`take_step`)."""
    run_id = spec.run_id
    anywhere = queue_for(spec.memory_needed_bytes)
    queue = routing.queue_for_outer(board.r, anywhere)

    def send() -> None:
        send_outer(spec, board, r, queue)

    if here is None or here.task.request.is_eager:
        return board.once(run_id, layout.outer_claim(r), send)
    if not board.claims.claim_for(run_id, layout.outer_claim(r), f"task:{here.task.request.id}"):
        return False  # another task has it (this one's earlier delivery would hold it)
    last = r + 1 == options(spec).rounds
    if queue != anywhere or (last and len(board.rounds(run_id)) < r):
        try:
            send()
        except BaseException:
            board.release(run_id, layout.outer_claim(r))
            raise
        return True
    if not run_here(here, layout.outer_label(r), OuterUnit):
        send()
    return True


def send_outer(spec: RunSpec, board: RunBoard, r: int, queue: str | None = None) -> None:
    """Queue round r's outer step on ``queue`` (by default where outer steps go: beside the store
    while an agent there serves them, :func:`~tensorturn.pool.routing.queue_for_outer`)."""
    run_id = spec.run_id
    if queue is None:
        queue = routing.queue_for_outer(board.r, queue_for(spec.memory_needed_bytes))
    outer_step.s([], run_id, r, **signed(run_id, str(layout.outer_label(r)))).apply_async(queue=queue)


def hands_over_step(spec: RunSpec, board: RunBoard, r: int, here: Attempt | None, last_end: float | None) -> bool:
    """Whether round r's last shard task (``here``) leaves the outer step to a slot of round r+1
    (:func:`take_step`), and its second-to-last queues that round ahead (where the policy
    :attr:`~Rounds.queues_ahead`; else the last queues it, and its first slot steps): for a round before the
    last, where no agent beside the store serves outer steps, once round r−1's end —
    ``last_end``, from its second-to-last shard stored to θ_r announced — took under
    ``TENSORTURN_QUICK_END_S`` (1 s: the slots that wait for θ_{r+1} meanwhile wait briefly —
    short rounds, quick steps; 0 turns this off). Not for a task applied in a caller's process
    (tests that drive each unit)."""
    if (last_end is None or last_end >= config.current().quick_end_s or here is None
            or here.task.request.is_eager or r + 1 >= options(spec).rounds):
        return False
    anywhere = queue_for(spec.memory_needed_bytes)
    return routing.queue_for_outer(board.r, anywhere) == anywhere


def take_step(unit: Unit, r: int) -> bool:
    """Round r's outer step, taken by ``unit`` — a slot of round r+1 about to wait for θ_{r+1} —
    unless another holds its claim; whether θ_{r+1} is stored now by it. The claim names the
    slot's task, so the same task delivered again after its machine was lost takes the step
    again. While round r's last shard still trains (the round queued ahead), the slot stands
    by: it waits for :meth:`~tensorturn.state.claims.Claims.announce_complete` (a look a second
    at most), so the step begins the moment the last shard is counted, with no queue, machine
    or message between. A slot that stops waiting — the round still incomplete after
    :func:`incomplete_wait_s` (looked at and given back in one command: the last shard stored
    meanwhile finds the claim free and steps itself, or else this slot steps), a cancel, its
    owner's pause, its agent stopping — gives the claim back first (then the round's last shard
    task, or a slot that waits, takes the step),
    and one past the cap is queued again :data:`NOT_YET_S` later, its machine free meanwhile
    (to train the late shard, if it comes back to the queue). While it stands by it reads the
    step's inputs stored so far (:class:`~tensorturn.modes.fused.ahead.ReadAhead`). The step
    itself: :func:`step_in_slot`."""
    if not isinstance(unit, ShardUnit):
        return False
    spec, board = unit.spec, unit.board
    what, holder, shards = layout.outer_claim(r), f"task:{unit.a.task.request.id}", options(spec).shards
    held, stored = board.claims.claim_step(spec.run_id, r, what, holder)
    began, ahead = time.monotonic(), ReadAhead(spec, unit.store, r, check=lambda: unit.a.check_standing(now=False))
    try:
        try:
            while held and len(stored) < shards:
                unit.a.check_standing()
                if time.monotonic() - began >= incomplete_wait_s():
                    if board.claims.release_unless_complete(spec.run_id, r, shards, what, holder):
                        queue_shard(spec, r + 1, unit.a.label.numbers[1], countdown=NOT_YET_S)
                        raise NotYet(f"round {r} is not complete yet; this shard is queued again in {NOT_YET_S:g} s")
                    break  # complete the moment it gave up: it keeps the claim, and steps
                ahead.read(stored)
                board.claims.await_complete(spec.run_id, r, 1)
                held, stored = board.claims.claim_step(spec.run_id, r, what, holder)
        except BaseException:
            board.claims.release_if_held(spec.run_id, what, holder)
            raise
        return held and step_in_slot(unit, r, ahead)  # (not held: another's, or the claims cleared by a resume)
    finally:
        ahead.close()


def incomplete_wait_s() -> float:
    """How long a slot queued ahead waits for its round's last shard: twice as long as rounds
    are expected to end (``TENSORTURN_QUICK_END_S``), :data:`STEP_GRACE_S` at least and
    :data:`WAIT_CAP_S` at most — past that the last shard is late (a straggler, or a machine
    lost, whose shard comes back to the queue), and the machines waiting are better free."""
    return min(WAIT_CAP_S, max(STEP_GRACE_S, 2 * config.current().quick_end_s))


def round_complete(unit: Unit, r: int) -> bool:
    """Whether all of round r's shards are marked stored."""
    return len(unit.board.claims.stored(unit.spec.run_id, r)) >= options(unit.spec).shards


def step_in_slot(unit: ShardUnit, r: int, ahead: ReadAhead | None = None) -> bool:
    """Take round r's outer step, claimed, in the slot ``unit`` of round r+1 (its attempt
    recorded as a queued one's would be: :func:`~tensorturn.tasks.attempt.run_here`); whether
    θ_{r+1} is stored now. What can wait — the round's record — waits until the slot's shard
    trains (:attr:`ShardUnit.deferred`), and θ_{r+1} stays in memory for it. A step that fails
    here is queued as a message (its retries and attempt cap as ever) and the slot queued again
    :data:`NOT_YET_S` later, so this machine is free to take the step's message. ``ahead``: what
    the slot read of the step's inputs while it stood by."""
    spec, board = unit.spec, unit.board
    if run_here(unit.a, layout.outer_label(r), functools.partial(OuterUnit, deferred=unit.deferred, ahead=ahead)):
        return unit.store.exists(layout.key("global", spec.run_id, r + 1))  # else cancelled, or given up
    send_outer(spec, board, r)
    queue_shard(spec, r + 1, unit.a.label.numbers[1], countdown=NOT_YET_S)
    raise NotYet(f"round {r}'s outer step failed on this machine and was queued; this shard is "
                 f"queued again in {NOT_YET_S:g} s")


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
    board.once(run_id, layout.eval_claim(r), lambda: evaluate.s(
        run_id, r, **signed(run_id, str(layout.eval_label(r)))).apply_async(queue=queue))


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
        return layout.shard_label(r, board.claim_shard(run_id, r, i, worker, shards, held))

    return execute(self, run_id, layout.slot_label(r, i), ShardUnit, sig, resolve=claim)


@app.task(bind=True, name="tensorturn.fused.train_shard", max_retries=None)
def train_shard(self: Any, run_id: str, r: int, k: int, sig: str | None = None) -> dict[str, Any]:
    """Train shard k for one round from θ_r and upload its pseudo-gradient (a named shard: what
    a slot becomes once bound; rounds queue slots)."""
    return execute(self, run_id, layout.shard_label(r, k), ShardUnit, sig)


@app.task(bind=True, name="tensorturn.fused.outer_step", max_retries=None)
def outer_step(self: Any, _receipts: list, run_id: str, r: int, sig: str | None = None) -> dict[str, Any]:
    """Average round r's pseudo-gradients, step θ, then dispatch r+1 or finish (queued by the
    round's last shard stored; the first argument, once a chord's receipts, is empty)."""
    return execute(self, run_id, layout.outer_label(r), OuterUnit, sig)


@app.task(bind=True, name="tensorturn.fused.evaluate", max_retries=None)
def evaluate(self: Any, run_id: str, r: int, sig: str | None = None) -> dict[str, Any]:
    """Evaluate round r's weights θ_{r+1} and record the round (queued by its outer step)."""
    return execute(self, run_id, layout.eval_label(r), EvalUnit, sig)
