"""Ensemble mode: diverse full models trained independently on every machine, then a vote.

Each of M members gets its own seed, its own draw from the recipe's configuration space (width,
depth, dropout, learning rate for ``digits-mlp``) and, by default, its own bootstrap sample of the
training rows — diversity is what makes a vote beat its members (Dietterich 2000; Lakshminarayanan
et al. 2017, arXiv 1612.01474). Everything drawn is recorded per member in the manifest.

Guarantees:

* A member trains in segments chained through checkpoints in the store (weights and AdamW
  state), so a machine lost mid-member costs one segment; the next segment runs on any machine.
* A segment whose checkpoint exists is not trained again, and each next segment, like the vote,
  is queued once (guarded in Redis): duplicate or late attempts change nothing.
* A member whose segment fails ``max_attempts`` times, or that is still training at the
  deadline, drops out of the vote and the manifest says why; the run succeeds while at least
  ``min_members`` members finish.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import torch

from .artifact import Predictor
from .celery_app import app, forget_results
from .capacity import queue_for
from .device import pick_device
from .fused import _board, _describe_failure, _store, load_model, recipe_of
from .recipes import Recipe, load_splits, resolve
from .runs import RunBoard, RunSpec, load_spec, write_manifest
from .store import Store
from .tensors import (ensemble_bytes, from_bytes, load_optimizer_tensors, model_bytes,
                      optimizer_tensors, to_bytes)
from .telemetry import TaskReporter
from .training import derive_seed, set_threads, train_steps

log = logging.getLogger(__name__)


def segment_key(run_id: str, m: int, j: int) -> str:
    return f"runs/{run_id}/members/m{m:02d}/seg-{j:03d}.safetensors"


def optim_key(run_id: str, m: int, j: int) -> str:
    return f"runs/{run_id}/members/m{m:02d}/seg-{j:03d}.optim.safetensors"


def final_key(run_id: str) -> str:
    return f"runs/{run_id}/final/ensemble.safetensors"


def member_plan(spec: RunSpec, recipe: Recipe) -> list[dict[str, Any]]:
    """Each member's seed, model config and learning rate; a pure function of the spec."""
    base_lr = spec.lr or recipe.lr
    plan = []
    for m in range(spec.members or 0):
        seed = derive_seed(spec.seed, "member", m)
        variation = recipe.member_config(m, random.Random(seed)) if spec.diversity == "full" else {}
        lr_scale = float(variation.pop("lr_scale", 1.0))
        plan.append({"member": m, "seed": seed, "lr": base_lr * lr_scale,
                     "bootstrap": spec.bootstrap,
                     "model": {**recipe.default_config(), **variation}})
    return plan


def start(spec: RunSpec, store: Store, board: RunBoard) -> None:
    """Record the run and its member plan, then queue every member's first segment."""
    recipe = resolve(spec.recipe, spec.recipe_options)
    plan = member_plan(spec, recipe)
    store.put_json(f"runs/{spec.run_id}/spec.json", spec.to_json())
    board.create(spec)
    for entry in plan:
        board.record_member(spec.run_id, entry["member"], {
            "member": entry["member"], "state": "queued", "config": entry, "metrics": {},
            "workers": [], "segments_done": 0, "reason": None})
    write_manifest(store, board, spec.run_id)
    for entry in plan:
        queue_segment(spec, entry["member"], 0)


def queue_segment(spec: RunSpec, m: int, j: int) -> None:
    """Queue segment j of member m on the machines that can hold the model."""
    forget_results([train_segment.apply_async((spec.run_id, spec.store_url, m, j),
                                              queue=queue_for(spec.memory_needed_bytes))])


def queue_vote(spec: RunSpec) -> None:
    forget_results([vote.apply_async((spec.run_id, spec.store_url),
                                     queue=queue_for(spec.memory_needed_bytes))])


def _update_member(board: RunBoard, run_id: str, m: int, **fields: Any) -> None:
    info = board.member(run_id, m)
    info.update(fields)
    board.record_member(run_id, m, info)


def _drop(spec: RunSpec, board: RunBoard, m: int, reason: str) -> None:
    _update_member(board, spec.run_id, m, state="dropped", reason=reason)
    _member_finished(spec, board, m)


def _member_finished(spec: RunSpec, board: RunBoard, m: int) -> None:
    if board.member_done(spec.run_id, m) >= (spec.members or 0) and board.claim(spec.run_id, "vote"):
        queue_vote(spec)


@app.task(bind=True, name="tensorturn.ensemble.train_segment")
def train_segment(self, run_id: str, store_url: str, m: int, j: int) -> dict[str, int]:
    """Train segment j of member m from segment j−1's checkpoint; queue j+1 or finish m."""
    result = {"member": m, "segment": j}
    store, board = _store(store_url), _board()
    if board.state(run_id) in ("succeeded", "failed"):
        return result
    if board.member(run_id, m).get("state") == "dropped":
        return result
    spec = load_spec(store, run_id)
    task = f"m{m}/seg-{j}"
    worker = self.request.hostname or "?"
    begun = board.begin_attempt(run_id, task, worker, spec.max_attempts)
    if begun is None:
        _drop(spec, board, m, f"{task} failed {spec.max_attempts} attempts")
        return result
    attempt, n = begun
    if spec.deadline is not None and time.time() > spec.created_at + spec.deadline:
        board.finish_attempt(run_id, attempt, "refused: past the deadline")
        _drop(spec, board, m, f"missed the deadline ({spec.deadline:g}s) before {task}")
        return result
    info = board.member(run_id, m)
    workers = info.get("workers", [])
    _update_member(board, run_id, m, state="running",
                   workers=workers + [worker] if worker not in workers else workers)
    if store.exists(segment_key(run_id, m, j)):
        board.finish_attempt(run_id, attempt, "duplicate: checkpoint already stored")
    else:
        try:
            reporter = TaskReporter(self, board.r, task, spec.segment_steps,
                                    spec.batch_size or recipe_of(spec).batch_size)
            up, down = _train_segment(spec, store, m, j, reporter)
        except Exception as exc:  # noqa: BLE001 - recorded, then retried or dropped
            message = _describe_failure(exc, worker)
            board.finish_attempt(run_id, attempt, f"failed: {message}")
            if n < spec.max_attempts:
                raise self.retry(countdown=1, max_retries=None) from None
            _drop(spec, board, m, f"{task} failed {n} attempts; last: {message}")
            write_manifest(store, board, run_id)
            return result
        board.add_bytes(run_id, task, up, down)
        board.finish_attempt(run_id, attempt, "succeeded")
        reporter.done()
    _update_member(board, run_id, m, segments_done=j + 1)
    if j + 1 < spec.segments:
        if board.claim(run_id, f"m{m}/seg-{j + 1}"):
            queue_segment(spec, m, j + 1)
    else:
        _finish_member(spec, store, board, m)
    return result


def _train_segment(spec: RunSpec, store: Store, m: int, j: int,
                   on_step=None) -> tuple[int, int]:
    """Returns (bytes uploaded, bytes downloaded)."""
    set_threads(spec.threads_per_task)
    recipe = recipe_of(spec)
    plan = member_plan(spec, recipe)[m]
    device = pick_device()
    splits = load_splits(recipe)
    down = 0
    if j == 0:
        torch.manual_seed(plan["seed"])
        model = recipe.model(plan["model"]).to(device)
    else:
        blob = store.get_bytes(segment_key(spec.run_id, m, j - 1))
        down += len(blob)
        model = load_model(recipe, from_bytes(blob), plan["model"], device)
    opt = torch.optim.AdamW(model.parameters(), lr=plan["lr"], weight_decay=recipe.weight_decay)
    if j > 0:
        blob = store.get_bytes(optim_key(spec.run_id, m, j - 1))
        down += len(blob)
        load_optimizer_tensors(opt, from_bytes(blob))
    n = len(splits.y_train)
    if plan["bootstrap"]:
        rows = torch.randint(n, (n,), generator=torch.Generator().manual_seed(plan["seed"]))
    else:
        rows = torch.arange(n)
    train_steps(recipe, model, opt, splits.x_train, splits.y_train, rows, spec.segment_steps,
                spec.batch_size or recipe.batch_size, derive_seed(plan["seed"], j), device,
                on_step=on_step)
    optim_blob = to_bytes(optimizer_tensors(opt))
    weights = model_bytes({k: v.cpu() for k, v in model.state_dict().items()}, spec.recipe,
                          plan["model"], spec.recipe_options)
    # The optimizer state goes first: a stored checkpoint means the segment is complete.
    store.put_bytes(optim_key(spec.run_id, m, j), optim_blob)
    store.put_bytes(segment_key(spec.run_id, m, j), weights)
    return len(optim_blob) + len(weights), down


def _finish_member(spec: RunSpec, store: Store, board: RunBoard, m: int) -> None:
    recipe = recipe_of(spec)
    splits = load_splits(recipe)
    state = from_bytes(store.get_bytes(segment_key(spec.run_id, m, spec.segments - 1)))
    model = load_model(recipe, state, member_plan(spec, recipe)[m]["model"], torch.device("cpu"))
    test = recipe.evaluate(model, splits.x_test, splits.y_test)
    _update_member(board, spec.run_id, m, state="succeeded",
                   metrics={f"test_{k}": v for k, v in test.items()})
    write_manifest(store, board, spec.run_id)
    _member_finished(spec, board, m)


def vote_metrics(predictor: Predictor, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """The vote's accuracy and NLL beside the members' mean and best, and their disagreement."""
    labels, _, per_member = predictor.predict(x)
    mean = per_member.mean(0)
    nll = lambda p: float(torch.nn.functional.nll_loss(torch.log(p.clamp_min(1e-12)), y))  # noqa: E731
    member_acc = [float((p.argmax(-1) == y).float().mean()) for p in per_member]
    member_nll = [nll(p) for p in per_member]
    preds = per_member.argmax(-1)
    pairs = [(a, b) for a in range(len(preds)) for b in range(a + 1, len(preds))]
    disagreement = (sum(float((preds[a] != preds[b]).float().mean()) for a, b in pairs) / len(pairs)
                    if pairs else 0.0)
    return {
        "test_accuracy": float((labels == y).float().mean()),
        # NLL of the mean probability for both rules (hard votes have no calibrated probability)
        "test_loss": nll(mean),
        "member_mean_test_accuracy": sum(member_acc) / len(member_acc),
        "member_mean_test_loss": sum(member_nll) / len(member_nll),
        "best_member_test_accuracy": max(member_acc),
        "disagreement": disagreement,
    }


@app.task(bind=True, name="tensorturn.ensemble.vote")
def vote(self, run_id: str, store_url: str) -> dict[str, str]:
    """Merge the finished members into one ensemble file, evaluate the vote, finish the run."""
    store, board = _store(store_url), _board()
    if board.state(run_id) in ("succeeded", "failed"):
        return {"run_id": run_id}
    spec = load_spec(store, run_id)
    members = board.members(run_id)
    done = [e for e in members if e["state"] == "succeeded"]
    dropped = [e for e in members if e["state"] == "dropped"]
    if len(done) < spec.min_members:
        reasons = "; ".join(f"member {e['member']}: {e['reason']}" for e in dropped)
        board.fail(run_id, f"only {len(done)} of {spec.members} members finished "
                           f"(--min-members {spec.min_members}): {reasons}")
        write_manifest(store, board, run_id)
        return {"run_id": run_id}
    recipe = recipe_of(spec)
    entries = []
    for e in done:
        m = e["member"]
        state = from_bytes(store.get_bytes(segment_key(run_id, m, spec.segments - 1)))
        entries.append((m, state, e["config"]["model"]))
    blob = ensemble_bytes(entries, spec.recipe, spec.vote, spec.recipe_options)
    sha = store.put_bytes(final_key(run_id), blob)
    splits = load_splits(recipe)
    metrics = vote_metrics(Predictor.from_bytes(blob), splits.x_test, splits.y_test)
    metrics.update(members_succeeded=len(done), members_dropped=len(dropped))
    board.finish(run_id, "succeeded", metrics=metrics, model_uri=store.uri(final_key(run_id)),
                 model_sha256=sha)
    write_manifest(store, board, run_id)
    return {"run_id": run_id}


def resume(spec: RunSpec, store: Store, board: RunBoard) -> str:
    """Continue every unfinished member from its last checkpoint in the store."""
    recipe = resolve(spec.recipe, spec.recipe_options)
    resumed = []
    for entry in member_plan(spec, recipe):
        m = entry["member"]
        info = board.member(spec.run_id, m)
        if not info:
            info = {"member": m, "state": "queued", "config": entry, "metrics": {},
                    "workers": [], "segments_done": 0, "reason": None}
            board.record_member(spec.run_id, m, info)
        if info["state"] in ("succeeded", "dropped"):
            board.member_done(spec.run_id, m)
            continue
        stored = [j for j in range(spec.segments) if store.exists(segment_key(spec.run_id, m, j))]
        j = max(stored) + 1 if stored else 0
        _update_member(board, spec.run_id, m, segments_done=j)
        if j >= spec.segments:
            _finish_member(spec, store, board, m)
        else:
            board.claim(spec.run_id, f"m{m}/seg-{j}")
            queue_segment(spec, m, j)
            resumed.append(f"member {m} at segment {j}")
    if not resumed and board.claim(spec.run_id, "vote"):
        queue_vote(spec)
    return "resumed " + (", ".join(resumed) if resumed else "the vote")
