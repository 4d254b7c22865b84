"""Fused mode's Celery tasks: train a shard, take the outer step; and starting/resuming a run.

Both tasks run through the attempt protocol (:func:`tensorturn.tasks.attempt.execute`); their
units say when their output exists, how to make it, and what follows.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from celery import chord

from tensorturn import layout
from tensorturn.modes.fused import EPOCHS_PER_ROUND_WARNING, FusedOptions, StartedOptions, backups
from tensorturn.pool import routing
from tensorturn.pool.capacity import queue_for
from tensorturn.pool.celery_app import app, forget_results
from tensorturn.pool.telemetry import TaskReporter
from tensorturn.recipes import Recipe, recipe_of, resolve
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.live import live_field
from tensorturn.state.manifest import load_spec, save_spec, try_write_manifest, write_manifest
from tensorturn.store import seals
from tensorturn.store.objects import ObjectMissing, Store, sha256_hex
from tensorturn.store.tensorfile import DTYPES, TensorReader, TensorWriter, delta_tensors, write_delta
from tensorturn.store.tensors import (
    BROADCAST_FORMAT,
    StateDict,
    delta_from_bytes,
    float_keys,
    from_bytes,
    is_finite,
    metadata_of,
    model_bytes,
    model_metadata,
    stored_metadata,
    to_bytes,
)
from tensorturn.tasks.attempt import (
    LATE,
    SUCCEEDED,
    Unit,
    agent_store,
    authentic,
    board_for,
    execute,
    signed,
    watch_cancelled,
)
from tensorturn.train.device import pick_device
from tensorturn.train.diloco import (
    UpdateRejected,
    accumulate,
    apply_step,
    check_norm,
    check_samples,
    check_update,
    compress_broadcast,
    finite_squares,
    initial_state,
    outer_update,
    round_figures,
    train_replica,
)
from tensorturn.train.loop import derive_seed, load_model, set_threads

log = logging.getLogger(__name__)

RESIDUAL = "residual::"  # prefix of the broadcast's error-feedback residual in the outer state


def options(spec: RunSpec) -> StartedOptions:
    return cast(StartedOptions, spec.opts(FusedOptions))  # shards and H are filled at start


def global_bytes(spec: RunSpec, recipe: Recipe, theta: StateDict) -> bytes:
    """The model file of a global θ (its sha256 identifies the weights of a round)."""
    return model_bytes(theta, spec.recipe, recipe.default_config(), spec.recipe_options)


# ---- start, dispatch, resume -------------------------------------------------------------------

def start(spec: RunSpec, store: Store, board: RunBoard) -> None:
    """Write the spec and initial weights, record the run, dispatch round 0."""
    recipe = resolve(spec.recipe, spec.recipe_options)
    warnings = settle_options(spec, recipe)
    theta0 = global_bytes(spec, recipe, initial_state(recipe, spec.seed))
    options(spec).init_sha256 = sha256_hex(theta0)  # machines rebuild θ_0 from the seed, verified
    save_spec(store, spec)
    seals.put_bytes(store, layout.key("global", spec.run_id, 0), theta0)
    board.create(spec)
    for warning in warnings:
        board.warn(spec.run_id, warning)
    write_manifest(store, board, spec.run_id)
    if opts_sync(spec) == "async":
        from tensorturn.modes.fused import asynchronous

        asynchronous.start(spec, store, board)
        return
    board.claim(spec.run_id, layout.dispatch_claim(0))
    dispatch_round(spec, 0, board)


def opts_sync(spec: RunSpec) -> str:
    return options(spec).sync


def data_bytes() -> tuple[int, int]:
    """(downloaded, read): dataset bytes this thread has downloaded so far, and read from its
    cache (pushed datasets only)."""
    from tensorturn.data.source import machine_cache

    if machine_cache.cache_info().currsize == 0:  # no dataset read in this process yet
        return 0, 0
    return machine_cache().thread_bytes()


def count_data(board: RunBoard, run_id: str, worker: str, before: tuple[int, int]) -> None:
    """Add what this thread downloaded and read since ``before`` to the worker's figures."""
    now = data_bytes()
    board.add_data_bytes(run_id, worker, now[0] - before[0], now[1] - before[1])


def samples_per_step(spec: RunSpec, recipe: Recipe) -> int:
    """Training rows one inner step reads (the batch × ``--accumulate``)."""
    return (spec.batch_size or recipe.batch_size) * spec.accumulate


def epochs_per_round(spec: RunSpec, recipe: Recipe) -> float:
    """How many times a shard goes over its rows in one round (H steps × batch / its rows)."""
    opts = options(spec)
    rows = recipe.train_rows() / opts.shards
    return opts.sync_every * samples_per_step(spec, recipe) / max(rows, 1.0)


def settle_options(spec: RunSpec, recipe: Recipe) -> list[str]:
    """Decide what the user left to the data — the shards and H (:meth:`FusedOptions.fill_from_data`),
    then ``--outer auto`` — once, before the spec is stored: every machine and ``resume`` read
    the same values. Returns the warnings ``run`` prints about the setup: none when TensorTurn
    chose both the shards and H; else what ``--outer auto`` chose and :func:`small_data_warning`."""
    opts = options(spec)
    opts.fill_from_data(recipe.train_rows(), samples_per_step(spec, recipe))
    epochs = epochs_per_round(spec, recipe)
    chosen = opts.resolve_outer(epochs)
    if {"shards", "sync_every"} <= set(opts.chosen):
        return []
    return [w for w in (chosen, small_data_warning(spec, recipe, epochs)) if w]


def small_data_warning(spec: RunSpec, recipe: Recipe, epochs: float) -> str | None:
    """A warning when each shard goes over its rows (``epochs`` times a round) many times: with
    little data, local steps overfit their shard and validation loss tends to rise after a few
    rounds."""
    opts = options(spec)
    rows = recipe.train_rows() / opts.shards
    if epochs <= EPOCHS_PER_ROUND_WARNING:
        return None
    accumulated = f" × {spec.accumulate} accumulated" if spec.accumulate > 1 else ""
    return (f"each shard holds about {rows:.0f} training rows but trains {opts.sync_every} steps × "
            f"batch {spec.batch_size or recipe.batch_size}{accumulated} per round, going over them "
            f"{epochs:.0f} times: fewer --sync-every or --shards suit this little data (left out, "
            f"both are chosen from the data); --keep best keeps the round with the lowest "
            f"validation loss")


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


CHORD_REQUEUES = 3  # times a round is queued again because Celery could not run its outer step


def chord_failed_label(r: int, what: str) -> str:
    """What an errback's signature covers: everything its handler acts on (the round, and the
    words it records)."""
    return f"chord_failed:r{r}:{what}"


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
    times = int(board.r.hincrby(layout.run_key(run_id, "chord_requeues"), str(r), 1))
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


def resume(spec: RunSpec, store: Store, board: RunBoard) -> str:
    """Continue from the last round whose global weights are in the store; says what it did."""
    if opts_sync(spec) == "async":
        from tensorturn.modes.fused import asynchronous

        return asynchronous.resume(spec, store, board)
    stored = [layout.parse("global", key) for key in store.list(layout.prefix("global", spec.run_id))]
    r = max((parts["round"] for parts in stored if parts), default=0)
    for past in range(r):  # rounds the broker forgot are rebuilt from the store
        if store.exists(layout.key("round", spec.run_id, past)):
            board.record_round(spec.run_id, past, seals.get_json(store, layout.key("round", spec.run_id, past)))
    rounds = options(spec).rounds
    if r >= rounds:  # every round is stored: the outer step of the last one finalizes again
        r = rounds - 1
    board.r.delete(layout.run_key(spec.run_id, "chord_requeues"))  # each round's errback gets its 3 again
    board.claim(spec.run_id, layout.dispatch_claim(r))
    dispatch_round(spec, r, board)
    return f"resumed at round {r} of 0..{rounds - 1}"


# ---- the shard ---------------------------------------------------------------------------------

@app.task(bind=True, name="tensorturn.fused.train_slot", max_retries=None)
def train_slot(self, run_id: str, r: int, i: int, sig: str | None = None) -> dict[str, Any]:
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


@app.task(bind=True, name="tensorturn.fused.train_backup", max_retries=None)
def train_backup(self, run_id: str, r: int, k: int, sig: str | None = None) -> dict[str, Any]:
    """A backup copy of shard k of round r (``--sync backup``): queued when a round has no
    shard left to hand out and waits for stragglers; whichever copy stores the shard first
    counts, the other stops at its next look (:class:`Superseded`) or is discarded as late."""
    return execute(self, run_id, layout.backup_label(r, k), ShardUnit, sig)


@app.task(bind=True, name="tensorturn.fused.train_shard", max_retries=None)
def train_shard(self, run_id: str, r: int, k: int, sig: str | None = None) -> dict[str, Any]:
    """Train shard k for one round from θ_r and upload its pseudo-gradient (a named shard: what
    a slot becomes once bound; rounds queue slots)."""
    return execute(self, run_id, layout.shard_label(r, k), ShardUnit, sig)


class ShardUnit(backups.CopyAwareUnit):
    def done(self) -> bool:
        r, k = self.a.label.numbers
        return (self.store.exists(layout.key("shard", self.spec.run_id, r, k))
                or self.store.exists(layout.key("global", self.spec.run_id, r + 1)))

    def run(self) -> str:
        r, k = self.a.label.numbers
        spec = self.spec

        def theta_of(recipe: Recipe) -> tuple[StateDict, int, dict[str, str]]:
            prefetch_next(spec, recipe, self.board, r, self.a.worker)
            return (*fetch_global(spec, recipe, self.store, r), {})

        watch = None
        if options(spec).sync == "backup":
            stored_key = layout.run_key(spec.run_id, f"stored-r{r}")
            watch = lambda: bool(self.board.r.hexists(stored_key, str(k)))  # noqa: E731
        outcome = train_and_store(self, r, k, theta_of, layout.key("shard", spec.run_id, r, k), watch)
        if outcome == SUCCEEDED and watch is not None:  # other copies of the shard stop at their next look
            self.board.r.hset(layout.run_key(spec.run_id, f"stored-r{r}"), str(k), self.a.worker)
        return outcome

    def then(self) -> None:
        if options(self.spec).sync == "backup":
            try:  # only an optimisation: a failure here must not fail a shard that is done
                queue_backup(self.spec, self.store, self.board, self.a.label.numbers[0], self.a.worker)
            except Exception as exc:  # noqa: BLE001
                log.warning("run %s: no backup copy queued (%s)", self.spec.run_id, exc)



def train_and_store(unit: Unit, r: int, k: int,
                    theta_of: Callable[[Recipe], tuple[StateDict, int, dict[str, str]]],
                    out_key: str, watch: Callable[[], bool] | None = None) -> str:
    """Train shard k with round r's seed from the weights ``theta_of(recipe)`` gives (θ, bytes
    downloaded, metadata to store with the output), and store the pseudo-gradient at
    ``out_key`` — never over one stored already. With ``watch`` (does another copy's output
    exist?) the training stops as soon as another copy stored it. Returns SUCCEEDED, or LATE
    when another copy or attempt stored it first."""
    spec, opts, a = unit.spec, options(unit.spec), unit.a
    set_threads(spec.threads_per_task)
    recipe = recipe_of(spec)
    batch = spec.batch_size or recipe.batch_size
    reporter = TaskReporter(a.task, unit.board.r, str(a.label), opts.sync_every, batch,
                            live=(spec.run_id, live_field(a.label, opts.shards or 0)))
    data_before = data_bytes()
    x, y, rows = recipe.shard_data(k, opts.shards, spec.seed)
    count_data(unit.board, spec.run_id, a.worker, data_before)
    theta, a.bytes_down, meta = theta_of(recipe)
    on_step = reporter if watch is None else watch_superseded(reporter, watch, str(a.label))
    on_step = watch_cancelled(on_step, a, reporter)
    try:
        delta, loss, samples = train_replica(
            recipe, theta, x, y, rows, opts.sync_every,
            spec.lr or recipe.lr, batch, derive_seed(spec.seed, r, k), pick_device(),
            on_step=on_step, precision=spec.precision, accumulate=spec.accumulate)
        check_update(delta, theta, opts.max_update_ratio)
    except Superseded:
        unit.board.incident(spec.run_id, "superseded", str(a.label), a.worker,
                            "another copy stored its output first; this one stopped")
        return LATE
    except UpdateRejected as exc:  # recorded apart: the unit is trained again
        unit.board.incident(spec.run_id, "update_rejected", str(a.label), a.worker, str(exc))
        raise
    if unit.store.exists(out_key):  # never overwrite: it may be in use already
        return LATE
    a.check_cancelled(now=True)
    with tempfile.TemporaryDirectory(prefix="tt-shard-") as tmp:
        # written to a file and uploaded from it (S3: in parts), so the model is never in
        # memory twice; bytes_down is written at a fixed width: it depends on where the shard
        # ran (what that machine held), and the upload's size must not
        path = Path(tmp) / "delta"
        write_delta(path, delta, opts.codec, {"samples": str(samples), "loss": repr(loss), **meta,
                                              "bytes_down": f"{a.bytes_down:015d}"})
        del delta
        seals.put_file(unit.store, out_key, path)
        a.bytes_up = path.stat().st_size
    reporter.done()
    return SUCCEEDED


class Superseded(Exception):
    """Another copy of this shard stored it first: the rest of this copy's training is moot."""


BACKUP_LOOK_S = 0.05  # how often (at most) a copy of a unit looks whether another stored it first


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


def queue_backup(spec: RunSpec, store: Store, board: RunBoard, r: int, worker: str) -> None:
    """When round r has no shard left to hand out but some still training, queue on this
    worker's own queue a backup copy of the straggler it would beat by most (:mod:`.backups`),
    once per shard. The copies train the same shard from the same θ and seed, so the first one
    stored is the round's, whichever it is."""
    run_id, opts = spec.run_id, options(spec)
    if board.unclaimed_shards(run_id, r, opts.shards) or store.exists(layout.key("global", run_id, r + 1)):
        return
    stored = {int(k) for k in board.r.hkeys(layout.run_key(run_id, f"stored-r{r}"))}
    running = []
    for a in board.attempts(run_id):
        named = layout.parse_label(a["task"])
        if (named is not None and named.kind == "shard" and named.round == r and named.shard is not None
                and a["outcome"] == "running" and named.shard not in stored):
            running.append(backups.Running(named.shard, a["started_at"], a["worker"]))
    k = backups.pick(board, running, worker, opts.sync_every * (spec.batch_size or recipe_of(spec).batch_size))
    if k is None or not board.claim(run_id, f"backup-r{r}-{k}"):
        return
    label = str(layout.backup_label(r, k))
    forget_results([train_backup.s(run_id, r, k, **signed(run_id, label))
                    .set(queue=layout.agent_queue(worker)).apply_async()])
    board.incident(run_id, "backup_queued", label, worker,
                   f"round {r} waits for shard {k}: {worker} trains a backup copy, by its rate sooner")


def next_shard_here(board: RunBoard, spec: RunSpec, r: int, worker: str) -> int | None:
    """The shard this worker will most likely train next in round r: its next own shard not yet
    claimed. (Not the next round's: an outer step's evaluation, or a thief, would often take its
    place in the cache first.)"""
    shards = options(spec).shards
    left = set(board.unclaimed_shards(spec.run_id, r, shards))
    mine = sorted(s for s, w in board.shard_owners(spec.run_id).items() if w == worker and s in left)
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


# This process's latest global weights per run: (round, sha256 of the model file, θ).
_held: OrderedDict[str, tuple[int, str, StateDict]] = OrderedDict()
_HELD_RUNS = 2


def fetch_global(spec: RunSpec, recipe: Recipe, store: Store, r: int) -> tuple[StateDict, int]:
    """θ_r for a shard task, moving as few bytes as it can; returns (θ_r, bytes downloaded).

    In order: θ_r already held (another shard of the round ran here) — nothing moves; round 0
    rebuilt from the seed — nothing moves; θ_{r−1} held and the run compresses — only the
    broadcast delta moves; else the full model file. A rebuilt θ is used only if its model file
    hashes to the one the coordinator stored, so a different torch or a lost delta can only cost
    bytes, never change the weights.
    """
    opts = options(spec)
    held = _held.get(spec.run_id)
    if held and held[0] == r:
        return held[2], 0
    moved, theta, sha = 0, None, None
    if r == 0 and opts.init_sha256:
        candidate = initial_state(recipe, spec.seed)
        if sha256_hex(global_bytes(spec, recipe, candidate)) == opts.init_sha256:
            theta, sha = candidate, opts.init_sha256
        else:
            log.warning("run %s: θ_0 rebuilt from the seed differs from the stored one "
                        "(another torch version?); downloading it", spec.run_id)
    elif held and held[0] == r - 1 and opts.codec != "fp32":
        theta, sha, moved = _rebuild_from_broadcast(spec, recipe, store, r, held)
    if theta is None:  # through a file: the model is never in memory twice (bytes and tensors)
        with tempfile.TemporaryDirectory(prefix="tt-global-") as tmp:
            path = Path(tmp) / "theta"
            sha = seals.get_file(store, layout.key("global", spec.run_id, r), path)
            with TensorReader(path) as f:
                theta = f.all()
            moved += path.stat().st_size
    assert sha is not None
    _held[spec.run_id] = (r, sha, theta)
    _held.move_to_end(spec.run_id)
    while len(_held) > _HELD_RUNS:
        _held.popitem(last=False)
    return theta, moved


def _rebuild_from_broadcast(spec: RunSpec, recipe: Recipe, store: Store, r: int,
                            held: tuple[int, str, StateDict]) -> tuple[StateDict | None, str, int]:
    try:
        blob = seals.get_bytes(store, layout.key("broadcast", spec.run_id, r))
    except ObjectMissing:  # a run from before broadcasts existed
        return None, "", 0
    meta = metadata_of(blob)
    if meta.get("base_sha256") == held[1]:
        theta = apply_step(held[2], delta_from_bytes(blob)[0])
        sha = sha256_hex(global_bytes(spec, recipe, theta))
        if sha == meta.get("sha256"):
            return theta, sha, len(blob)
    log.warning("run %s: round %d's broadcast delta does not rebuild the stored weights here; "
                "downloading them", spec.run_id, r)
    return None, "", len(blob)


# ---- the outer step ----------------------------------------------------------------------------

@app.task(bind=True, name="tensorturn.fused.outer_step", max_retries=None)
def outer_step(self, _receipts: list, run_id: str, r: int, sig: str | None = None) -> dict[str, Any]:
    """Chord body: average round r's pseudo-gradients, step θ, then dispatch r+1 or finish."""
    return execute(self, run_id, layout.outer_label(r), OuterUnit, sig)


class OuterUnit(Unit):
    def done(self) -> bool:
        # the last round is done only when the run is finished (checked before this)
        r = self.a.label.numbers[0]
        return r + 1 < options(self.spec).rounds and self.board.has_round(self.spec.run_id, r)

    def run(self) -> str:
        spec, store, r = self.spec, self.store, self.a.label.numbers[0]
        self.a.check_cancelled(now=True)
        data_before = data_bytes()  # evaluation data this machine had to download
        last = r + 1 == options(spec).rounds
        self.phase("averaging")

        def stored() -> None:  # the machines train round r+1 (queued once) while this evaluates r
            if not last:
                self.then()
            self.phase("evaluating")

        with tempfile.TemporaryDirectory(prefix="tt-outer-") as tmp:
            info = outer_round(spec, store, r, Path(tmp), stored)
            info["at"] = time.time()  # when the round's weights were evaluated (loss against wall time)
            self.a.check_cancelled(now=True)
            seals.put_json(store, layout.key("round", spec.run_id, r), info)  # before the board: done() reads it
            self.board.record_round(spec.run_id, r, info)
            if last:
                record_missing_rounds(spec, store, self.board, r, Path(tmp))
                self.phase("testing")
                self.a.check_cancelled(now=True)
                finalize(spec, store, self.board, local=Path(tmp) / "next", finish=self.finish_run)
            else:
                write_manifest(store, self.board, spec.run_id)
        count_data(self.board, spec.run_id, self.a.worker, data_before)
        return SUCCEEDED

    def phase(self, what: str) -> None:
        """Say what this outer step is doing (``run`` and ``status`` show it)."""
        self.board.mark_phase(self.spec.run_id, str(self.a.label), what, self.a.worker)

    def then(self) -> None:
        spec, r = self.spec, self.a.label.numbers[0]
        if r + 1 < options(spec).rounds:
            self.board.once(spec.run_id, layout.dispatch_claim(r + 1), lambda: dispatch_round(spec, r + 1, self.board))


def record_missing_rounds(spec: RunSpec, store: Store, board: RunBoard, last: int, scratch: Path) -> None:
    """Before the run finishes, every round before ``last`` in its records: an outer step queues
    the next round before it evaluates, so one whose evaluation failed (or a broker that lost
    the record) can leave a round unrecorded; it is read from the store, or evaluated again."""
    recorded = {rec["round"] for rec in board.rounds(spec.run_id)}
    for k in range(last):
        if k in recorded:
            continue
        key = layout.key("round", spec.run_id, k)
        if store.exists(key):
            info = seals.get_json(store, key)
        else:
            folder = scratch / f"round-{k}"
            folder.mkdir()
            info = outer_round(spec, store, k, folder)
            info["at"] = time.time()
            seals.put_json(store, key, info)
        board.record_round(spec.run_id, k, info)


def outer_round(spec: RunSpec, store: Store, r: int, scratch: Path,
                stored: Callable[[], None] | None = None) -> dict[str, Any]:
    """Average round r's stored pseudo-gradients into θ_{r+1} (or reuse it, when a previous
    attempt stored it), call ``stored()`` once it is in the store, and evaluate it; returns the
    round's record. θ_{r+1} is left in ``scratch/next``.

    Everything streams through local files, tensor by tensor, so memory holds one model-sized
    sum and one tensor at a time, whatever S: each shard's weight comes from its file's header
    first, then each shard is downloaded (multipart on S3), read one tensor at a time and added
    in shard order — the list average's arithmetic, so the same bits — then θ_{r+1} is written
    (:func:`step_global`, also to ``scratch/next``) and read back to be evaluated."""
    losses, samples, bytes_up, bytes_down = average_and_step(spec, store, r, scratch)
    path = scratch / "next"
    if not path.exists():  # a previous attempt stored θ_{r+1}
        seals.get_file(store, layout.key("global", spec.run_id, r + 1), path)
    if stored is not None:
        stored()
    with TensorReader(path) as f:
        new_theta = f.all()
    recipe = recipe_of(spec)
    set_threads(spec.threads_per_task)
    device = pick_device()
    model = load_model(recipe, new_theta, recipe.default_config(), device)
    del new_theta
    val = recipe.evaluate_split(model, "val", device, spec.eval_batches)
    return round_figures(losses, samples, val, bytes_up, bytes_down, r)


def average_and_step(spec: RunSpec, store: Store, r: int, scratch: Path
                     ) -> tuple[list[float], list[int], int, int]:
    """Round r's average and outer step (unless θ_{r+1} is stored already), through files in
    ``scratch``; returns the shards' (losses, samples, bytes up, bytes down)."""
    run_id, shards = spec.run_id, options(spec).shards
    keys = [layout.key("shard", run_id, r, k) for k in range(shards)]
    missing = [k for k, key in enumerate(keys) if not store.exists(key)]
    if missing:
        raise RuntimeError(f"round {r}: shard outputs missing for shards {missing}")
    samples = [int(stored_metadata(store, key)["samples"]) for key in keys]
    recipe = recipe_of(spec)
    most = options(spec).sync_every * samples_per_step(spec, recipe)
    decided = store.exists(layout.key("global", run_id, r + 1))  # by a previous attempt
    avg: StateDict = {}
    norms: dict[int, float] = {}  # shard → its sum of squares
    losses, bytes_up, bytes_down = [], 0, 0
    for k, key in enumerate(keys):
        path = scratch / f"shard-{k}"
        seals.get_file(store, key, path)  # its sealed bytes: the header read above is among them
        with TensorReader(path) as shard:
            meta = shard.metadata
            if int(meta["samples"]) != samples[k]:  # shard outputs are never overwritten
                raise RuntimeError(f"round {r}: shard {k}'s output changed while it was averaged")
            what = f"round {r}: the pseudo-gradient of shard {k}"
            check_samples(what, samples[k], most, OUTER)
            losses.append(float(meta["loss"]))
            bytes_up += path.stat().st_size
            bytes_down += int(meta["bytes_down"])
            if not decided:
                w = samples[k] / float(sum(samples))
                squares = 0.0
                for name, value in delta_tensors(shard):
                    squares += finite_squares(what, name, value, OUTER)
                    accumulate(avg, {name: value}, w)
                norms[k] = squares
        path.unlink()
    if not decided:
        step_global(spec, recipe, store, r, avg, scratch, norms)
    return losses, samples, bytes_up, bytes_down


OUTER = "the outer step"


def check_norms(spec: RunSpec, r: int, norms: dict[int, float], theta_squares: float) -> None:
    """Each shard's pseudo-gradient norm (``norms``: its sum of squares) against θ_r's
    (:func:`~tensorturn.train.diloco.check_norm`)."""
    for k, squares in norms.items():
        check_norm(f"round {r}: the pseudo-gradient of shard {k}", squares, theta_squares,
                   options(spec).max_update_ratio, OUTER)


def step_global(spec: RunSpec, recipe: Recipe, store: Store, r: int, avg: StateDict,
                scratch: Path | None = None, norms: dict[int, float] | None = None) -> None:
    """Store θ_{r+1} from θ_r and the averaged pseudo-gradient ``avg`` (used up): first the outer
    state and, in compressed runs, the broadcast delta, then θ_{r+1}, whose existence decides
    the round. With a ``scratch`` folder and an uncompressed broadcast it streams (see
    :func:`_step_streaming`); compressing the broadcast needs the whole θ in memory. θ_{r+1}
    is also left at ``scratch/next``. ``norms`` (shard → its pseudo-gradient's sum of squares) are checked
    against θ_r's before anything is stored (:func:`check_norms`)."""
    opts = options(spec)
    if opts.outer == "auto":  # start decides it before the spec is stored
        raise RuntimeError(f"run {spec.run_id}: its spec never decided --outer auto")
    compress = opts.codec != "fp32" and r + 1 < opts.rounds  # the final θ is kept exact
    if scratch is not None and not compress:
        _step_streaming(spec, recipe, store, r, avg, scratch, norms or {})
    else:
        _step_in_memory(spec, recipe, store, r, avg, compress, scratch, norms or {})


def _outer_args(spec: RunSpec) -> tuple[float, float, bool]:
    opts = options(spec)
    use_momentum = opts.outer == "nesterov" and opts.outer_momentum > 0
    return float(opts.outer_lr or 0), opts.outer_momentum if use_momentum else 0.0, use_momentum


def _step_streaming(spec: RunSpec, recipe: Recipe, store: Store, r: int, avg: StateDict,
                    scratch: Path, norms: dict[int, float]) -> None:
    """The outer step tensor by tensor: θ_r and the momentum are read from files one tensor at
    a time, θ_{r+1} and the new momentum written the same way, each in its file's order (the
    momentum's pass recomputes its values: the same arithmetic, so the same bits)."""
    run_id, opts = spec.run_id, options(spec)
    lr, momentum, nesterov = _outer_args(spec)
    theta_path, state_path = scratch / "theta", scratch / "state"
    seals.get_file(store, layout.key("global", run_id, r), theta_path)
    state_key = layout.key("outer", run_id, r)
    has_state = r > 0 and (bool(momentum) or (opts.codec != "fp32" and store.exists(state_key)))
    if has_state:
        seals.get_file(store, state_key, state_path)
    with TensorReader(theta_path) as theta, \
            (TensorReader(state_path) if has_state else contextlib.nullcontext()) as state:
        def step(name: str) -> tuple[StateDict, StateDict]:
            prev = state.get(name) if momentum and state is not None and name in state.entries else None
            d = {name: avg[name]} if name in avg else {}
            return outer_update({name: theta.get(name)}, d, {name: prev} if prev is not None else None,
                                lr, momentum, nesterov)

        specs = {name: (DTYPES[e["dtype"]], e["shape"]) for name, e in theta.entries.items()}
        new_theta_path = scratch / "next"
        squares = 0.0
        with TensorWriter(new_theta_path, specs, model_metadata(
                spec.recipe, recipe.default_config(), spec.recipe_options)) as out:
            for name in out.order:
                if name in avg:
                    squares += float(theta.get(name).double().square().sum())
                out.write(name, step(name)[0][name])
            out.close()
        check_norms(spec, r, norms, squares)  # before anything is stored
        if momentum:  # stored before θ_{r+1}, which decides the round
            buf_specs = {name: (torch.float32, specs[name][1]) for name in avg}
            with TensorWriter(scratch / "state-next", buf_specs) as out:
                for name in out.order:
                    out.write(name, step(name)[1][name])
                    del avg[name]
                out.close()
            seals.put_file(store, layout.key("outer", run_id, r + 1), scratch / "state-next")
    avg.clear()
    seals.put_file(store, layout.key("global", run_id, r + 1), new_theta_path)


def _step_in_memory(spec: RunSpec, recipe: Recipe, store: Store, r: int, avg: StateDict,
                    compress: bool, scratch: Path | None = None,
                    norms: dict[int, float] | None = None) -> None:
    run_id, opts = spec.run_id, options(spec)
    lr, momentum, nesterov = _outer_args(spec)
    theta_bytes = seals.get_bytes(store, layout.key("global", run_id, r))
    theta, theta_sha = from_bytes(theta_bytes), sha256_hex(theta_bytes)
    del theta_bytes
    check_norms(spec, r, norms or {}, sum(float(theta[k].double().square().sum()) for k in avg))
    state: StateDict = {}
    state_key = layout.key("outer", run_id, r)
    if r > 0 and (momentum or (opts.codec != "fp32" and store.exists(state_key))):
        state = from_bytes(seals.get_bytes(store, state_key))  # (no residual yet: a run from before)
    buf = {k: v for k, v in state.items() if not k.startswith(RESIDUAL)}
    residual = {k[len(RESIDUAL):]: v for k, v in state.items() if k.startswith(RESIDUAL)}
    del state
    shapes = {k: list(theta[k].shape) for k in float_keys(theta)}
    new_theta, new_buf = outer_update(theta, avg, buf or None, lr, momentum, nesterov,
                                      consume=not compress)  # compressing needs θ_r still
    packed: dict = {}
    if compress:
        packed, new_theta, new_residual = compress_broadcast(theta, new_theta, residual or None,
                                                             opts.codec)
        new_buf.update({RESIDUAL + k: v for k, v in new_residual.items()})
    del theta
    if new_buf:  # the outer state of r+1 is stored before θ_{r+1} decides the round
        seals.put_bytes(store, layout.key("outer", run_id, r + 1), to_bytes(new_buf))
    del new_buf
    new_bytes = global_bytes(spec, recipe, new_theta)
    if compress:
        seals.put_bytes(store, layout.key("broadcast", run_id, r + 1), to_bytes(packed, {
            "format": BROADCAST_FORMAT, "codec": opts.codec,
            "shapes": json.dumps(shapes, sort_keys=True),
            "base_sha256": theta_sha, "sha256": sha256_hex(new_bytes)}))
    seals.put_bytes(store, layout.key("global", run_id, r + 1), new_bytes)
    if scratch is not None:
        (scratch / "next").write_bytes(new_bytes)


def finalize(spec: RunSpec, store: Store, board: RunBoard,
             weights_key: Callable[[int], str] | None = None, local: Path | None = None,
             finish: Callable[..., None] | None = None) -> None:
    """Store the final model, evaluate it on the test split, and finish the run. The weights
    after round r are at ``weights_key(r)`` (θ_{r+1}'s key, unless said otherwise); ``local``
    is a file holding the last round's, when this machine has them. ``finish`` (the attempt's
    :meth:`~tensorturn.tasks.attempt.Unit.finish_run`) finishes the run with the attempt's own
    records; without it, the run is finished and its manifest written here."""
    run_id, opts = spec.run_id, options(spec)
    kept = opts.rounds - 1
    if opts.keep == "best":  # the round whose weights had the lowest validation loss
        rounds = board.rounds(run_id)
        def loss(rec: dict[str, Any]) -> float:  # no figure, or not a number: never the best
            value = rec.get("val_loss")
            return value if value is not None and math.isfinite(value) else math.inf

        kept = min(rounds, key=lambda rec: (loss(rec), -rec["round"]))["round"] if rounds else kept
    key = weights_key(kept) if weights_key else layout.key("global", run_id, kept + 1)
    # θ after round `kept`
    data = local.read_bytes() if local is not None and kept == opts.rounds - 1 else seals.get_bytes(store, key)
    theta = from_bytes(data)
    if not is_finite(theta):  # a run never ends "succeeded" on weights that cannot answer
        raise UpdateRejected(f"the weights after round {kept} hold NaN/Inf: no model is kept "
                             f"(a lower --lr or --outer-lr, or --keep best, may help)")
    sha = store.put_bytes(layout.key("final_model", run_id), data)
    recipe = recipe_of(spec)
    device = pick_device()
    model = load_model(recipe, theta, recipe.default_config(), device)
    test = recipe.evaluate_split(model, "test", device, spec.eval_batches)
    result = {"metrics": {**{f"test_{k}": v for k, v in test.items()}, "kept_round": kept},
              "model_uri": store.uri(layout.key("final_model", run_id)), "model_sha256": sha}
    if finish is not None:
        finish("succeeded", **result)
        return
    board.finish(run_id, "succeeded", **result)
    write_manifest(store, board, run_id)


from tensorturn.modes.fused import asynchronous as asynchronous  # noqa: E402 - its task registers with this module's
