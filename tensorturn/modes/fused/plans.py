"""What a sync policy tells the work it schedules, and what that work tells it back: data only
(Flower's ``FitIns``/``FitRes``), so a shard task or an outer step never looks a policy up.

A policy (:class:`~tensorturn.modes.fused.sync.base.SyncPolicy`) says how shard k of round r
trains (:class:`ShardPlan`) and how round r's outer step gathers its inputs (:class:`StepPlan`);
the units report a stored output (:class:`ShardDone`) and a step taken (:class:`StepDone`), and
the policy answers with the :data:`Work` that follows, which the driver
(:mod:`tensorturn.modes.fused.driver`) queues. A unit queues work itself only where a mechanism
must (a shard queued again while it waits: :class:`QueueShard`), through the same driver
(:class:`Wires`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tensorturn.modes.fused.ahead import ReadAhead
    from tensorturn.spec import RunSpec
    from tensorturn.state.board import RunBoard
    from tensorturn.store.objects import Store
    from tensorturn.tasks.attempt import Attempt, Unit

NOT_YET_S = 3.0  # a shard that stopped waiting for what it starts from is queued again this much later


@dataclass(frozen=True)
class ShardPlan:
    """How shard k of round r trains (a policy's :meth:`~.sync.base.SyncPolicy.shard_plan`)."""

    base: int  # the round whose global weights θ_base it trains from
    own_start: bool = False  # from θ_base minus its own output of round r−1 (:func:`.uploads.start_from_own`)
    background: bool = False  # its output uploaded in a thread under a lease; the task ends first
    copies: bool = False  # backup copies may store it first: it looks, and stops
    standby: bool = False  # queued ahead of θ_base: waits for it, maybe steps (:mod:`.standby`)


@dataclass(frozen=True)
class StepPlan:
    """How round r's outer step gathers its inputs (:meth:`~.sync.base.SyncPolicy.step_plan`)."""

    uploads: bool = False  # wait while the outputs upload; a lost one is trained again (:mod:`.uploads`)


@dataclass(frozen=True)
class Context:
    """The run a policy decides for: its spec, store and board (what Flower's ClientManager is
    to a strategy: the claims it reads, as ``note_stored``'s count)."""

    spec: RunSpec
    store: Store
    board: RunBoard


@dataclass(frozen=True)
class ShardDone:
    """A shard task of round r on ``worker`` is done, shard k stored (now, or before); ``here``:
    its attempt, in whose task what follows may run."""

    r: int
    k: int
    worker: str
    here: Attempt | None = None


@dataclass(frozen=True)
class StepDone:
    """Round r's outer step ended (θ_{r+1} stored, unless it stopped short)."""

    r: int


# ---- the work a policy returns ------------------------------------------------------------------

@dataclass(frozen=True)
class QueueRound:
    """Queue round r's slots once (``again``: on a resume, whoever queued it before)."""

    r: int
    again: bool = False


@dataclass(frozen=True)
class QueueShard:
    """Queue shard k of round r as a named shard task, in ``countdown`` seconds."""

    r: int
    k: int
    countdown: float = 0.0


@dataclass(frozen=True)
class QueueStep:
    """Round r's outer step, once: taken in ``here``'s task where it can, else queued."""

    r: int
    here: Attempt | None = None


@dataclass(frozen=True)
class SendStep:
    """Round r's outer step as a message, whoever holds its claim (it failed where it ran)."""

    r: int


@dataclass(frozen=True)
class HandOver:
    """Round r's step goes to a slot of round r+1: queue that round ahead (its first slot
    steps), else take the step in ``here`` if nobody claimed it, else wake the slot standing by."""

    r: int
    here: Attempt | None = None


@dataclass(frozen=True)
class QueueEval:
    """Queue the evaluation of round r's weights θ_{r+1}, once (none where ``--eval-every``
    skips the round)."""

    r: int


@dataclass(frozen=True)
class AnnounceGlobal:
    """θ_r is stored: wake the slots queued ahead that wait for it."""

    r: int


@dataclass(frozen=True)
class BackupCopy:
    """Round r has no shard left to hand out: ``worker`` may train a copy of a straggler."""

    r: int
    worker: str


@dataclass(frozen=True)
class QueueUpdates:
    """Queue asynchronous updates ``updates`` (``--sync async``)."""

    updates: tuple[int, ...]


Work = (QueueRound | QueueShard | QueueStep | SendStep | HandOver | QueueEval | AnnounceGlobal | BackupCopy
        | QueueUpdates)


class Wires(Protocol):
    """What the driver hands a unit: where its results go, how it queues work a mechanism needs,
    and how a slot builds the outer step it takes in its own task."""

    def follow(self, done: ShardDone | StepDone) -> None:
        """Hand the result to the run's policy and queue what it says follows."""

    def queue(self, works: Sequence[Work]) -> None:
        """Queue ``works`` (no policy asked)."""

    def outer_unit(self, deferred: list[Callable[[], None]] | None = None,
                   ahead: ReadAhead | None = None) -> Callable[[Attempt], Unit]:
        """Round r's outer step as a unit (its label says r), for a slot that takes it in place."""
