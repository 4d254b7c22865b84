"""``--sync backup``: rounds (:mod:`.rounds`), plus backup copies of a round's stragglers.

When a round has no shard left to hand out but some still training, a machine that finishes
queues for itself a copy of the straggler it would beat by most (:mod:`..backups`). The copies
train the same shard from the same θ and seed, so the first one stored is the round's, whichever
it is: the result is the same as ``--sync rounds``'s. A copy still training stops at its next
look once the shard is stored (``stored-r<r>``, :meth:`~tensorturn.state.claims.Claims.note_stored`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from tensorturn import layout
from tensorturn.modes.fused import backups
from tensorturn.modes.fused.options import options
from tensorturn.modes.fused.shard import ShardUnit
from tensorturn.modes.fused.sync.rounds import Rounds
from tensorturn.pool.celery_app import app
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.store.objects import Store
from tensorturn.tasks.attempt import Attempt, execute

log = logging.getLogger(__name__)


class Backup(Rounds):
    """Rounds whose stragglers get backup copies."""

    queues_ahead = False  # the next round's slots would sit ahead of a straggler's backup copy

    name = "backup"

    def shard_watch(self, board: RunBoard, spec: RunSpec, r: int, k: int) -> Callable[[], bool] | None:
        return lambda: board.claims.is_stored(spec.run_id, r, k)

    def shard_stored(self, board: RunBoard, spec: RunSpec, r: int, k: int, worker: str) -> None:
        # other copies stop at their next look; the round's timing is noted here if first
        board.claims.note_stored(spec.run_id, r, k, worker, options(spec).shards)

    def after_shard(self, spec: RunSpec, store: Store, board: RunBoard, r: int, k: int,
                    worker: str, here: Attempt | None = None) -> None:
        super().after_shard(spec, store, board, r, k, worker, here)  # the round's last steps
        try:  # only an optimisation: a failure here must not fail a shard that is done
            queue_shard_backup(spec, store, board, r, worker)
        except Exception as exc:  # noqa: BLE001
            log.warning("run %s: no backup copy queued (%s)", spec.run_id, exc)


def queue_shard_backup(spec: RunSpec, store: Store, board: RunBoard, r: int, worker: str) -> None:
    """When round r has no shard left to hand out but some still training, queue a backup copy
    of a straggler (:func:`~..backups.queue_backup`)."""
    run_id = spec.run_id
    if board.unclaimed_shards(run_id, r, options(spec).shards) or store.exists(layout.key("global", run_id, r + 1)):
        return
    stored = board.claims.stored(run_id, r)

    def straggler(named: layout.Label) -> int | None:
        if named.kind == "shard" and named.round == r and named.shard is not None and named.shard not in stored:
            return named.shard
        return None

    backups.queue_backup(
        spec, board, worker, backups.running(board, run_id, straggler),
        claim=lambda k: layout.backup_claim(r, k), label=lambda k: layout.backup_label(r, k),
        task=train_backup, args=lambda k: (run_id, r, k),
        why=lambda k: f"round {r} waits for shard {k}: {worker} trains a backup copy, by its rate sooner")


@app.task(bind=True, name="tensorturn.fused.train_backup", max_retries=None)
def train_backup(self: Any, run_id: str, r: int, k: int, sig: str | None = None) -> dict[str, Any]:
    """A backup copy of shard k of round r: whichever copy stores the shard first counts, the
    other stops at its next look (:class:`~..shard.Superseded`) or is discarded as late."""
    return execute(self, run_id, layout.backup_label(r, k), ShardUnit, sig)
