"""Asynchronous fused runs (``--sync async``): no round barrier.

A run of R rounds × S shards queues R·S *updates* at once (label ``u<j>``: shard j mod S, the
seed of round j div S — the synchronous run's work, the same samples). Each worker trains its
update from the **latest** weights it can get, stores the pseudo-gradient, and queues it to be
applied (:class:`~.ledger.AsyncLedger`). Whoever holds the apply lock applies the stored updates
one at a time, in arrival order, with *delayed Nesterov, spread*
(:func:`tensorturn.train.diloco.async_update`: the momentum moves once per S updates, its movement
spread over the next S), so a fast machine never waits for a slow one. Every S versions the
weights are evaluated and recorded as a round; at R·S the run finishes like a synchronous one.

What it gives up: the result depends on timing — which version each update started from (its
*staleness*, recorded for every update) — so two runs with the same seed differ. ``--sync rounds``
stays the default and keeps its guarantee (the same weights on 1 or N machines).

Safety: an update is applied at most once and never lost. Its pseudo-gradient is stored before
it is queued for applying; the applier commits each new version in one Redis script that checks
it still holds the lock (:meth:`~.ledger.AsyncLedger.commit`), so an applier stopped past its
lock's time to live cannot commit (its objects carry its own token and are never pointed at);
and the task that queued an update returns only once it is applied (the run's last ones: once the
run is finished), trying for the lock meanwhile — so a machine killed while applying leaves tasks
waiting that take over when its lock runs out, and its own task is redelivered.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from tensorturn import config, layout
from tensorturn.modes.fused import backups
from tensorturn.modes.fused.ledger import AsyncLedger, Fenced
from tensorturn.pool.capacity import queue_for
from tensorturn.pool.celery_app import app, forget_results
from tensorturn.recipes import Recipe, recipe_of
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.store import seals
from tensorturn.store.objects import ObjectMissing, Store
from tensorturn.store.tensorfile import DTYPES, TensorReader, TensorWriter, delta_tensors
from tensorturn.store.tensors import StateDict, model_metadata
from tensorturn.tasks.attempt import SUCCEEDED, execute, signed
from tensorturn.train.device import pick_device
from tensorturn.train.diloco import async_update, check_norm, check_samples, finite_squares, round_figures
from tensorturn.train.loop import load_model, set_threads

log = logging.getLogger(__name__)

MOMENTUM, ACCUMULATED = "m::", "a::"  # the outer state's two parts, per tensor
APPLY_WAIT_S = 0.1  # how often a task whose update waits to be applied looks again


def ledger(board: RunBoard, run_id: str) -> AsyncLedger:
    return AsyncLedger(board.r, run_id)


def options(spec: RunSpec) -> Any:
    from tensorturn.modes.fused.tasks import options as fused_options

    return fused_options(spec)


def total_updates(spec: RunSpec) -> int:
    return options(spec).rounds * options(spec).shards


def start(spec: RunSpec, store: Store, board: RunBoard) -> None:
    """Version 0 is θ_0 (stored by the fused start); queue every update."""
    ledger(board, spec.run_id).init(layout.key("global", spec.run_id, 0), options(spec).init_sha256)
    queue_updates(spec, range(total_updates(spec)))


def queue_updates(spec: RunSpec, updates: Any) -> None:
    queue = queue_for(spec.memory_needed_bytes)
    run_id = spec.run_id
    sent = [async_step.s(run_id, j, **signed(run_id, str(layout.update_label(j))))
            .set(queue=queue).apply_async() for j in updates]
    forget_results(sent)


def read_log(spec: RunSpec, store: Store
             ) -> tuple[dict[str, Any], dict[int, str], dict[int, dict[str, Any]]]:
    """The versions committed, from the store's sealed log (read up to its first gap): (the
    latest, version → key, update → its record)."""
    entries = {}
    for key in store.list(layout.prefix("version_log", spec.run_id)):
        parts = layout.parse("version_log", key)
        if parts:
            entries[parts["version"]] = seals.get_json(store, key)
    versions = {0: layout.key("global", spec.run_id, 0)}
    applied: dict[int, dict[str, Any]] = {}
    latest = {"version": 0, "key": versions[0], "state_key": "", "sha256": options(spec).init_sha256}
    v = 1
    while v in entries:
        entry = entries[v]
        versions[v] = entry["key"]
        applied[entry["record"]["update"]] = entry["record"]
        latest = {"version": v, "key": entry["key"], "state_key": entry["state_key"],
                  "sha256": entry["sha256"]}
        v += 1
    return latest, versions, applied


def resume(spec: RunSpec, store: Store, board: RunBoard) -> str:
    """Rebuild the ledger from the store's log (the versions committed, in order), then queue
    every update not applied yet (those already stored are applied without training again)."""
    latest, versions, applied = read_log(spec, store)
    book = ledger(board, spec.run_id)
    book.restore(latest, versions, applied)
    for key in store.list(layout.prefix("round", spec.run_id)):
        parts = layout.parse("round", key)
        if parts and (parts["round"] + 1) * options(spec).shards <= latest["version"]:
            board.record_round(spec.run_id, parts["round"], seals.get_json(store, key))
    left = [j for j in range(total_updates(spec)) if j not in applied]
    queue_updates(spec, left or [total_updates(spec) - 1])  # none left: one task finishes the run
    return f"resumed asynchronously at version {latest['version']} of {total_updates(spec)}"


# ---- an update ---------------------------------------------------------------------------------

@app.task(bind=True, name="tensorturn.fused.async_update", max_retries=None)
def async_step(self, run_id: str, j: int, sig: str | None = None) -> dict[str, Any]:
    """Train update j from the latest weights, store it, and apply what is stored."""
    return execute(self, run_id, layout.update_label(j), UpdateUnit, sig)


@app.task(bind=True, name="tensorturn.fused.async_backup", max_retries=None)
def async_backup(self, run_id: str, j: int, sig: str | None = None) -> dict[str, Any]:
    """A backup copy of update j, queued when every update is handed out and j straggles: the
    first copy stored is applied, the other stops at its next look."""
    return execute(self, run_id, layout.update_backup_label(j), UpdateUnit, sig)


class UpdateUnit(backups.CopyAwareUnit):
    def done(self) -> bool:
        book = ledger(self.board, self.spec.run_id)
        return (book.is_applied(self.j) and not book.pending()
                and book.latest()["version"] < total_updates(self.spec))

    @property
    def j(self) -> int:
        return self.a.label.numbers[0]

    def run(self) -> str:
        from tensorturn.modes.fused.tasks import train_and_store

        spec, book = self.spec, ledger(self.board, self.spec.run_id)
        out_key = layout.key("update", spec.run_id, self.j)
        outcome = SUCCEEDED
        if not book.is_applied(self.j) and not book.stored(self.j):
            if not self.store.exists(out_key):
                r, k = divmod(self.j, options(spec).shards)

                def theta_of(recipe: Recipe) -> tuple[StateDict, int, dict[str, str]]:
                    book.start(self.j)
                    latest = trusted_latest(spec, self.store, self.board, book, self.a.worker)
                    theta, moved = fetch_version(spec, recipe, self.store, latest)
                    return theta, moved, {"base_version": f"{latest['version']:010d}"}

                outcome = train_and_store(self, r, k, theta_of, out_key, lambda: book.stored(self.j))
            if self.store.exists(out_key):  # this copy's, or another's: queued to be applied once
                book.push(self.j, self.a.worker, time.time())
        # Returns only once its update is applied (and, for the run's last, the run finished):
        # if the machine applying dies, its lock runs out and a waiting task takes over — with
        # no task left waiting, stored updates could stay unapplied and the run would hang.
        total = total_updates(spec)
        while True:
            drain(spec, self.store, self.board, self.a.worker)
            if self.board.is_finished(spec.run_id) or (
                    book.is_applied(self.j) and book.latest()["version"] < total):
                break
            time.sleep(APPLY_WAIT_S)
        try:  # only an optimisation: a failure here must not fail an update that is applied
            queue_backup(spec, self.board, book, self.a.worker)
        except Exception as exc:  # noqa: BLE001
            log.warning("run %s: no backup copy queued (%s)", spec.run_id, exc)
        return outcome



def queue_backup(spec: RunSpec, board: RunBoard, book: AsyncLedger, worker: str) -> None:
    """When every update is handed out and some still train, queue on this worker's own queue a
    backup copy of the update it would beat by most (:mod:`.backups`), once per update: it
    would otherwise idle until the run's slowest update is in. The copy trains from the latest
    weights (a different pseudo-gradient); whichever copy is stored first is the one applied."""
    if book.begun() < total_updates(spec):
        return
    running = []
    for a in board.attempts(spec.run_id):
        named = layout.parse_label(a["task"])
        if (named is not None and named.kind == "update" and a["outcome"] == "running"
                and not book.stored(named.numbers[0])):
            running.append(backups.Running(named.numbers[0], a["started_at"], a["worker"]))
    samples = options(spec).sync_every * (spec.batch_size or recipe_of(spec).batch_size)
    j = backups.pick(board, running, worker, samples)
    if j is None or not board.claim(spec.run_id, f"backup-u{j}"):
        return
    label = str(layout.update_backup_label(j))
    forget_results([async_backup.s(spec.run_id, j, **signed(spec.run_id, label))
                    .set(queue=layout.agent_queue(worker)).apply_async()])
    board.incident(spec.run_id, "backup_queued", label, worker,
                   f"every update is handed out and u{j} is still training: {worker} trains a "
                   f"backup copy, by its rate sooner")


# This process's latest weights per run: (version, sha256, θ).
_held: OrderedDict[str, tuple[int, str, StateDict]] = OrderedDict()


def fetch_version(spec: RunSpec, recipe: Recipe, store: Store, latest: dict[str, Any]
                  ) -> tuple[StateDict, int]:
    """The weights of ``latest`` (a version, checked by :func:`trusted_latest`), reusing those
    this process holds; (θ, bytes)."""
    from tensorturn.modes.fused.tasks import fetch_global

    held = _held.get(spec.run_id)
    if held and held[1] == latest["sha256"]:
        return held[2], 0
    if latest["version"] == 0:  # θ_0: rebuilt from the seed where it can be
        theta, moved = fetch_global(spec, recipe, store, 0)
    else:
        with tempfile.TemporaryDirectory(prefix="tt-version-") as tmp:
            path = Path(tmp) / "theta"
            get_version(spec, store, latest, path)
            with TensorReader(path) as f:
                theta = f.all()
            moved = path.stat().st_size
    _held[spec.run_id] = (latest["version"], latest["sha256"], theta)
    _held.move_to_end(spec.run_id)
    while len(_held) > 2:
        _held.popitem(last=False)
    return theta, moved


def trusted_latest(spec: RunSpec, store: Store, board: RunBoard, book: AsyncLedger, worker: str
                   ) -> dict[str, Any]:
    """The ledger's latest version once it checks out (:func:`check_version_key`, and the seal of
    its key vouching for its sha256). One that does not was written by someone with the broker's
    password but not the pool key: the ledger is put back from the store's sealed log, and the
    run carries on from there (an update in flight may be applied again: a lost update, never a
    foreign one)."""
    try:
        latest = book.latest()
        v = int(latest["version"])
        key = check_version_key(spec, "version", latest["key"], v)
        if key != layout.key("global", spec.run_id, 0):
            seals.check(store, key, latest["sha256"])  # a seal for that key and that hash
        if latest["state_key"]:
            check_version_key(spec, "version_state", latest["state_key"], v)
        if store.exists(layout.key("version_log", spec.run_id, v + 1)):  # rolled back
            raise seals.TamperedObject(f"the broker's latest version, v{v}, is older than the store's log")
        return latest
    except (seals.TamperedObject, ObjectMissing, RuntimeError, KeyError, ValueError) as exc:
        log_latest, versions, applied = read_log(spec, store)
        book.repair(log_latest, versions, applied)
        board.incident(spec.run_id, "ledger_repaired", "async", worker,
                       f"the broker's record of the latest weights did not check out ({exc}); "
                       f"put back from the store's log at version {log_latest['version']}")
        return log_latest


def get_version(spec: RunSpec, store: Store, latest: dict[str, Any], path: Path) -> None:
    """Download the weights of ``latest`` (the ledger's word, which lives on the broker) to
    ``path``, checked three ways: the key is this run's for that version, its bytes are the
    ones sealed under that key, and they hash to the ledger's sha256. Whoever can edit the
    broker's hash cannot point a run at another run's weights, nor at bytes no task stored."""
    v = int(latest["version"])
    key = check_version_key(spec, "version", latest["key"], v)
    if seals.get_file(store, key, path) != latest["sha256"]:
        raise seals.TamperedObject(f"{seals.describe(key)}: the broker's record of it names "
                                   f"another sha256; refused")


def version_key(spec: RunSpec, store: Store, book: AsyncLedger, version: int) -> str:
    """The key of ``version``'s weights: the ledger's, if it is that version of this run, else
    the store's sealed log's (the ledger's was written by someone without the pool key)."""
    try:
        return check_version_key(spec, "version", book.version_key(version), version)
    except (seals.TamperedObject, RuntimeError):
        return str(seals.get_json(store, layout.key("version_log", spec.run_id, version))["key"])


def check_version_key(spec: RunSpec, kind: str, key: str, version: int) -> str:
    """``key``, if it is a key of ``kind`` of this run for ``version`` (version 0 is θ_0)."""
    if version == 0 and kind == "version" and key == layout.key("global", spec.run_id, 0):
        return key
    parts = layout.parse(kind, str(key))
    if parts is None or parts["run_id"] != spec.run_id or parts["version"] != version:
        raise seals.TamperedObject(f"run {spec.run_id}: the broker names {key!r} as version "
                                   f"{version}'s weights, which is not that version of this run; refused")
    return key


# ---- applying ----------------------------------------------------------------------------------

def drain(spec: RunSpec, store: Store, board: RunBoard, worker: str) -> None:
    """Apply every stored update, one at a time, while this worker holds the apply lock (another
    worker holding it applies them instead, and looks again after letting go); then, under a
    lock of their own, evaluate the rounds due and finish the run when every update is in."""
    settings = config.current()
    book = ledger(board, spec.run_id)
    ttl, refresh = settings.visibility_timeout_s, settings.lease_refresh_s
    while True:
        with book.lock(worker, ttl, refresh) as token:
            if token is None:
                break
            try:
                while (j := book.next_pending()) is not None:
                    apply_one(spec, store, board, book, j, token, worker)
            except Fenced as exc:  # another applier took over: it carries on from the ledger
                board.incident(spec.run_id, "apply_fenced", f"u{exc.j}", worker, str(exc))
                break
        if not book.pending():
            break
    # evaluation outside the apply lock: updates keep being applied meanwhile
    with book.lock(worker, ttl, refresh, part="eval_lock") as token:
        if token is not None:
            catch_up(spec, store, board, book)


def apply_one(spec: RunSpec, store: Store, board: RunBoard, book: AsyncLedger, j: int,
              token: str, worker: str) -> None:
    """Step the latest weights by update j, tensor by tensor through files, and commit the
    result as the next version."""
    from tensorturn.modes.fused.tasks import _outer_args

    opts = options(spec)
    recipe = recipe_of(spec)
    set_threads(spec.threads_per_task)
    latest = trusted_latest(spec, store, board, book, worker)
    v = latest["version"]
    lr, momentum, _ = _outer_args(spec)
    nominal = opts.sync_every * (spec.batch_size or recipe.batch_size) * spec.accumulate
    with tempfile.TemporaryDirectory(prefix="tt-apply-") as tmp:
        scratch = Path(tmp)
        seals.get_file(store, layout.key("update", spec.run_id, j), scratch / "update")
        get_version(spec, store, latest, scratch / "theta")
        if latest["state_key"]:
            check_version_key(spec, "version_state", latest["state_key"], v)
            seals.get_file(store, latest["state_key"], scratch / "state")
        with TensorReader(scratch / "update") as upd:
            meta = upd.metadata
            delta = dict(delta_tensors(upd))
        samples, base = int(meta["samples"]), int(meta["base_version"])
        weight = samples / (opts.shards * nominal)
        due = (v + 1) % opts.shards == 0
        with TensorReader(scratch / "theta") as theta, \
                (TensorReader(scratch / "state") if latest["state_key"]
                 else contextlib.nullcontext()) as state:
            check_update_here(spec, j, delta, samples, nominal, theta)
            def step(name: str) -> tuple[torch.Tensor, Any, Any]:
                def part(prefix: str) -> torch.Tensor | None:
                    if state is None or prefix + name not in state.entries:
                        return None
                    return state.get(prefix + name)
                return async_update(theta.get(name), delta.get(name), part(MOMENTUM),
                                    part(ACCUMULATED), weight, lr, momentum, due, 1 / opts.shards)

            specs = {name: (DTYPES[e["dtype"]], e["shape"]) for name, e in theta.entries.items()}
            with TensorWriter(scratch / "next", specs, model_metadata(
                    spec.recipe, recipe.default_config(), spec.recipe_options)) as out:
                for name in out.order:
                    out.write(name, step(name)[0])
                out.close()
            if momentum:
                state_specs = {prefix + name: (torch.float32, specs[name][1])
                               for name in delta for prefix in (MOMENTUM, ACCUMULATED)}
                with TensorWriter(scratch / "next-state", state_specs) as out:
                    for entry in out.order:
                        prefix, name = entry[:3], entry[3:]
                        _, buf, acc = step(name)
                        value = buf if prefix == MOMENTUM else acc
                        out.write(entry, value if value is not None
                                  else torch.zeros(specs[name][1], dtype=torch.float32))
                    out.close()
        suffix = token.rpartition(":")[2]
        key = layout.key("version", spec.run_id, v + 1, suffix)
        state_key = layout.key("version_state", spec.run_id, v + 1, suffix) if momentum else ""
        if state_key:
            seals.put_file(store, state_key, scratch / "next-state")
        sha = seals.put_file(store, key, scratch / "next")
        record = {"update": j, "version": v + 1, "base_version": base, "staleness": v - base,
                  "samples": samples, "loss": float(meta["loss"]), "weight": weight,
                  "trained_by": book.trainer(j), "applied_by": worker, "at": time.time(),
                  "bytes_up": (scratch / "update").stat().st_size,
                  "bytes_down": int(meta["bytes_down"])}
    try:
        book.commit(token, v, key, state_key, sha, j, record)
    except Fenced:
        for stale in (key, state_key):
            if stale:
                with contextlib.suppress(Exception):
                    store.delete(stale)
        raise
    seals.put_json(store, layout.key("version_log", spec.run_id, v + 1), {
        "key": key, "state_key": state_key, "sha256": sha, "record": record})


def check_update_here(spec: RunSpec, j: int, delta: StateDict, samples: int, nominal: int,
                      theta: TensorReader) -> None:
    """The applier's own look at update j before it moves θ (the trainer looked before storing
    it; an applier trusts no other machine's arithmetic): its sample count, its values, its norm
    against the weights it steps."""
    what, by = f"update u{j}", "the applier"
    check_samples(what, samples, nominal, by)
    squares = sum(finite_squares(what, name, value, by) for name, value in delta.items())
    theta_squares = sum(float(theta.get(name).double().square().sum()) for name in delta)
    check_norm(what, squares, theta_squares, options(spec).max_update_ratio, by)


def catch_up(spec: RunSpec, store: Store, board: RunBoard, book: AsyncLedger) -> None:
    """Evaluate every S-th version not recorded yet as a round; finish the run at R·S."""
    from tensorturn.modes.fused.tasks import finalize

    opts = options(spec)
    version = book.latest()["version"]
    recorded = {rec["round"] for rec in board.rounds(spec.run_id)}
    records = None
    for r in range(version // opts.shards):
        if r in recorded:
            continue
        records = records or book.applied()
        info = evaluate_round(spec, store, book, r, records)
        seals.put_json(store, layout.key("round", spec.run_id, r), info)
        board.record_round(spec.run_id, r, info)
    if version >= total_updates(spec) and not board.is_finished(spec.run_id):
        finalize(spec, store, board, weights_key=lambda kept: version_key(spec, store, book, (kept + 1) * opts.shards))


def evaluate_round(spec: RunSpec, store: Store, book: AsyncLedger, r: int,
                   records: list[dict[str, Any]]) -> dict[str, Any]:
    """Round r of an asynchronous run: the S updates that made versions rS+1 .. (r+1)S, and the
    weights after them on the validation split."""
    shards = options(spec).shards
    mine = [rec for rec in records if r * shards < rec["version"] <= (r + 1) * shards]
    recipe = recipe_of(spec)
    set_threads(spec.threads_per_task)
    with tempfile.TemporaryDirectory(prefix="tt-eval-") as tmp:
        path = Path(tmp) / "theta"
        seals.get_file(store, version_key(spec, store, book, (r + 1) * shards), path)
        with TensorReader(path) as f:
            theta = f.all()
    device = pick_device()
    model = load_model(recipe, theta, recipe.default_config(), device)
    val = recipe.evaluate_split(model, "val", device, spec.eval_batches)
    info = round_figures([rec["loss"] for rec in mine], [rec["samples"] for rec in mine], val,
                         sum(rec["bytes_up"] for rec in mine), sum(rec["bytes_down"] for rec in mine), r)
    staleness = [rec["staleness"] for rec in mine]
    info.update(at=time.time(), staleness=staleness, max_staleness=max(staleness, default=0),
                mean_staleness=sum(staleness) / max(len(staleness), 1))
    return info
