"""A shard's training: train shard k with its round's seed from the global weights, and store
its pseudo-gradient — once, never over one stored already.

The same for every sync policy: a round's shard (:class:`ShardUnit`) and an asynchronous update
both train through :func:`train_and_store`. The unit is given its :class:`~.plans.ShardPlan` —
which weights it starts from, whether it uploads in the background or may be beaten by a copy —
and hands its result to the driver (:meth:`~.plans.Wires.follow`); it never asks the policy.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tensorturn import layout
from tensorturn.data.source import machine_cache
from tensorturn.modes.fused import backups, standby, uploads
from tensorturn.modes.fused.options import options
from tensorturn.modes.fused.plans import ShardDone, ShardPlan, Wires
from tensorturn.modes.fused.weights import ahead, fetch_global
from tensorturn.pool.telemetry import TaskReporter
from tensorturn.recipes import Recipe, recipe_of
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.clock import broker_now
from tensorturn.state.live import live_field
from tensorturn.store import seals
from tensorturn.store.tensorfile import write_delta
from tensorturn.store.tensors import StateDict
from tensorturn.tasks.attempt import LATE, SUCCEEDED, Attempt, Unit, watch_cancelled
from tensorturn.train.device import pick_device
from tensorturn.train.diloco import UpdateRejected, check_update, train_replica
from tensorturn.train.loop import derive_seed, set_threads

log = logging.getLogger(__name__)

BACKUP_LOOK_S = 0.05  # how often (at most) a copy of a unit looks whether another stored it first


class ShardUnit(backups.CopyAwareUnit):
    """Shard k of round r (a named shard, a slot once bound, or a backup copy), trained as its
    ``plan`` says: done once its pseudo-gradient, or θ_{r+1}, is stored (or, uploaded in the
    background, on its way)."""

    #: what an outer step taken by this slot while it waited for θ (:func:`~tensorturn.modes.
    #: fused.standby.take_step`) left for later — the round's record, its scratch folder's
    #: removal — done after the shard's first step (:func:`after_first_step`), when the other
    #: machines train already
    deferred: list[Callable[[], None]]

    def __init__(self, attempt: Attempt, plan: ShardPlan, wires: Wires):
        super().__init__(attempt)
        self.plan, self.wires = plan, wires
        self.deferred = []

    def done(self) -> bool:
        r, k = self.a.label.numbers
        return (self.store.exists(layout.key("shard", self.spec.run_id, r, k))
                or self.store.exists(layout.key("global", self.spec.run_id, r + 1))
                or (self.plan.background and uploads.in_flight(self.board, self.spec, r, k)))

    def run(self) -> str:
        r, k = self.a.label.numbers
        spec, plan = self.spec, self.plan

        def theta_of(recipe: Recipe) -> tuple[StateDict, int, dict[str, str]]:
            prefetch_next(spec, recipe, self.board, r, self.a.worker)
            if plan.standby:
                standby.await_base(self, plan.base)
            theta, moved = fetch_global(spec, recipe, self.store, plan.base)
            if plan.base < r and r + 1 < options(spec).rounds and options(spec).down_codec != "fp32":
                # overlapped: this machine's next task starts from θ_{base+1}, which the outer
                # step makes while this one trains — its broadcast is read meanwhile
                board, worker = self.board, self.a.worker
                ahead.start(self.store, layout.key("broadcast", spec.run_id, plan.base + 1),
                            lambda n: board.traffic.add_store_bytes(spec.run_id, 0, n, worker))
            start, more = uploads.start_from_own(self, self.wires, r, k, theta) if plan.own_start else (theta, 0)
            return start, moved + more, {}

        watch = (lambda: self.board.claims.is_stored(spec.run_id, r, k)) if plan.copies else None
        put = ((lambda key, path: uploads.upload_in_background(self, self.wires, r, k, key, path))
               if plan.background else None)
        try:
            outcome = train_and_store(self, r, k, theta_of, layout.key("shard", spec.run_id, r, k), watch, put)
            if outcome == SUCCEEDED and plan.copies:
                # other copies stop at their next look; the round's timing is noted here if first
                self.board.claims.note_stored(spec.run_id, r, k, self.a.worker, options(spec).shards)
        finally:
            self.run_deferred()  # (done at the first step, unless the shard took none or failed first)
        return outcome

    def then(self) -> None:
        r, k = self.a.label.numbers
        self.wires.follow(ShardDone(r, k, self.a.worker, here=self.a))

    def run_deferred(self) -> None:
        """Do what was left for later (:attr:`deferred`); a failure is only logged: the run's
        last outer step records a round whose record is missing."""
        work, self.deferred = self.deferred, []
        for do in work:
            try:
                do()
            except Exception as exc:  # noqa: BLE001 - a record the last outer step writes again
                log.warning("run %s: %s: deferred work failed (%s)", self.spec.run_id, self.a.label, exc)


def train_and_store(unit: Unit, r: int, k: int,
                    theta_of: Callable[[Recipe], tuple[StateDict, int, dict[str, str]]],
                    out_key: str, watch: Callable[[], bool] | None = None,
                    put: Callable[[str, Path], None] | None = None) -> str:
    """Train shard k with round r's seed from the weights ``theta_of(recipe)`` gives (θ, bytes
    downloaded, metadata to store with the output), and store the pseudo-gradient at
    ``out_key`` — never over one stored already — with ``put(key, file)`` (default: upload it
    now). With ``watch`` (does another copy's output exist?) the training stops as soon as
    another copy stored it. Returns SUCCEEDED, or LATE when another copy or attempt stored it
    first."""
    spec, opts, a = unit.spec, options(unit.spec), unit.a
    set_threads(spec.threads_per_task)
    recipe = recipe_of(spec)
    batch = spec.batch_for(recipe)
    reporter = TaskReporter(a.task, unit.board.r, str(a.label), opts.sync_every, batch,
                            live=(spec.run_id, live_field(a.label, opts.shards or 0)))
    data_before = data_bytes()
    x, y, rows = recipe.shard_data(k, opts.shards, spec.seed)
    count_data(unit.board, spec.run_id, a.worker, data_before)
    theta, a.bytes_down, meta = theta_of(recipe)
    on_step = reporter if watch is None else watch_superseded(reporter, watch, str(a.label))
    on_step = watch_cancelled(on_step, a, reporter)
    if isinstance(unit, ShardUnit) and unit.deferred:  # an outer step taken while it waited for θ
        on_step = after_first_step(on_step, unit.run_deferred)
    on_step = clock = StepClock(on_step)
    a.trained_from = broker_now(unit.board.r)
    t0 = time.perf_counter()
    try:
        delta, loss, samples = train_replica(
            recipe, theta, x, y, rows, opts.sync_every,
            spec.lr or recipe.lr, batch, derive_seed(spec.seed, r, k), pick_device(),
            on_step=on_step, precision=spec.precision, accumulate=spec.accumulate)
        a.trained_s = time.perf_counter() - t0
        a.step = (spec.recipe, clock.step_s(a.trained_s / max(opts.sync_every, 1)))  # published with the attempt's end
        check_update(delta, theta, opts.max_update_ratio)
    except Superseded:
        unit.board.incidents.add(spec.run_id, "superseded", str(a.label), a.worker,
                                 "another copy stored its output first; this one stopped")
        return LATE
    except UpdateRejected as exc:  # recorded apart: the unit is trained again
        unit.board.incidents.add(spec.run_id, "update_rejected", str(a.label), a.worker, str(exc))
        raise
    if unit.store.exists(out_key):  # never overwrite: it may be in use already
        return LATE
    if not reporter.read_at_end:  # else the last step's report read the run's state, just now
        a.check_cancelled(now=True)
    with tempfile.TemporaryDirectory(prefix="tt-shard-") as tmp:
        # written to a file and uploaded from it (S3: in parts), so the model is never in
        # memory twice; bytes_down is written at a fixed width: it depends on where the shard
        # ran (what that machine held), and the upload's size must not
        path = Path(tmp) / "delta"
        write_delta(path, delta, opts.codec, {"samples": str(samples), "loss": repr(loss), **meta,
                                              "bytes_down": f"{a.bytes_down:015d}"})
        del delta
        a.bytes_up = path.stat().st_size
        if put is None:
            seals.put_file(unit.store, out_key, path)
        else:
            put(out_key, path)
    a.rate = reporter.done()
    return SUCCEEDED


def after_first_step(on_step: Callable[[int, float], None], work: Callable[[], None]) -> Callable[[int, float], None]:
    """``on_step``, and ``work`` done once, after the first step: the machines that waited
    train already, and what this one records is among its attempt's figures."""
    pending = [work]

    def step(n: int, loss: float) -> None:
        on_step(n, loss)
        if pending:
            pending.pop()()

    return step


class StepClock:
    """``on_step``, and the time of each step's end: a step's seconds for plans are the steps
    after the first two — the first also builds the optimizer's state, and work that waited for
    it (:func:`after_first_step`) runs before the second — as θ_0's timing leaves out its
    warm-up (:func:`~tensorturn.modes.fused.timing.time_step`)."""

    def __init__(self, on_step: Callable[[int, float], None]):
        self.inner = on_step
        self.ends: list[float] = []

    def __call__(self, n: int, loss: float) -> None:
        self.ends.append(time.perf_counter())
        self.inner(n, loss)

    def step_s(self, whole: float) -> float:
        """Seconds a step after the first two; ``whole`` (the training's seconds ÷ its steps)
        where there were too few to tell."""
        if len(self.ends) < 4:
            return whole
        return (self.ends[-1] - self.ends[1]) / (len(self.ends) - 2)


class Superseded(Exception):
    """Another copy of this shard stored it first: the rest of this copy's training is moot."""


def watch_superseded(on_step: Callable[[int, float], None], stored: Callable[[], bool],
                     what: str) -> Callable[[int, float], None]:
    """``on_step``, and every BACKUP_LOOK_S a look (``stored``: one Redis call) whether another
    copy of the unit stored it already: then :class:`Superseded` stops the training there."""
    last = [time.monotonic()]

    def step(n: int, loss: float) -> None:
        on_step(n, loss)
        now = time.monotonic()
        if now - last[0] >= BACKUP_LOOK_S:
            last[0] = now
            if stored():
                raise Superseded(f"{what} was stored by another copy")

    return step


# ---- the data a machine reads ------------------------------------------------------------------

def data_bytes() -> tuple[int, int]:
    """(downloaded, read): dataset bytes this thread has downloaded so far, and read from its
    cache (pushed datasets only)."""
    if machine_cache.cache_info().currsize == 0:  # no dataset read in this process yet
        return 0, 0
    return machine_cache().thread_bytes()


def count_data(board: RunBoard, run_id: str, worker: str, before: tuple[int, int]) -> None:
    """Add what this thread downloaded and read since ``before`` to the worker's figures."""
    now = data_bytes()
    board.traffic.add_data_bytes(run_id, worker, now[0] - before[0], now[1] - before[1])


def next_shard_here(board: RunBoard, spec: RunSpec, r: int, worker: str) -> int | None:
    """The shard this worker will most likely train next in round r: its next own shard not yet
    claimed. (Not the next round's: an outer step's evaluation, or a thief, would often take its
    place in the cache first.)"""
    shards = options(spec).shards
    left = set(board.claims.unclaimed_shards(spec.run_id, r, shards))
    mine = sorted(s for s, w in board.claims.shard_owners(spec.run_id).items() if w == worker and s in left)
    return mine[0] if mine else None


def prefetch_next(spec: RunSpec, recipe: Recipe, board: RunBoard, r: int, worker: str) -> None:
    """Download the chunks of this worker's next shard in a thread while this one trains; its
    bytes count as this worker's. A failure here is only logged: the task that reads the chunks
    reports it."""
    if type(recipe).prefetch is Recipe.prefetch:  # data in memory: nothing to fetch
        return
    nxt = next_shard_here(board, spec, r, worker)
    if nxt is None:
        return

    def fetch() -> None:
        try:
            before = data_bytes()
            recipe.prefetch(nxt, options(spec).shards)
            count_data(board, spec.run_id, worker, before)
        except Exception as exc:  # noqa: BLE001 - only an optimisation
            log.info("run %s: prefetching shard %d failed (%s)", spec.run_id, nxt, exc)

    threading.Thread(target=fetch, name=f"prefetch-{spec.run_id}-{nxt}", daemon=True).start()
