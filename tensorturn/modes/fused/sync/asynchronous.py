"""``--sync async``: no round barrier — the policy (what a run queues when it starts and
when it resumes).

A run of R rounds × S shards queues R·S *updates* at once (label ``u<j>``: shard j mod S, the
seed of round j div S — the synchronous run's work, the same samples). Each worker trains its
update from the **latest** weights it can get, stores the pseudo-gradient, and queues it to be
applied (:class:`~tensorturn.state.ledger.AsyncLedger`). Whoever holds the apply lock applies the
stored updates one at a time, in arrival order, so a fast machine never waits for a slow one.
Every S versions the weights are evaluated and recorded as a round; at R·S the run finishes like
a synchronous one. The mechanisms are the fused mode's: the updates' tasks
(:mod:`tensorturn.modes.fused.update`), the applier (:mod:`tensorturn.modes.fused.async_apply`)
and the versions of the weights (:mod:`tensorturn.modes.fused.async_versions`).

What it gives up: the result depends on timing — which version each update started from (its
*staleness*, recorded for every update) — so two runs with the same seed differ. ``--sync rounds``
stays the default and keeps its guarantee (the same weights on 1 or N machines).
"""

from __future__ import annotations

from tensorturn import layout
from tensorturn.modes.fused.async_versions import ledger, read_log, total_updates
from tensorturn.modes.fused.options import options
from tensorturn.modes.fused.plans import Context, QueueUpdates, Work
from tensorturn.modes.fused.sync.base import SyncPolicy
from tensorturn.store import seals


class Async(SyncPolicy):
    """No barrier: every update queued at once, applied as it arrives."""

    name = "async"

    def start(self, run: Context) -> list[Work]:
        """Version 0 is θ_0 (stored by the fused start); queue every update."""
        spec = run.spec
        ledger(run.board, spec.run_id).init(layout.key("global", spec.run_id, 0), options(spec).init_sha256)
        return [QueueUpdates(tuple(range(total_updates(spec))))]

    def resume(self, run: Context) -> tuple[list[Work], str]:
        """Rebuild the ledger from the store's log (the versions committed, in order), then queue
        every update not applied yet (those already stored are applied without training again)."""
        spec, store, board = run.spec, run.store, run.board
        latest, versions, applied = read_log(spec, store)
        book = ledger(board, spec.run_id)
        book.restore(latest, versions, applied)
        for key in store.list(layout.prefix("round", spec.run_id)):
            parts = layout.parse("round", key)
            if parts and (parts["round"] + 1) * options(spec).shards <= latest["version"]:
                board.record_round(spec.run_id, parts["round"], seals.get_json(store, key))
        left = [j for j in range(total_updates(spec)) if j not in applied]
        # none left: one task finishes the run
        return ([QueueUpdates(tuple(left or [total_updates(spec) - 1]))],
                f"resumed asynchronously at version {latest['version']} of {total_updates(spec)}")
