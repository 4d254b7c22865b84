"""What the one executor (:mod:`tensorturn.tasks.attempt`) hands between the part every
attempt shares and the part that depends on how the unit came to run: the :data:`Delivery`
(a queued message, or in place in another unit's task) and the :class:`Ending` it came to."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from celery import Task


@dataclass(frozen=True)
class Queued:
    """A message taken from a queue: the attempt runs under the message's lease (a replayed
    copy begins none), a unit found done is an incident, and a failure is retried, given up
    past the cap, or blamed on the machine (quarantine) by :func:`~tensorturn.tasks.attempt.execute`."""

    task: Task
    fallback = "retrying"  # what becomes of a follow-up that could not be queued


@dataclass(frozen=True)
class InPlace:
    """A unit run in the task of another whose work made it ready (no lease of its own: the
    parent's message stands for it); retries, quarantine and the cap's failure are left to the
    unit's own message, which the caller queues when the attempt did not end well."""

    fallback = "its message is queued"


Delivery = Queued | InPlace


class End(Enum):
    """How an attempt ended, as far as its delivery must act on it."""

    DONE = "done"                          # its output stored (now or before); what follows queued
    SKIPPED = "skipped"                    # nothing to do: a replayed copy, a run the store saw finish
    FOLLOW_UP_FAILED = "follow-up failed"  # done and recorded; what follows could not be queued
    NOT_YET = "not yet"                    # refused, at no cost: queued again by whoever said so
    HANDED_BACK = "handed back"            # the machine's owner needs it: recorded at no cost
    CANCELLED = "cancelled"                # the run was cancelled: recorded, never retried
    GAVE_UP = "gave up"                    # past its attempt cap: given up (the run fails, a member drops)
    RUN_FAILED = "run failed"              # the recipe's own code raised: the run failed at once
    MACHINE_FAULT = "machine fault"        # this machine's store fails where others' answer: quarantined
    FAILED = "failed"                      # recorded failed: to be retried, or given up past the cap


@dataclass(frozen=True)
class Ending:
    end: End
    message: str = ""  # a failure's one line
    number: int = 0    # the failed attempt's number

    @property
    def well(self) -> bool:
        """Whether nothing more is needed of the unit's own message (what :func:`run_here` says):
        false for a failure, a follow-up not queued, or a hand-back."""
        return self.end not in (End.FAILED, End.FOLLOW_UP_FAILED, End.HANDED_BACK, End.MACHINE_FAULT)
