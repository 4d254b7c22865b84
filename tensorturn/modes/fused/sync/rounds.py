"""``--sync rounds`` (the default): a barrier per round, as DiLoCo's.

A round is one task per shard — a *slot*, bound to a shard by the first worker that runs it,
which takes a shard it trained before where it can (its chunks are cached there) — and the outer
step (:class:`~tensorturn.modes.fused.outer.OuterUnit`), taken once by whichever shard task finds
the round's last shard stored: in that task itself, unless an agent beside the store serves
outer steps (then queued there; also queued when the step failed in the task, for its retries).
Once a run's rounds end quickly (under a second from a round's second-to-last shard stored to
the next weights), the next round is queued ahead — when a round's second-to-last shard is
stored — and the first of its slots to start claims the step and stands by; the last shard
stored wakes it, and it takes the step in its own task (:mod:`~tensorturn.modes.fused.standby`). A machine already
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

This module decides (:class:`Rounds`); the round's Celery tasks, and the queuing of what it
decides, are the driver's (:mod:`tensorturn.modes.fused.driver`); ``--sync backup``
(:mod:`.backup`) queues the same.
"""

from __future__ import annotations

import logging

from tensorturn import config, layout
from tensorturn.modes.fused.options import evaluated, options
from tensorturn.modes.fused.outer import shard_figures, unevaluated_round
from tensorturn.modes.fused.plans import (
    AnnounceGlobal,
    Context,
    HandOver,
    QueueEval,
    QueueRound,
    QueueStep,
    ShardDone,
    ShardPlan,
    StepDone,
    Work,
)
from tensorturn.modes.fused.sync.base import SyncPolicy
from tensorturn.pool import routing
from tensorturn.pool.capacity import queue_for
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.store import seals
from tensorturn.store.objects import Store
from tensorturn.tasks.attempt import Attempt

log = logging.getLogger(__name__)


class Rounds(SyncPolicy):
    """A barrier per round: the task that stores its last shard takes the outer step (or queues
    it), and round r+1 is queued once θ_{r+1} is stored — or, once rounds end quickly, round r+1
    is queued first and one of its slots takes the step while the others wait for θ_{r+1}
    (:meth:`on_output`, :mod:`~tensorturn.modes.fused.standby`)."""

    name = "rounds"
    queues_ahead = True  # the next round queued when all but one of a round's shards are stored

    def start(self, run: Context) -> list[Work]:
        return [QueueRound(0, again=True)]

    def resume(self, run: Context) -> tuple[list[Work], str]:
        """Continue from the last round whose global weights are in the store."""
        spec = run.spec
        r, evals = last_stored_round(spec, run.store, run.board)
        rounds = options(spec).rounds
        run.board.forget_rounds(spec.run_id, range(r, rounds))  # counted again from the store
        return [*evals, QueueRound(r, again=True)], f"resumed at round {r} of 0..{rounds - 1}"

    def shard_plan(self, r: int, k: int) -> ShardPlan:
        return ShardPlan(base=r, standby=True)  # (queued ahead of θ_r once rounds end quickly)

    def on_output(self, run: Context, done: ShardDone) -> list[Work]:
        """Once the previous round ended quickly (:func:`hands_over_step`): the round's
        second-to-last shard stored queues the next round ahead, and its last wakes the slot
        standing by to take the step, or takes it itself where none does — or queues the next
        round, whose first slot takes it (:class:`~.plans.HandOver`). Else the last takes the
        step (:class:`~.plans.QueueStep`)."""
        spec, r = run.spec, done.r
        shards = options(spec).shards
        stored, last_end = run.board.claims.note_stored(spec.run_id, r, done.k, done.worker, shards)
        if stored + 1 < shards:
            return []
        quick = hands_over_step(spec, run.board, r, done.here, last_end)
        if stored + 1 == shards:  # ahead: the machines free already wait in its slots
            return [QueueRound(r + 1)] if quick and self.queues_ahead else []
        return [HandOver(r, done.here)] if quick else [QueueStep(r, done.here)]

    def on_step(self, run: Context, done: StepDone) -> list[Work]:
        r = done.r
        if r + 1 >= options(run.spec).rounds:
            return []
        # announced for the slots queued ahead of θ_{r+1}
        return [AnnounceGlobal(r + 1), QueueRound(r + 1), QueueEval(r)]


def last_stored_round(spec: RunSpec, store: Store, board: RunBoard) -> tuple[int, list[Work]]:
    """For a resume: the last round whose global weights θ_r are stored (the last round itself
    when every round is: its outer step finalizes again), the records of the rounds before it
    rebuilt on the board from the store (a broker may have forgotten them), each as it was
    recorded. A round before it with no record — its evaluation was queued behind the next
    round's shards when the run was cancelled or its chain lost — is recorded now, ahead of
    the rounds to come: its evaluation queued first (the work returned), or, where
    ``--eval-every`` skips it, its training figures. Were it left to the run's last outer step,
    its record would wait for the whole run, and every round line after it with it."""
    stored = [layout.parse("global", key) for key in store.list(layout.prefix("global", spec.run_id))]
    r = max((parts["round"] for parts in stored if parts), default=0)
    evals: list[Work] = []
    for past in range(r):
        key = layout.key("round", spec.run_id, past)
        if store.exists(key):
            board.record_round(spec.run_id, past, seals.get_json(store, key))
        elif not evaluated(spec, past):
            info = unevaluated_round(past, shard_figures(spec, store, past))
            seals.put_json(store, key, info)
            board.record_round(spec.run_id, past, info)
        elif past + 1 < options(spec).rounds:  # (the last round's outer step evaluates it)
            evals.append(QueueEval(past))
    return min(r, options(spec).rounds - 1), evals


def hands_over_step(spec: RunSpec, board: RunBoard, r: int, here: Attempt | None, last_end: float | None) -> bool:
    """Whether round r's last shard task (``here``) leaves the outer step to a slot of round r+1
    (:func:`~tensorturn.modes.fused.standby.take_step`), and its second-to-last queues that
    round ahead (where the policy :attr:`~Rounds.queues_ahead`; else the last queues it, and its
    first slot steps): for a round before the
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
