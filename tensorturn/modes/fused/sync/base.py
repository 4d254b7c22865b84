"""What a sync policy is: the decisions where fused runs differ in how their shards meet, as
data in and data out (Flower's ``Strategy``: ``configure_fit`` says what each client trains,
``aggregate_fit`` what follows the results; a client never calls back into the strategy).

The fused start (θ_0, the spec, the board), the shard's training and the outer step are the same
for every policy (:mod:`~tensorturn.modes.fused.shard`, :mod:`~tensorturn.modes.fused.outer`);
a policy plans them (:meth:`SyncPolicy.shard_plan`, :meth:`SyncPolicy.step_plan`) and answers
each stored output and each outer step with the work that follows (:meth:`SyncPolicy.on_output`,
:meth:`SyncPolicy.on_step`), which the driver (:mod:`~tensorturn.modes.fused.driver`) queues.
"""

from __future__ import annotations

from tensorturn.modes.fused.plans import Context, ShardDone, ShardPlan, StepDone, StepPlan, Work


class SyncPolicy:
    """One way for a fused run's shards to meet. ``start`` and ``resume`` are required; the
    others default to a round that trains from θ_r, uploads at once, steps once its outputs are
    stored, and has nothing follow."""

    name = ""

    def start(self, run: Context) -> list[Work]:
        """The run's first work (θ_0 and the spec are stored, the run is on the board)."""
        raise NotImplementedError

    def resume(self, run: Context) -> tuple[list[Work], str]:
        """Whatever is missing from the store, to queue, and what was resumed."""
        raise NotImplementedError

    def shard_plan(self, r: int, k: int) -> ShardPlan:
        """How shard k of round r trains: from θ_r unless the policy overlaps rounds."""
        return ShardPlan(base=r)

    def step_plan(self, r: int) -> StepPlan:
        """How round r's outer step gathers its inputs: stored before it is queued."""
        return StepPlan()

    def on_output(self, run: Context, done: ShardDone) -> list[Work]:
        """A shard task is done, its shard stored (now, or before): what follows."""
        return []

    def on_step(self, run: Context, done: StepDone) -> list[Work]:
        """Round r's outer step ended (θ_{r+1} stored, or it stopped short): what follows."""
        return []
