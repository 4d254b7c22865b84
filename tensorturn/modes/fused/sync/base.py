"""What a sync policy is: the hooks where fused runs differ in how their shards meet (in the
manner of Flower's strategies, or torchft's ``_perform_sync`` subclasses).

The fused start (θ_0, the spec, the board) and the shard's training are the same for every
policy; a policy queues the work (:meth:`SyncPolicy.start`, :meth:`SyncPolicy.resume`) and hears
of a round's shard stored and of an outer step taken. A hook it does not need is left to the
base class, which does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tensorturn.store import seals

if TYPE_CHECKING:
    from tensorturn.spec import RunSpec
    from tensorturn.state.board import RunBoard
    from tensorturn.store.objects import Store
    from tensorturn.store.tensors import StateDict
    from tensorturn.tasks.attempt import Attempt, Unit


class SyncPolicy:
    """One way for a fused run's shards to meet. ``start`` and ``resume`` are required; the
    other hooks run inside a round's tasks (:class:`~tensorturn.modes.fused.shard.ShardUnit`,
    :class:`~tensorturn.modes.fused.outer.OuterUnit`) and may do nothing."""

    name = ""

    def start(self, spec: RunSpec, store: Store, board: RunBoard) -> None:
        """Queue the run's first work (θ_0 and the spec are stored, the run is on the board)."""
        raise NotImplementedError

    def resume(self, spec: RunSpec, store: Store, board: RunBoard) -> str:
        """Queue whatever is missing from the store; say what was resumed."""
        raise NotImplementedError

    def base_round(self, r: int) -> int:
        """The round whose global weights round r's shards train from: r (θ_r) unless the
        policy overlaps rounds."""
        return r

    def await_global(self, unit: Unit, r: int) -> None:
        """Before a shard of round r fetches θ_r: wait while θ_r is still being stepped, when
        the policy queues a round's shards ahead of its weights (``NotYet`` when they will not
        come soon: the shard is queued again)."""

    def output_in_flight(self, board: RunBoard, spec: RunSpec, r: int, k: int) -> bool:
        """Whether shard k of round r's output is on its way to the store (then it is done)."""
        return False

    def shard_start(self, unit: Unit, r: int, k: int, theta: StateDict) -> tuple[StateDict, int]:
        """The weights shard k of round r trains from, given its base round's global weights
        ``theta`` (not to be changed: it is cached), and the bytes that took to download."""
        return theta, 0

    def store_output(self, unit: Unit, r: int, k: int, key: str, path: Path) -> None:
        """Store shard k of round r's pseudo-gradient, written at ``path``, at ``key``; stored
        when this returns, unless the policy uploads in the background."""
        seals.put_file(unit.store, key, path)

    def await_round(self, unit: Unit, r: int) -> str | None:
        """Before round r's outer step averages: None once every shard's output is stored, else
        why the outer step ends without stepping (it is queued again when they are)."""
        return None

    def shard_watch(self, board: RunBoard, spec: RunSpec, r: int, k: int) -> Callable[[], bool] | None:
        """A look (one Redis call) whether another copy stored shard k of round r already: the
        training stops when it says so. None: this policy makes no copies."""
        return None

    def shard_stored(self, board: RunBoard, spec: RunSpec, r: int, k: int, worker: str) -> None:
        """Shard k of round r was stored by ``worker`` (this attempt's output counts)."""

    def after_shard(self, spec: RunSpec, store: Store, board: RunBoard, r: int, k: int,
                    worker: str, here: Attempt | None = None) -> None:
        """A shard task of round r on ``worker`` is done, shard k stored (now, or before): what
        follows — run in that task (``here``, its attempt) where the policy can, else queued."""

    def after_outer(self, spec: RunSpec, board: RunBoard, r: int) -> None:
        """Round r's new weights are stored: queue what follows (the next round)."""
