"""A slot queued ahead of its weights (``--sync rounds`` once rounds end quickly): it waits for
θ_r (:func:`await_base`), and the first such slot takes round r−1's outer step itself
(:func:`take_step`) — standing by while round r−1's last shard still trains, stepping the
moment it is counted, with no queue, machine or message between. A machine already free steps
while the one that trained the last shard takes its own next slot, and the machines start the
next round together (the step's records wait until the slot that stepped trains:
:attr:`~tensorturn.modes.fused.shard.ShardUnit.deferred`).

The waits here are blocking reads of an announcement on the broker (``await_global``,
``await_complete``: a second at most each, then a look at the run), not sleeps: the slot wakes
the moment θ_r, or the round's last shard, is announced.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from tensorturn import config, layout
from tensorturn.modes.fused.ahead import ReadAhead
from tensorturn.modes.fused.options import options
from tensorturn.modes.fused.plans import NOT_YET_S, QueueShard, SendStep
from tensorturn.modes.fused.weights import cache
from tensorturn.spec import Outcome
from tensorturn.tasks.attempt import NotYet, run_here

if TYPE_CHECKING:
    from tensorturn.modes.fused.shard import ShardUnit

STEP_GRACE_S = 2.0  # how long a slot waits for θ_r once round r−1's outer step is not seen running
WAIT_CAP_S = 20.0   # how long a slot waits for θ_r at most (a step's process may die unseen)


def await_base(unit: ShardUnit, r: int) -> None:
    """Round r's slots may be queued before θ_r is stored — by round r−1's last shard task,
    or its second-to-last, once rounds end quickly (:class:`~.sync.rounds.Rounds`) — so the machines
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
        if board.announcements.await_global(spec.run_id, r, 1):
            if store.exists(key):
                return
            time.sleep(0.2)  # announced but not there: a store that lags, or an old announcement
        unit.a.check_standing()  # a cancel; the owner, who may need the machine back
        if take_step(unit, r - 1):  # left to nobody: the slot that stood by gave up
            return
        complete = round_complete(unit, r - 1)
        step = board.attempts.latest(spec.run_id, label)
        running = complete and (step is not None and step["outcome"] == Outcome.RUNNING
                                and step["worker"] in board.workers.not_offline())
        unsure_since = None if running else (unsure_since or time.monotonic())
        now = time.monotonic()
        grace = STEP_GRACE_S if complete else incomplete_wait_s()
        if now - began >= WAIT_CAP_S or (unsure_since is not None and now - unsure_since >= grace):
            if store.exists(key):
                return
            unit.wires.queue([QueueShard(r, unit.a.label.numbers[1], countdown=NOT_YET_S)])
            raise NotYet(f"θ_{r} is not stored yet (round {r - 1}'s outer step "
                         + ("still runs" if running else "is not running") + f"); queued again in {NOT_YET_S:g} s")


def take_step(unit: ShardUnit, r: int) -> bool:
    """Round r's outer step, taken by ``unit`` — a slot of round r+1 about to wait for θ_{r+1} —
    unless another holds its claim; whether θ_{r+1} is stored now by it. The claim names the
    slot's task, so the same task delivered again after its machine was lost takes the step
    again. While round r's last shard still trains (the round queued ahead), the slot stands
    by: it waits for :meth:`~tensorturn.state.announcements.Announcements.announce_complete` (a look a second
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
                        unit.wires.queue([QueueShard(r + 1, unit.a.label.numbers[1], countdown=NOT_YET_S)])
                        raise NotYet(f"round {r} is not complete yet; this shard is queued again in {NOT_YET_S:g} s")
                    break  # complete the moment it gave up: it keeps the claim, and steps
                ahead.read(stored)
                board.announcements.await_complete(spec.run_id, r, 1)
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


def round_complete(unit: ShardUnit, r: int) -> bool:
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
    if run_here(unit.a, layout.outer_label(r), unit.wires.outer_unit(deferred=unit.deferred, ahead=ahead)):
        return unit.store.exists(layout.key("global", unit.spec.run_id, r + 1))  # else cancelled, or given up
    unit.wires.queue([SendStep(r), QueueShard(r + 1, unit.a.label.numbers[1], countdown=NOT_YET_S)])
    raise NotYet(f"round {r}'s outer step failed on this machine and was queued; this shard is "
                 f"queued again in {NOT_YET_S:g} s")
