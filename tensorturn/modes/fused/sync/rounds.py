"""``--sync rounds`` (the default): a barrier per round, as DiLoCo's.

A round is a Celery chord: header = one task per shard — a *slot*, bound to a shard by the first
worker that runs it, which takes a shard it trained before where it can (its chunks are cached
there) — body = the outer step (:class:`~tensorturn.modes.fused.outer.OuterUnit`), which queues
the next round once θ_{r+1} is stored. The result depends on (S, H, seed, threads) only: the same
weights on 1 or N machines.

The round's Celery tasks are defined here; ``--sync backup`` (:mod:`.backup`) queues the same.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import chord

from tensorturn import layout
from tensorturn.modes.fused.options import options
from tensorturn.modes.fused.outer import OuterUnit
from tensorturn.modes.fused.shard import ShardUnit
from tensorturn.modes.fused.sync.base import SyncPolicy
from tensorturn.pool import routing
from tensorturn.pool.capacity import queue_for
from tensorturn.pool.celery_app import app, forget_results
from tensorturn.recipes import recipe_of
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.manifest import load_spec, try_write_manifest
from tensorturn.store import seals
from tensorturn.store.objects import Store
from tensorturn.tasks.attempt import agent_store, authentic, board_for, execute, signed

log = logging.getLogger(__name__)

CHORD_REQUEUES = 3  # times a round is queued again because Celery could not run its outer step


class Rounds(SyncPolicy):
    """A chord per round; the outer step of round r queues round r+1."""

    name = "rounds"

    def start(self, spec: RunSpec, store: Store, board: RunBoard) -> None:
        board.claim(spec.run_id, layout.dispatch_claim(0))
        dispatch_round(spec, 0, board)

    def resume(self, spec: RunSpec, store: Store, board: RunBoard) -> str:
        """Continue from the last round whose global weights are in the store."""
        r, rounds = last_stored_round(spec, store, board), options(spec).rounds
        board.round_log.reset_requeues(spec.run_id)  # each round's errback gets its 3 again
        board.claim(spec.run_id, layout.dispatch_claim(r))
        dispatch_round(spec, r, board)
        return f"resumed at round {r} of 0..{rounds - 1}"

    def after_outer(self, spec: RunSpec, board: RunBoard, r: int) -> None:
        if r + 1 < options(spec).rounds:
            board.once(spec.run_id, layout.dispatch_claim(r + 1), lambda: dispatch_round(spec, r + 1, board))


def last_stored_round(spec: RunSpec, store: Store, board: RunBoard) -> int:
    """For a resume: the last round whose global weights θ_r are stored (the last round itself
    when every round is: its outer step finalizes again), the records of the rounds before it
    rebuilt on the board from the store (a broker may have forgotten them)."""
    stored = [layout.parse("global", key) for key in store.list(layout.prefix("global", spec.run_id))]
    r = max((parts["round"] for parts in stored if parts), default=0)
    for past in range(r):
        if store.exists(layout.key("round", spec.run_id, past)):
            board.record_round(spec.run_id, past, seals.get_json(store, layout.key("round", spec.run_id, past)))
    return min(r, options(spec).rounds - 1)


def dispatch_round(spec: RunSpec, r: int, board: RunBoard) -> None:
    """Queue round r: a slot per shard, then the outer step, on machines that can hold the model
    — the outer step beside the store while an agent there serves it (:mod:`tensorturn.pool.routing`).
    A slot trains the shard its first worker claims (:meth:`RunBoard.claim_shard`): one it
    trained before where it can, so its cached chunks are read again rather than downloaded."""
    queue = queue_for(spec.memory_needed_bytes)
    run_id = spec.run_id
    header = [train_slot.s(run_id, r, i, **signed(run_id, str(layout.slot_label(r, i)))).set(queue=queue)
              for i in range(options(spec).shards)]
    body = outer_step.s(run_id, r, **signed(run_id, str(layout.outer_label(r)))).set(
        queue=routing.queue_for_outer(board.r, queue))
    what = f"the outer step of round {r}"
    body.on_error(chord_failed.s(run_id, what, r=r, **signed(run_id, chord_failed_label(r, what))))
    result = chord(header)(body)
    forget_results([*result.parent.results, result])


def chord_failed_label(r: int, what: str) -> str:
    """What an errback's signature covers: everything its handler acts on (the round, and the
    words it records)."""
    return f"chord_failed:r{r}:{what}"


# ---- the round's tasks -------------------------------------------------------------------------

@app.task(bind=True, name="tensorturn.fused.train_slot", max_retries=None)
def train_slot(self: Any, run_id: str, r: int, i: int, sig: str | None = None) -> dict[str, Any]:
    """What a round queues: train the shard slot i of round r is bound to (claimed on its first
    delivery, preferring a shard whose data this machine holds)."""
    def claim(board: RunBoard, spec: RunSpec, worker: str) -> layout.Label:
        shards = options(spec).shards
        try:
            held = recipe_of(spec).cached_shards(shards)
        except Exception:  # noqa: BLE001 - the shard's own attempt meets it again, and records it
            held = []
        return layout.shard_label(r, board.claim_shard(run_id, r, i, worker, shards, held))

    return execute(self, run_id, layout.slot_label(r, i), ShardUnit, sig, resolve=claim)


@app.task(bind=True, name="tensorturn.fused.train_shard", max_retries=None)
def train_shard(self: Any, run_id: str, r: int, k: int, sig: str | None = None) -> dict[str, Any]:
    """Train shard k for one round from θ_r and upload its pseudo-gradient (a named shard: what
    a slot becomes once bound; rounds queue slots)."""
    return execute(self, run_id, layout.shard_label(r, k), ShardUnit, sig)


@app.task(bind=True, name="tensorturn.fused.outer_step", max_retries=None)
def outer_step(self: Any, _receipts: list, run_id: str, r: int, sig: str | None = None) -> dict[str, Any]:
    """Chord body: average round r's pseudo-gradients, step θ, then dispatch r+1 or finish."""
    return execute(self, run_id, layout.outer_label(r), OuterUnit, sig)


@app.task(bind=True, name="tensorturn.tasks.chord_failed")
def chord_failed(self: Any, *args: Any, sig: str | None = None, r: Any = None) -> None:
    """Errback of round r's chord: Celery could not run its body (a header task raised past the
    attempt protocol, or the chord's counter broke). The round is queued again rather than the
    run failed: what of it is stored counts (those units are done), and a unit that really
    fails fails the run through its own attempts, with its own reason.

    The signed errback sits in every queued slot message, where anyone with the broker's
    password can read it and send it again. So it acts only on the round it was made for while
    the run is still in that round, and at most CHORD_REQUEUES times: a replay costs a round's
    messages. Past that the run fails — a chord that never runs must end in a recorded state —
    and `resume` continues it (a broker holder can get there too, as by replaying task
    messages: a denial of service, never a changed result).

    Celery calls an errback either as a task with the failed task's id first (``task_id,
    run_id, what``) or in place with ``request, exc, traceback`` first, depending on its version
    and the errback's signature: the last two arguments are ours either way."""
    run_id, what = args[-2], args[-1]
    if not isinstance(r, int) or not isinstance(what, str):
        r, what = -1, str(what)  # refused just below: no signature covers these
    if not authentic(self, run_id, chord_failed_label(r, what), sig):
        return
    first = args[0]
    task_id = first if isinstance(first, str) else getattr(first, "id", "?")
    board = board_for(app.conf.broker_url)
    store = agent_store()
    spec = load_spec(store, run_id)
    if (board.is_finished(run_id) or board.has_round(run_id, r) or r >= options(spec).rounds
            or store.exists(layout.key("global", run_id, r + 1))):
        # the round went on after all (or this is a replayed message): nothing failed
        log.warning("run %s: ignored a chord error for %s: the round is past", run_id, what)
        return
    worker = self.request.hostname or "?"
    times = board.round_log.requeued(run_id, r)
    if times > CHORD_REQUEUES:  # a failure every time: the run ends, in a state that says so
        board.fail(run_id, f"{what} could not run {times} times: a task of it failed outside "
                           f"TensorTurn's handling (Celery task {task_id}); see the agents' logs, "
                           f"then `tensorturn resume {run_id}`")
        try_write_manifest(store, board, run_id)
        return
    board.incident(run_id, "chord_failed", str(layout.outer_label(r)), worker,
                   f"{what} could not run (Celery task {task_id}): round {r} queued again "
                   f"({times} of {CHORD_REQUEUES}); its stored shards are kept")
    board.claim(run_id, layout.dispatch_claim(r))
    dispatch_round(spec, r, board)
