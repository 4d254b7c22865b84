"""A unit of work and the attempt that runs it: what a unit is given (:class:`Attempt`, its
record and its looks at the run), what it may raise to end its attempt early (:class:`NotYet`,
:class:`RunCancelled`; :class:`~tensorturn.pool.owner.HandedBack`), and what it implements
(:class:`Unit`). The protocol that runs it is :mod:`tensorturn.tasks.attempt`."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from celery import Task

from tensorturn.layout import Label
from tensorturn.pool.owner import HandedBack
from tensorturn.pool.threads import stopping
from tensorturn.spec import Outcome, RunSpec, RunState
from tensorturn.state.board import RunBoard
from tensorturn.state.manifest import fail_run
from tensorturn.store.objects import Store
from tensorturn.store.objects import moved as store_moved
from tensorturn.tasks.poll import CAP_S, poll

SUCCEEDED: str = Outcome.SUCCEEDED
LATE = Outcome.LATE.says("output already stored")
CANCEL_LOOK_S = 1.0           # how often (at most) a running attempt looks whether its run was cancelled
CANCELLED = Outcome.CANCELLED.says("the run was cancelled; nothing stored")


@dataclass
class Attempt:
    """The attempt in progress: who runs it, and its record's key and number."""

    task: Task
    board: RunBoard
    store: Store
    spec: RunSpec
    label: Label
    worker: str
    key: str = ""
    number: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    rate: float | None = None  # samples/s over the whole task, once it trained
    trained_from: float | None = None  # when it began training (broker clock), once it did
    trained_s: float | None = None  # how long its training took (the run's measured utilisation)
    step: tuple[str, float] | None = None  # (recipe, seconds a step) its worker publishes for plans
    tally: Tally | None = None  # the store bytes of this task's process not yet recorded
    ended: bool = False  # its outcome is recorded: a failure after that (the run's end) leaves it
    looked_at: float = 0.0

    @property
    def run_id(self) -> str:
        return self.spec.run_id

    def look(self, now: bool = False, standing: bool = False) -> None:
        """Raise :class:`RunCancelled` if the run was cancelled and, with ``standing``,
        :class:`HandedBack` if this machine's owner needs it or its agent stops — in one round
        trip, and without ``now`` once per :data:`CANCEL_LOOK_S` at most, whichever look was
        last: units look between training steps or downloads, and with ``now`` just before
        storing their output, so a cancelled run's attempts stop within a second and store
        nothing."""
        t = time.monotonic()
        if not now and t - self.looked_at < CANCEL_LOOK_S:
            return
        self.looked_at = t
        if standing:
            state, _, paused = self.board.state_and_standing(self.spec.run_id, self.worker)
        else:
            state, paused = self.board.runs.state(self.spec.run_id), None
        if state == RunState.CANCELLED:
            raise RunCancelled(f"run {self.spec.run_id} was cancelled")
        if paused:
            raise HandedBack(paused)
        if standing and stopping.is_set():
            raise HandedBack("its agent is stopping")

    def check_cancelled(self, now: bool = False) -> None:
        """:meth:`look` at the run's state only (a training loop reads its standing from its
        progress report)."""
        self.look(now)

    def check_standing(self, now: bool = True) -> None:
        """:meth:`look` at the run's state and this machine's standing: for a unit that waits
        rather than trains; at once unless told otherwise."""
        self.look(now, standing=True)

    def waits(self, cap: float = CAP_S, within: float | None = None, standing: bool = False) -> Iterator[float]:
        """The pauses of a wait of this attempt (:func:`~tensorturn.tasks.poll.poll`), with a
        paced :meth:`look` between them: a cancel, and with ``standing`` a hand-back, ends it."""
        return poll(lambda: self.look(standing=standing), cap=cap, within=within)


class NotYet(Exception):
    """What the unit needs is not there yet, and it was queued again (by whoever raised this):
    the attempt ends ``refused: <why>`` without using one of the unit's attempts up."""


class RunCancelled(Exception):
    """The run was cancelled (``tensorturn cancel``) while this attempt ran."""


def watch_cancelled(on_step: Callable[[int, float], None], attempt: Attempt,
                    reporter: Any = None) -> Callable[[int, float], None]:
    """``on_step`` (a training loop's per-step callback), then a look whether the run was
    cancelled, and whether this machine's owner needs it (:class:`HandedBack`, read from the
    reporter's progress report). With a ``reporter`` (:class:`tensorturn.pool.telemetry.TaskReporter` with a live
    field, called by ``on_step``) the look is the run state its progress report read — no round
    trip of its own, about once a second; else :meth:`Attempt.check_cancelled`."""

    def step(n: int, loss: float) -> None:
        on_step(n, loss)
        if reporter is not None and reporter.paused:
            raise HandedBack(reporter.paused)
        if stopping.is_set():  # the threads pool's agent stops: its task goes back to the queue
            raise HandedBack("its agent is stopping")
        if reporter is None or reporter.live is None:
            attempt.check_cancelled()
        elif reporter.run_state == RunState.CANCELLED:
            raise RunCancelled(f"run {attempt.run_id} was cancelled")

    return step


class Unit(ABC):
    """One unit of work. Subclasses say when it is done, how to do it, what follows it, and what
    giving up means; :func:`~tensorturn.tasks.attempt.execute` does the rest."""

    def __init__(self, attempt: Attempt):
        self.a = attempt
        self.spec, self.store, self.board = attempt.spec, attempt.store, attempt.board
        self.final: dict[str, Any] | None = None

    def finish_run(self, state: str, **fields: Any) -> None:
        """Finish the run with this attempt (``board.finish``'s arguments): the attempt's outcome
        and figures are recorded first, then the manifest holding the final state is saved, and
        the board's state moves last (:func:`~tensorturn.state.manifest.end_run`) — so whoever
        sees the run finished sees its records complete, in the store too."""
        self.final = {"state": state, **fields}

    @abstractmethod
    def done(self) -> bool:
        """True when the unit's output is already stored (nothing must be written then)."""

    @abstractmethod
    def run(self) -> str:
        """Do the work and store the output; returns the attempt's outcome: :data:`SUCCEEDED`,
        :data:`LATE` when another attempt stored the output first, or ``refused: <why>``."""

    def then(self) -> None:  # noqa: B027 - optional: most units queue nothing
        """Queue what follows the unit; idempotent (one-time claims), called after run() and
        for duplicates, so a follow-up lost with a crashed attempt is queued by the next."""

    def give_up(self, message: str) -> None:
        """Past the attempt cap: by default the run fails with ``message`` (its manifest first)."""
        fail_run(self.store, self.board, self.spec.run_id, message)


class Tally:
    """The bytes this process moved through the store since the last :meth:`take`: an attempt's
    are added to the run's figures with its outcome (so an attempt seen finished is counted),
    and what it moves after that, once it ends."""

    def __init__(self) -> None:
        self.mark = self.next = store_moved()

    def take(self) -> tuple[int, int]:
        moved = self.pending()
        self.settle()
        return moved

    def pending(self) -> tuple[int, int]:
        """What was moved since the last take, counted once :meth:`settle` says it is recorded."""
        self.next = store_moved()
        return self.next[0] - self.mark[0], self.next[1] - self.mark[1]

    def settle(self) -> None:
        self.mark = self.next
