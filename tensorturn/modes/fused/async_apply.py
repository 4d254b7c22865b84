"""``--sync async``: applying the stored updates, one at a time, and evaluating the rounds due.

Whoever holds the apply lock steps the latest weights by each stored update in arrival order,
with *delayed Nesterov, spread* (:func:`tensorturn.train.diloco.async_update`), tensor by tensor
through files, and commits each new version in one Redis script that checks it still holds the
lock (:meth:`~tensorturn.state.ledger.AsyncLedger.commit`). Every S versions the weights are
evaluated and recorded as a round; at R·S the run finishes like a synchronous one.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

from tensorturn import config, layout
from tensorturn.modes.fused.async_versions import (
    check_version_key,
    get_version,
    ledger,
    total_updates,
    trusted_latest,
    version_key,
)
from tensorturn.modes.fused.finalize import finalize
from tensorturn.modes.fused.options import eval_passes, evaluated, options, outer_args, samples_per_step
from tensorturn.modes.fused.step import Delayed, InputCheck, outer_step
from tensorturn.recipes import recipe_of
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.ledger import AsyncLedger, Fenced
from tensorturn.store import seals
from tensorturn.store.objects import Store
from tensorturn.store.tensorfile import TensorReader, delta_tensors
from tensorturn.store.tensors import model_metadata
from tensorturn.tasks.attempt import broker_time
from tensorturn.train.device import pick_device
from tensorturn.train.diloco import round_figures, staleness_scale
from tensorturn.train.loop import load_model, set_threads


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
                board.incidents.add(spec.run_id, "apply_fenced", f"u{exc.j}", worker, str(exc))
                break
        if not book.pending():
            break
    # evaluation outside the apply lock: updates keep being applied meanwhile
    with book.lock(worker, ttl, refresh, part="eval_lock") as token:
        if token is not None:  # again while versions land meanwhile: a drain that found this
            while True:        # lock held skipped evaluating them, and may have applied the last
                seen = book.latest()["version"]
                catch_up(spec, store, board, book)
                if board.runs.is_finished(spec.run_id) or book.latest()["version"] == seen:
                    break


def apply_one(spec: RunSpec, store: Store, board: RunBoard, book: AsyncLedger, j: int,
              token: str, worker: str) -> None:
    """Step the latest weights by update j — the one outer step
    (:func:`~tensorturn.modes.fused.step.outer_step`) with the
    :class:`~tensorturn.modes.fused.step.Delayed` rule, tensor by tensor through files — and
    commit the result as the next version."""
    opts = options(spec)
    recipe = recipe_of(spec)
    set_threads(spec.threads_per_task)
    latest = trusted_latest(spec, store, board, book, worker)
    v = latest["version"]
    lr, momentum, _ = outer_args(spec)
    nominal = opts.sync_every * samples_per_step(spec, recipe)
    with tempfile.TemporaryDirectory(prefix="tt-apply-") as tmp:
        scratch = Path(tmp)
        seals.get_file(store, layout.key("update", spec.run_id, j), scratch / "update")
        get_version(spec, store, latest, scratch / "theta")
        if latest["state_key"]:
            check_version_key(spec, "version_state", latest["state_key"], v)
            seals.get_file(store, latest["state_key"], scratch / "state")
        check = InputCheck(nominal, opts.max_update_ratio, "the applier")  # it trusts no other machine's arithmetic
        what = f"update u{j}"
        with TensorReader(scratch / "update") as upd:
            meta = upd.metadata
            samples, base = int(meta["samples"]), int(meta["base_version"])
            check.samples(what, samples)
            delta = dict(check.values(what, delta_tensors(upd)))
        weight = samples / (opts.shards * nominal) * staleness_scale(v - base, opts.shards)
        rule = Delayed(lr, momentum, weight, due=(v + 1) % opts.shards == 0, share=1 / opts.shards)
        meta_next = model_metadata(spec.recipe, recipe.default_config(), spec.recipe_options, spec.recipe_state)
        files = outer_step(scratch, scratch / "theta", scratch / "state" if latest["state_key"] else None,
                           delta, rule, meta_next, check)  # the update's norm checked before θ' is written
        suffix = token.rpartition(":")[2]
        key = layout.key("version", spec.run_id, v + 1, suffix)
        state_key = layout.key("version_state", spec.run_id, v + 1, suffix) if files.state is not None else ""
        if files.state is not None:
            seals.put_file(store, state_key, files.state)
        sha = seals.put_file(store, key, files.next)
        record = {"update": j, "version": v + 1, "base_version": base, "staleness": v - base,
                  "samples": samples, "loss": float(meta["loss"]), "weight": weight,
                  "trained_by": book.trainer(j), "applied_by": worker, "at": broker_time(),
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


def catch_up(spec: RunSpec, store: Store, board: RunBoard, book: AsyncLedger) -> None:
    """Evaluate every S-th version not recorded yet as a round (``--eval-every``: every so many
    such rounds, the others recorded with their training figures only); finish the run at R·S."""
    opts = options(spec)
    version = book.latest()["version"]
    recorded = {rec["round"] for rec in board.rounds.all(spec.run_id)}
    records = None
    for r in range(version // opts.shards):
        if r in recorded:
            continue
        records = records or book.applied()
        info = evaluate_round(spec, store, book, r, records, evaluated(spec, r))
        seals.put_json(store, layout.key("round", spec.run_id, r), info)
        board.record_round(spec.run_id, r, info)
    if version >= total_updates(spec) and not board.runs.is_finished(spec.run_id):
        finalize(spec, store, board, weights_key=lambda kept: version_key(spec, store, book, (kept + 1) * opts.shards))


def evaluate_round(spec: RunSpec, store: Store, book: AsyncLedger, r: int,
                   records: list[dict[str, Any]], evaluate: bool = True) -> dict[str, Any]:
    """Round r of an asynchronous run: the S updates that made versions rS+1 .. (r+1)S, and the
    weights after them on the validation split (unless not ``evaluate``)."""
    shards = options(spec).shards
    mine = [rec for rec in records if r * shards < rec["version"] <= (r + 1) * shards]
    val: dict[str, float] = {}
    rows = 0
    if evaluate:
        val, rows = validation(spec, store, book, (r + 1) * shards)
    info = round_figures([rec["loss"] for rec in mine], [rec["samples"] for rec in mine], val,
                         sum(rec["bytes_up"] for rec in mine), sum(rec["bytes_down"] for rec in mine), r,
                         rows)
    staleness = [rec["staleness"] for rec in mine]
    info.update(at=broker_time(), staleness=staleness, max_staleness=max(staleness, default=0),
                mean_staleness=sum(staleness) / max(len(staleness), 1))
    return info


def validation(spec: RunSpec, store: Store, book: AsyncLedger, version: int) -> tuple[dict[str, float], int]:
    """The weights of ``version`` on the validation split: (figures, rows read)."""
    recipe = recipe_of(spec)
    set_threads(spec.threads_per_task)
    with tempfile.TemporaryDirectory(prefix="tt-eval-") as tmp:
        path = Path(tmp) / "theta"
        seals.get_file(store, version_key(spec, store, book, version), path)
        with TensorReader(path) as f:
            theta = f.all()
    device = pick_device()
    model = load_model(recipe, theta, recipe.default_config(), device)
    return recipe.evaluate_counted(model, "val", device, eval_passes(spec, recipe))
