"""The outer step of a round: average the shards' stored pseudo-gradients and step θ_r to θ_{r+1}
(DiLoCo, Douillard et al. 2023, arXiv 2311.08105: Nesterov outer momentum; plain averaging —
FedAvg — with ``--outer sgd``); θ_{r+1} is evaluated by a task of its own (:class:`EvalUnit`),
queued behind round r+1's shards, so the machine that stepped trains its next shard at once and
the evaluation fills a machine's wait at the next barrier (the last round's outer step
evaluates itself: the run's test and the kept round follow).

One streaming implementation, whatever the model's size and the codec: everything goes through
local files, tensor by tensor, so memory holds one model-sized sum and a tensor at a time — the
shards are averaged here (:func:`average_and_step`), and the step itself is the one every sync
policy takes (:func:`~tensorturn.modes.fused.step.outer_step`): θ_{r+1}, the broadcast and the
residual are written together, each tensor's move computed once (2.4× an 86M model at the
peak, the process included; ``benchmarks/bigmodel.py --part outer``). Its arithmetic is
the in-memory one's (:func:`~tensorturn.train.diloco.weighted_average`,
:func:`~tensorturn.train.diloco.outer_update`, :func:`~tensorturn.train.diloco.compress_broadcast`)
applied tensor by tensor, so the same bits. θ_{r+1} is stored last: its existence decides the round.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorturn import layout
from tensorturn.modes.fused import uploads
from tensorturn.modes.fused.ahead import Fetch, ReadAhead, step_outputs
from tensorturn.modes.fused.finalize import finalize
from tensorturn.modes.fused.options import eval_passes, evaluated, options, outer_args, samples_per_step
from tensorturn.modes.fused.plan import outer_units
from tensorturn.modes.fused.plans import StepDone, StepPlan, Wires
from tensorturn.modes.fused.shard import count_data, data_bytes
from tensorturn.modes.fused.step import Broadcast, InputCheck, Synchronous, outer_step
from tensorturn.modes.fused.weights import cache
from tensorturn.recipes import Recipe, recipe_of
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.manifest import try_write_manifest
from tensorturn.store import seals
from tensorturn.store.objects import Store, file_sha256
from tensorturn.store.tensorfile import TensorReader, delta_tensors
from tensorturn.store.tensors import StateDict, model_metadata, stored_metadata
from tensorturn.tasks.attempt import LATE, SUCCEEDED, Attempt, NotYet, Unit, broker_time
from tensorturn.tasks.poll import poll
from tensorturn.train.device import pick_device
from tensorturn.train.diloco import accumulate, round_figures
from tensorturn.train.loop import load_model, set_threads

log = logging.getLogger(__name__)

OUTER = "the outer step"  # who refuses a pseudo-gradient here (its checks' messages say so)


def outer_round(spec: RunSpec, store: Store, r: int, scratch: Path) -> dict[str, Any]:
    """Average round r's stored pseudo-gradients into θ_{r+1} (or reuse it, when a previous
    attempt stored it) and evaluate it; returns the round's record. θ_{r+1} is left in
    ``scratch/next``.

    Each shard's weight comes from its file's header first, then each shard is downloaded
    (multipart on S3), read one tensor at a time and added in shard order — the list average's
    arithmetic, so the same bits — then θ_{r+1} is written (:func:`step_global`, also to
    ``scratch/next``) and read back to be evaluated."""
    figures = average_and_step(spec, store, r, scratch)
    return evaluate_round(spec, store, r, scratch, figures)


def evaluate_round(spec: RunSpec, store: Store, r: int, scratch: Path,
                   figures: tuple[list[float], list[int], int, int]) -> dict[str, Any]:
    """Round r's record: θ_{r+1} (``scratch/next``, downloaded when not there) evaluated on the
    validation split, beside the shards' ``figures`` (losses, samples, bytes up, bytes down)."""
    path = scratch / "next"
    if not path.exists():  # stepped by another attempt, or on another machine
        seals.get_file(store, layout.key("global", spec.run_id, r + 1), path)
    with TensorReader(path) as f:
        new_theta = f.all()
    recipe = recipe_of(spec)
    set_threads(spec.threads_per_task)
    device = pick_device()
    model = load_model(recipe, new_theta, recipe.default_config(), device)
    del new_theta
    val, rows = recipe.evaluate_counted(model, "val", device, eval_passes(spec, recipe))
    losses, samples, bytes_up, bytes_down = figures
    info = round_figures(losses, samples, val, bytes_up, bytes_down, r, rows)
    info["at"] = broker_time()  # when the round's weights were evaluated (loss against wall time)
    return info


def keep_global(spec: RunSpec, r: int, path: Path) -> None:
    """θ_r, just written to ``path`` by this process's outer step, into the process's cache of
    global weights (:data:`~tensorturn.modes.fused.weights.cache`); only a saving: a failure is
    logged, and the weights are read from the store instead."""
    try:
        with TensorReader(path) as f:
            theta = f.all()
        cache.put(spec.run_id, r, file_sha256(path), theta)
    except Exception as exc:  # noqa: BLE001 - the store holds θ_r; the slot reads it from there
        log.warning("run %s: θ_%d not kept in memory (%s); it is read from the store", spec.run_id, r, exc)


def unevaluated_round(r: int, figures: tuple[list[float], list[int], int, int]) -> dict[str, Any]:
    """Round r's record where ``--eval-every`` skips its evaluation: the shards' ``figures``
    (losses, samples, bytes up, bytes down), no validation figures (as for a dataset without
    validation rows: ``--keep best`` never keeps such a round)."""
    losses, samples, bytes_up, bytes_down = figures
    info = round_figures(losses, samples, {}, bytes_up, bytes_down, r, 0)
    info["at"] = broker_time()
    return info


def shard_figures(spec: RunSpec, store: Store, r: int) -> tuple[list[float], list[int], int, int]:
    """Round r's shards' (losses, samples, bytes up, bytes down), from their stored files'
    headers and sizes — what :func:`average_and_step` reads, without the download."""
    run_id = spec.run_id
    keys = [layout.key("shard", run_id, r, k) for k in range(options(spec).shards)]
    sizes = store.sizes(layout.prefix("shard", run_id, r))
    metas = [stored_metadata(store, key) for key in keys]
    return ([float(m["loss"]) for m in metas], [int(m["samples"]) for m in metas],
            sum(sizes[key] for key in keys), sum(int(m["bytes_down"]) for m in metas))


class OuterUnit(Unit):
    """The outer step of round r (queued by the round's last shard stored): gather the inputs as
    its ``plan`` says, average, step, and hand the result on (:meth:`~.plans.Wires.follow`: the
    policy queues the next round and this round's evaluation) as soon as θ_{r+1} is stored; the
    last round's evaluates, and finishes the run."""

    followed = False  # what follows the step is queued

    def __init__(self, attempt: Attempt, plan: StepPlan, wires: Wires,
                 deferred: list[Callable[[], None]] | None = None, ahead: ReadAhead | None = None):
        """``deferred``: where a step taken by a slot of the next round that waits for θ_{r+1}
        (:func:`~tensorturn.modes.fused.standby.take_step`) leaves what can wait until that
        slot trains — the round's record, the scratch folder's removal — and then keeps
        θ_{r+1} in this process's cache, so the slot trains from it at once. ``ahead``: what
        that slot read of the step's inputs while it stood by."""
        super().__init__(attempt)
        self.plan, self.wires = plan, wires
        self.deferred = deferred
        self.fetch: Fetch = ahead.fetch if ahead is not None else seals.get_file

    def later(self, work: Callable[[], None]) -> None:
        """Do ``work`` now, or leave it in :attr:`deferred`."""
        if self.deferred is None:
            work()
        else:
            self.deferred.append(work)

    @contextlib.contextmanager
    def scratch(self) -> Iterator[Path]:
        """A scratch folder for the step, removed when it ends (or :meth:`later`)."""
        tmp = Path(tempfile.mkdtemp(prefix="tt-outer-"))
        try:
            yield tmp
        finally:
            self.later(lambda: shutil.rmtree(tmp, ignore_errors=True))

    def done(self) -> bool:
        # the last round is done only when the run is finished (checked before this)
        r = self.a.label.numbers[0]
        return r + 1 < options(self.spec).rounds and self.store.exists(
            layout.key("global", self.spec.run_id, r + 1))

    def run(self) -> str:
        spec, store, r = self.spec, self.store, self.a.label.numbers[0]
        self.a.check_cancelled()  # (the attempt's begin read the run's state a moment ago)
        data_before = data_bytes()  # evaluation data this machine had to download
        last = r + 1 == options(spec).rounds
        waiting = uploads.await_uploads(self, self.wires, r) if self.plan.uploads else None
        if waiting is not None:  # queued again once the round's outputs are in
            raise NotYet(waiting)
        self.phase("averaging")
        with self.scratch() as tmp:
            clock = OuterClock()
            figures = average_and_step(spec, store, r, Path(tmp), self.fetch, clock)
            if not last:  # a steady round's step (the last one's has the run's end beside it)
                self.publish_rate(clock)  # the machines train round r+1, and one evaluates θ_{r+1} when free
                self.then()
                if self.deferred is not None and (tmp / "next").exists():  # the slot trains from θ_{r+1} next
                    keep_global(spec, r + 1, tmp / "next")
                if not evaluated(spec, r):  # --eval-every: the training figures only
                    info = unevaluated_round(r, figures)

                    def record() -> None:
                        seals.put_json(store, layout.key("round", spec.run_id, r), info)
                        self.board.record_round(spec.run_id, r, info)
                    self.later(record)
                return SUCCEEDED
            self.phase("evaluating")
            info = evaluate_round(spec, store, r, tmp, figures)
            self.a.check_cancelled(now=True)
            seals.put_json(store, layout.key("round", spec.run_id, r), info)  # before the board: done() reads it
            self.board.record_round(spec.run_id, r, info)
            record_missing_rounds(spec, store, self.board, r, tmp, self.a.worker, self.a.check_cancelled)
            self.phase("testing")
            self.a.check_cancelled(now=True)
            finalize(spec, store, self.board, local=tmp / "next", finish=self.finish_run)
        count_data(self.board, spec.run_id, self.a.worker, data_before)
        return SUCCEEDED

    def publish_rate(self, clock: OuterClock) -> None:
        """The seconds this step took a unit of its work (:func:`.plan.outer_units`), published
        on this agent for the next runs' plans; only a figure: a failure is logged."""
        if not clock.values or clock.seconds <= 0:  # stepped before, by another attempt
            return
        opts = options(self.spec)
        units = outer_units(clock.values, opts.shards, opts.codec or "fp32", opts.down_codec)
        try:
            self.board.workers.outer_rate(self.a.worker, clock.seconds / units)
        except Exception as exc:  # noqa: BLE001 - the step is done; the next plan takes the model's figure
            log.warning("run %s: the outer step's rate not published (%s)", self.spec.run_id, exc)

    def phase(self, what: str) -> None:
        """Say what this outer step is doing (``run`` and ``status`` show it)."""
        self.board.progress.mark_phase(self.spec.run_id, str(self.a.label), what, self.a.worker)

    def then(self) -> None:
        if self.followed:  # queued from run() already (execute calls this again)
            return
        self.wires.follow(StepDone(self.a.label.numbers[0]))
        self.followed = True


class EvalUnit(Unit):
    """The evaluation of round r's weights θ_{r+1} (queued by round r's outer step, behind
    round r+1's shards): the round's record, then the manifest. A run that finished meanwhile
    has the round recorded by its last outer step (:func:`record_missing_rounds`)."""

    def done(self) -> bool:
        return self.board.rounds.has(self.spec.run_id, self.a.label.numbers[0])

    def run(self) -> str:
        spec, store, r = self.spec, self.store, self.a.label.numbers[0]
        self.a.check_cancelled(now=True)
        data_before, began = data_bytes(), time.monotonic()
        with tempfile.TemporaryDirectory(prefix="tt-eval-") as tmp:  # (its phase: "evaluating" throughout)
            info = evaluate_round(spec, store, r, Path(tmp), shard_figures(spec, store, r))
        try:  # what a round's evaluation costs the agent that takes it (a fused run's plan reads it)
            self.board.workers.eval_time(self.a.worker, spec.recipe, time.monotonic() - began)
        except Exception as exc:  # noqa: BLE001 - a figure; the broker may be away
            log.debug("the evaluation's time not published: %s", exc)
        self.a.check_cancelled(now=True)
        count_data(self.board, spec.run_id, self.a.worker, data_before)
        if self.board.runs.is_finished(spec.run_id) or self.board.rounds.has(spec.run_id, r):
            return LATE  # recorded by the run's last outer step
        seals.put_json(store, layout.key("round", spec.run_id, r), info)
        self.board.record_round(spec.run_id, r, info)
        try_write_manifest(store, self.board, spec.run_id)
        return SUCCEEDED

    def give_up(self, message: str) -> None:
        """Past the attempt cap the run goes on: the last outer step evaluates the round again
        (:func:`record_missing_rounds`), and fails the run if that fails too."""
        self.board.incidents.add(self.spec.run_id, "evaluation_given_up", str(self.a.label), self.a.worker,
                                 f"{message}; the last outer step evaluates the round again")


EVAL_WAIT_S = 600  # how long the last outer step waits for a round's running evaluation


def record_missing_rounds(spec: RunSpec, store: Store, board: RunBoard, last: int, scratch: Path,
                          worker: str = "", check: Callable[[], None] = lambda: None) -> None:
    """Before the run finishes, every round before ``last`` in its records: a round is evaluated
    by a task of its own while the next trains, so one whose evaluation still runs on another
    agent than ``worker`` is waited for (``check`` raises if the run is cancelled meanwhile),
    and one whose evaluation failed (or a broker that lost the record) is read from the store
    or evaluated again: the same weights, so the same figures (a round ``--eval-every`` skips:
    its training figures)."""
    recorded = {rec["round"] for rec in board.rounds.all(spec.run_id)}
    for k in range(last):
        if k in recorded or (evaluated(spec, k) and wait_for_evaluation(board, spec.run_id, k, worker, check)):
            continue
        key = layout.key("round", spec.run_id, k)
        if store.exists(key):
            info = seals.get_json(store, key)
        elif not evaluated(spec, k):
            info = unevaluated_round(k, shard_figures(spec, store, k))
        else:
            folder = scratch / f"round-{k}"
            folder.mkdir()
            info = outer_round(spec, store, k, folder)
            seals.put_json(store, key, info)
        board.record_round(spec.run_id, k, info)


def wait_for_evaluation(board: RunBoard, run_id: str, r: int, worker: str, check: Callable[[], None]) -> bool:
    """Wait while an attempt of round r's evaluation runs on another agent than ``worker`` that
    is online (at most :data:`EVAL_WAIT_S`); whether it recorded the round. One on a machine
    that stopped answering is not waited for, nor one marked running on ``worker`` (lost with a
    pool child, most likely): its task, given back, may need this very agent."""
    label = str(layout.eval_label(r))
    for _ in poll(check, cap=0.5, within=EVAL_WAIT_S):
        if board.rounds.has(run_id, r):
            return True
        running = {a["worker"] for a in board.attempts.all(run_id) if a["task"] == label and a["outcome"] == "running"}
        running.discard(worker)
        if not running & board.workers.online():
            return board.rounds.has(run_id, r)
    return False  # waited EVAL_WAIT_S in vain


@dataclass
class OuterClock:
    """What an outer step spent computing — reading and adding the updates, stepping θ, encoding
    its broadcast — without fetching or storing (the plan models the transfers apart), and the
    values it stepped (0: θ_{r+1} was stored already, no step taken)."""

    seconds: float = 0.0
    values: int = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start


def average_and_step(spec: RunSpec, store: Store, r: int, scratch: Path, fetch: Fetch = seals.get_file,
                     clock: OuterClock | None = None) -> tuple[list[float], list[int], int, int]:
    """Round r's average and outer step (unless θ_{r+1} is stored already), through files in
    ``scratch``, each object read with ``fetch`` (by default downloaded now; :class:`ReadAhead`
    hands over what it read while the round's last shard trained); returns the shards' (losses,
    samples, bytes up, bytes down). Each shard's pseudo-gradient is looked at as it is read
    (:class:`~tensorturn.modes.fused.step.InputCheck`) and added in shard order — the list
    average's arithmetic (:func:`~tensorturn.train.diloco.weighted_average`), so the same bits.
    ``clock``: where the step's computing time is counted."""
    clock = clock if clock is not None else OuterClock()
    run_id, shards = spec.run_id, options(spec).shards
    keys = [layout.key("shard", run_id, r, k) for k in range(shards)]
    missing = [k for k, key in enumerate(keys) if not store.exists(key)]
    if missing:
        raise RuntimeError(f"round {r}: shard outputs missing for shards {missing}")
    samples = [int(stored_metadata(store, key)["samples"]) for key in keys]
    recipe = recipe_of(spec)
    check = InputCheck(options(spec).sync_every * samples_per_step(spec, recipe), options(spec).max_update_ratio,
                       OUTER)
    decided = store.exists(layout.key("global", run_id, r + 1))  # by a previous attempt
    avg: StateDict = {}
    losses, bytes_up, bytes_down = [], 0, 0
    for k, key in enumerate(keys):
        path = scratch / f"shard-{k}"
        fetch(store, key, path)  # its sealed bytes: the header read above is among them
        with TensorReader(path) as shard:
            meta = shard.metadata
            if int(meta["samples"]) != samples[k]:  # shard outputs are never overwritten
                raise RuntimeError(f"round {r}: shard {k}'s output changed while it was averaged")
            what = f"round {r}: the pseudo-gradient of shard {k}"
            check.samples(what, samples[k])
            losses.append(float(meta["loss"]))
            bytes_up += path.stat().st_size
            bytes_down += int(meta["bytes_down"])
            if not decided:
                w = samples[k] / float(sum(samples))
                with clock.counting():
                    for name, value in check.values(what, delta_tensors(shard)):
                        accumulate(avg, {name: value}, w)
        path.unlink()
    if not decided:
        step_global(spec, recipe, store, r, avg, scratch, check, fetch, clock)
    return losses, samples, bytes_up, bytes_down


def step_global(spec: RunSpec, recipe: Recipe, store: Store, r: int, avg: StateDict,
                scratch: Path | None = None, check: InputCheck | None = None,
                fetch: Fetch = seals.get_file, clock: OuterClock | None = None) -> None:
    """Store θ_{r+1} from θ_r and the averaged pseudo-gradient ``avg`` (used up) — the one outer
    step (:func:`~tensorturn.modes.fused.step.outer_step`) with the run's outer optimizer and,
    but for the last round, its broadcast codec: first the outer state and, in compressed runs,
    the broadcast delta, then θ_{r+1}, whose existence decides the round. θ_{r+1} is also left
    at ``scratch/next`` (without a ``scratch`` folder, one is made for the step). The shards
    ``check`` looked at are checked against θ_r's norm before anything is stored. θ_r and its
    outer state are read with ``fetch``; ``clock`` counts the step's computing time and values."""
    opts = options(spec)
    if opts.outer == "auto":  # start decides it before the spec is stored
        raise RuntimeError(f"run {spec.run_id}: its spec never decided --outer auto")
    if scratch is None:
        with tempfile.TemporaryDirectory(prefix="tt-outer-") as tmp:
            step_global(spec, recipe, store, r, avg, Path(tmp), check, fetch, clock)
        return
    run_id, codec = spec.run_id, opts.down_codec  # the broadcast's (the shards' files name their own)
    lr, momentum, nesterov = outer_args(spec)
    fetch = step_outputs.fetch(fetch)  # θ_r and its state as this agent's last step left them, if it took it
    theta_sha = fetch(store, layout.key("global", run_id, r), scratch / "theta")
    state_key = layout.key("outer", run_id, r)
    has_state = r > 0 and (bool(momentum) or (codec != "fp32" and store.exists(state_key)))
    if has_state:  # (no residual yet: a run from before)
        fetch(store, state_key, scratch / "state")
    compressed = codec != "fp32" and r + 1 < opts.rounds  # the final θ is kept exact
    meta = model_metadata(spec.recipe, recipe.default_config(), spec.recipe_options, spec.recipe_state)
    clock = clock if clock is not None else OuterClock()
    clock.values = sum(v.numel() for v in avg.values())
    with clock.counting():
        files = outer_step(scratch, scratch / "theta", scratch / "state" if has_state else None, avg,
                           Synchronous(lr, momentum, nesterov), meta, check,
                           Broadcast(codec, theta_sha) if compressed else None)
    avg.clear()
    for kind, path in (("outer", files.state), ("broadcast", files.broadcast), ("global", files.next)):
        if path is not None:  # θ_{r+1} last: the outer state of r+1 is stored before it decides the round
            key = layout.key(kind, run_id, r + 1)
            sha = seals.put_file(store, key, path)
            if kind != "broadcast":  # what this agent's next step reads
                step_outputs.keep(kind, key, path, sha)
