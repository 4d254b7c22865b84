"""Backup copies for a fused run's stragglers (``--sync backup`` rounds, and the end of
``--sync async`` runs): when a machine finishes and there is nothing left to hand out (or, in
an async run, an update is a round behind the latest weights), it may train a copy of a unit
another machine is still training — if by the two machines' measured rates
it would finish first (the *longest approximate time to end* rule of speculative execution in
MapReduce-style schedulers). The copy goes to this machine's own queue, so the machine that was
judged faster is the one that runs it; whichever copy stores the unit first counts.

One queuer (:func:`queue_backup`) for both policies: they differ only in which units are
running, which task trains a copy, and the words of the incident.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tensorturn import layout
from tensorturn.modes.fused.options import options
from tensorturn.recipes import recipe_of
from tensorturn.spec import Outcome, RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.clock import broker_now
from tensorturn.tasks.attempt import Unit, signed

COPY_KINDS = ("backup", "update_backup")  # labels of backup copies (r<r>/backup-<k>, u<j>/backup)


class CopyAwareUnit(Unit):
    """A unit that may run as a backup copy: a copy that runs out of attempts is dropped with an
    incident — the original still trains the unit — while the original's failure fails the run."""

    def give_up(self, message: str) -> None:
        if self.a.label.kind in COPY_KINDS:
            self.board.incidents.add(self.spec.run_id, "backup_dropped", str(self.a.label), self.a.worker,
                                     message)
            return
        super().give_up(message)


@dataclass
class Running:
    """A unit some machine is training: its id, when its attempt began, on which worker."""

    unit: int
    started_at: float
    worker: str


def running(board: RunBoard, run_id: str, unit_of: Callable[[layout.Label], int | None]
            ) -> list[Running]:
    """The units of the run some machine is training now: each running attempt whose label
    ``unit_of`` maps to a unit (None: not one to copy)."""
    out = []
    for a in board.attempts.all(run_id):
        named = layout.parse_label(a["task"])
        unit = unit_of(named) if named is not None and a["outcome"] == Outcome.RUNNING else None
        if unit is not None:
            out.append(Running(unit, a["started_at"], a["worker"]))
    return out


def pick(board: RunBoard, running: list[Running], me: str, samples: int) -> int | None:
    """The unit to copy on worker ``me``: the one with the longest estimated time left, if ``me``
    would train a whole copy (``samples``) sooner than that; None when no copy would win or a
    rate is unknown."""
    mine = board.workers.last_rate(me)
    if not mine:
        return None
    own_s, now = samples / mine, broker_now(board.r)  # the attempts' clock
    best, best_left = None, own_s
    for unit in running:
        if unit.worker == me:
            continue
        rate = board.workers.last_rate(unit.worker)
        if not rate:
            continue
        left = samples / rate - (now - unit.started_at)
        if left > best_left:
            best, best_left = unit.unit, left
    return best


def queue_backup(spec: RunSpec, board: RunBoard, worker: str, candidates: list[Running],
                 claim: Callable[[int], str], label: Callable[[int], layout.Label],
                 task: Any, args: Callable[[int], tuple[Any, ...]], why: Callable[[int], str]) -> None:
    """Queue on ``worker``'s own queue a backup copy of the candidate it would beat by most
    (:func:`pick`), once per unit (``claim(unit)``): ``task`` with ``args(unit)``, signed for
    ``label(unit)``; the incident says ``why(unit)``."""
    samples = options(spec).sync_every * spec.batch_for(recipe_of(spec))
    unit = pick(board, candidates, worker, samples)
    if unit is None or not board.claims.claim(spec.run_id, claim(unit)):
        return
    what = str(label(unit))
    task.s(*args(unit), **signed(spec.run_id, what)).apply_async(queue=layout.agent_queue(worker))
    board.incidents.add(spec.run_id, "backup_queued", what, worker, why(unit))
