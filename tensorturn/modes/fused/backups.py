"""Backup copies for a fused run's stragglers (``--sync backup`` rounds, and the end of
``--sync async`` runs): when a machine finishes and there is nothing left to hand out, it may
train a copy of a unit another machine is still training — if by the two machines' measured rates
it would finish first (the *longest approximate time to end* rule of speculative execution in
MapReduce-style schedulers). The copy goes to this machine's own queue, so the machine that was
judged faster is the one that runs it; whichever copy stores the unit first counts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from tensorturn import layout
from tensorturn.state.board import RunBoard
from tensorturn.tasks.attempt import Unit

COPY_KINDS = ("backup", "update_backup")  # labels of backup copies (r<r>/backup-<k>, u<j>/backup)


class CopyAwareUnit(Unit):
    """A unit that may run as a backup copy: a copy that runs out of attempts is dropped with an
    incident — the original still trains the unit — while the original's failure fails the run."""

    def give_up(self, message: str) -> None:
        if self.a.label.kind in COPY_KINDS:
            self.board.incident(self.spec.run_id, "backup_dropped", str(self.a.label), self.a.worker,
                                message)
            return
        super().give_up(message)


@dataclass
class Running:
    """A unit some machine is training: its id, when its attempt began, on which worker."""

    unit: int
    started_at: float
    worker: str


def last_rate(board: RunBoard, worker: str) -> float | None:
    """A worker's samples/s over its last whole training task (``TaskReporter.done``)."""
    raw = board.r.hget(layout.worker_key(worker), "last_rate")
    return float(raw) if raw else None


def pick(board: RunBoard, running: list[Running], me: str, samples: int) -> int | None:
    """The unit to copy on worker ``me``: the one with the longest estimated time left, if ``me``
    would train a whole copy (``samples``) sooner than that; None when no copy would win or a
    rate is unknown."""
    mine = last_rate(board, me)
    if not mine:
        return None
    own_s, now = samples / mine, time.time()
    best, best_left = None, own_s
    for unit in running:
        if unit.worker == me:
            continue
        rate = last_rate(board, unit.worker)
        if not rate:
            continue
        left = samples / rate - (now - unit.started_at)
        if left > best_left:
            best, best_left = unit.unit, left
    return best
