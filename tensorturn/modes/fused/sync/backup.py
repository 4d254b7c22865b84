"""``--sync backup``: rounds (:mod:`.rounds`), plus backup copies of a round's stragglers.

When a round has no shard left to hand out but some still training, a machine that finishes
queues for itself a copy of the straggler it would beat by most (:mod:`..backups`). The copies
train the same shard from the same θ and seed, so the first one stored is the round's, whichever
it is: the result is the same as ``--sync rounds``'s. A copy still training stops at its next
look once the shard is stored (``stored-r<r>``, :meth:`~tensorturn.state.claims.Claims.note_stored`).
"""

from __future__ import annotations

from tensorturn.modes.fused.plans import BackupCopy, Context, ShardDone, ShardPlan, Work
from tensorturn.modes.fused.sync.rounds import Rounds


class Backup(Rounds):
    """Rounds whose stragglers get backup copies."""

    queues_ahead = False  # the next round's slots would sit ahead of a straggler's backup copy

    name = "backup"

    def shard_plan(self, r: int, k: int) -> ShardPlan:
        return ShardPlan(base=r, standby=True, copies=True)

    def on_output(self, run: Context, done: ShardDone) -> list[Work]:
        # the round's last steps, then a copy of a straggler (queued only as an optimisation)
        return [*super().on_output(run, done), BackupCopy(done.r, done.worker)]
