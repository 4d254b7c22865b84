"""Ensemble mode's Celery tasks: train a member's segment; and starting/resuming a run. The vote
that ends the run is :mod:`.vote`'s.

Both tasks run through the attempt protocol (:func:`tensorturn.tasks.attempt.execute`). The last
segment of a member includes its evaluation, so a member counts as finished only once it is
evaluated, and a recipe that fails there drops the member with its reason. So does a member that
diverged or evaluates to NaN (:func:`judge`): the ensemble's counterpart of fused mode rejecting a
non-finite or exploding update — a vote that counts a broken member is worse than one without it.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Collection
from typing import Any

import torch

from tensorturn import layout
from tensorturn.errors import SpecError
from tensorturn.modes.ensemble import all_finished, options
from tensorturn.modes.ensemble.vote import vote
from tensorturn.pool.capacity import queue_for
from tensorturn.pool.celery_app import app
from tensorturn.pool.telemetry import TaskReporter
from tensorturn.recipes import Recipe, load_splits, recipe_for, recipe_of
from tensorturn.spec import MemberState, Outcome, RunSpec, RunState
from tensorturn.state.board import RunBoard
from tensorturn.state.clock import broker_now
from tensorturn.state.live import live_field
from tensorturn.state.manifest import save_spec, try_write_manifest, write_manifest
from tensorturn.store import seals
from tensorturn.store.objects import Store, sha256_hex
from tensorturn.store.tensors import (
    from_bytes,
    load_optimizer_tensors,
    model_bytes,
    optimizer_tensors,
    to_bytes,
)
from tensorturn.tasks.attempt import LATE, SUCCEEDED, Unit, execute, signed, watch_cancelled
from tensorturn.train.device import pick_device, seed_global_generators
from tensorturn.train.loop import derive_seed, load_model, set_threads, train_steps

log = logging.getLogger(__name__)


def member_plan(spec: RunSpec, recipe: Recipe) -> list[dict[str, Any]]:
    """Each member's seed, model config and learning rate; a pure function of the spec."""
    opts = options(spec)
    base_lr = spec.lr or recipe.lr
    plan = []
    for m in range(opts.members or 0):
        seed = derive_seed(spec.seed, "member", m)
        variation = recipe.member_config(m, random.Random(seed)) if opts.diversity == "full" else {}
        lr_scale = float(variation.pop("lr_scale", 1.0))
        # fine-tuned from one model (--init-from): its architecture, whatever the draw says
        model = dict(opts.init_config) if opts.init_config is not None else {**recipe.default_config(), **variation}
        plan.append({"member": m, "seed": seed, "lr": base_lr * lr_scale,
                     "bootstrap": opts.bootstrap, "model": model})
    return plan


def pin_init(spec: RunSpec) -> None:
    """``--init-from RUN``: check RUN is a finished one-model run of this recipe, and write its
    model's configuration and sha256 into the spec (every member starts from those weights)."""
    from tensorturn.errors import NotFound
    from tensorturn.state.manifest import read_manifest
    from tensorturn.store.objects import ObjectMissing, open_store
    from tensorturn.store.tensors import stored_metadata

    opts = options(spec)
    source = opts.init_from
    if not source or opts.init_sha256:
        return
    store = open_store(spec.store_url)
    try:
        manifest = read_manifest(store, source, verify=True)
    except ObjectMissing:
        raise NotFound(f"--init-from {source}: no such run in the store (see `tensorturn runs`)") from None
    if manifest.get("mode") != "fused" or manifest.get("state") != RunState.SUCCEEDED:
        raise SpecError(f"--init-from {source}: members start from one finished model, and run "
                        f"{source} is a {manifest.get('state')} {manifest.get('mode')} run")
    source_spec = manifest.get("spec") or {}
    recipe, recipe_options = source_spec.get("recipe"), source_spec.get("recipe_options") or {}
    if recipe == "distill":  # a distilled student is a model of its ensemble's recipe
        recipe, recipe_options = recipe_options.get("recipe"), recipe_options.get("recipe_options") or {}
    if (recipe, recipe_options) != (spec.recipe, spec.recipe_options):
        raise SpecError(f"--init-from {source}: that run trained recipe {recipe!r} with options "
                        f"{recipe_options}, this ensemble {spec.recipe!r} with {spec.recipe_options}")
    meta = stored_metadata(store, layout.key("final_model", source))
    opts.init_config = json.loads(meta["config"])
    opts.init_sha256 = manifest["model_sha256"]


def _new_member(entry: dict[str, Any]) -> dict[str, Any]:
    return {"member": entry["member"], "state": MemberState.QUEUED, "config": entry, "metrics": {},
            "workers": [], "segments_done": 0, "reason": None}


# ---- start, dispatch, resume -------------------------------------------------------------------

def start(spec: RunSpec, store: Store, board: RunBoard, allow: Collection[str] = ()) -> None:
    """Record the run and its member plan, then queue every member's first segment (``allow``:
    recipe names allowed here besides the machine's allowlist, :func:`tensorturn.recipes.resolve`)."""
    recipe = recipe_for(spec, allow)
    plan = member_plan(spec, recipe)
    spec.settle_run_config(recipe)  # kept: its lr and batch, the members the pool sized, the dataset version pinned
    save_spec(store, spec)
    board.runs.create(spec)
    for entry in plan:
        board.members.record(spec.run_id, entry["member"], _new_member(entry))
    write_manifest(store, board, spec.run_id)
    for entry in plan:
        board.claims.claim(spec.run_id, layout.segment_claim(entry["member"], 0))
        queue_segment(spec, entry["member"], 0)


def queue_segment(spec: RunSpec, m: int, j: int) -> None:
    """Queue segment j of member m on the machines that can hold the model."""
    train_segment.apply_async((spec.run_id, m, j), signed(spec.run_id, str(layout.segment_label(m, j))),
                              queue=queue_for(spec.memory_needed_bytes))


def maybe_vote(spec: RunSpec, board: RunBoard) -> None:
    """Queue the vote once every member has finished (succeeded or dropped)."""
    if all_finished(spec, board):
        board.claims.once(spec.run_id, layout.VOTE_CLAIM, lambda: vote.apply_async(
            (spec.run_id,), signed(spec.run_id, str(layout.vote_label())),
            queue=queue_for(spec.memory_needed_bytes)))


def drop(spec: RunSpec, board: RunBoard, m: int, reason: str, task: str, worker: str | None) -> None:
    """Drop member m from the vote with ``reason``, and say so in a ``member_dropped`` incident —
    unless it already succeeded (a late give-up of a unit that another attempt finished must not
    undo it)."""
    if board.members.get(spec.run_id, m).get("state") not in (MemberState.SUCCEEDED, MemberState.DROPPED):
        board.members.update(spec.run_id, m, state=MemberState.DROPPED, reason=reason)
        board.incidents.add(spec.run_id, "member_dropped", task, worker, f"member {m} dropped: {reason}")
    board.member_done(spec.run_id, m)
    maybe_vote(spec, board)


def resume(spec: RunSpec, store: Store, board: RunBoard, allow: Collection[str] = ()) -> str:
    """Continue every unfinished member from its last checkpoint in the store (``allow``: as
    for :func:`start`)."""
    opts = options(spec)
    resumed = []
    for entry in member_plan(spec, recipe_for(spec, allow)):
        m = entry["member"]
        info = board.members.get(spec.run_id, m) or _new_member(entry)
        if info["state"] == MemberState.DROPPED and info.get("reason", "").startswith("missed the deadline"):
            board.member_done(spec.run_id, m)
            continue
        if info["state"] == MemberState.SUCCEEDED:
            board.member_done(spec.run_id, m)
            continue
        # a member dropped for failures gets another chance: the cause may be fixed
        board.members.undone(spec.run_id, m)
        stored = [j for j in range(opts.segments)
                  if store.exists(layout.key("segment", spec.run_id, m, j))]
        j = min(max(stored) + 1 if stored else 0, opts.segments - 1)
        board.members.record(spec.run_id, m, {**info, "state": MemberState.QUEUED, "reason": None,
                                              "segments_done": len(stored)})
        board.claims.claim(spec.run_id, layout.segment_claim(m, j))
        queue_segment(spec, m, j)
        resumed.append(f"member {m} at segment {j}")
    if not resumed:
        board.claims.release(spec.run_id, layout.VOTE_CLAIM)
        maybe_vote(spec, board)
    return "resumed " + (", ".join(resumed) if resumed else "the vote")


# ---- the segment -------------------------------------------------------------------------------

@app.task(bind=True, name="tensorturn.ensemble.train_segment", max_retries=None)
def train_segment(self, run_id: str, m: int, j: int, sig: str | None = None) -> dict[str, Any]:
    """Train segment j of member m from segment j−1's checkpoint; queue j+1 or finish m."""
    return execute(self, run_id, layout.segment_label(m, j), SegmentUnit, sig)


class SegmentUnit(Unit):
    def _last(self) -> bool:
        return self.a.label.numbers[1] == options(self.spec).segments - 1

    def done(self) -> bool:
        m, j = self.a.label.numbers
        state = self.board.members.get(self.spec.run_id, m).get("state")
        if state in (MemberState.DROPPED, MemberState.SUCCEEDED):
            return True
        return not self._last() and self.store.exists(layout.key("segment", self.spec.run_id, m, j))

    def run(self) -> str:
        spec, board, (m, j) = self.spec, self.board, self.a.label.numbers
        opts = options(spec)
        if opts.deadline is not None and broker_now(self.board.r) > spec.created_at + opts.deadline:
            drop(spec, board, m, f"missed the deadline ({opts.deadline:g}s) before {self.a.label}",
                 str(self.a.label), self.a.worker)
            return Outcome.REFUSED.says("past the deadline")
        info = board.members.get(spec.run_id, m)
        workers = info.get("workers", [])
        training = info.get("state") in (None, MemberState.QUEUED, MemberState.RUNNING)
        board.members.update(spec.run_id, m, state=MemberState.RUNNING if training else info["state"],
                             workers=workers if self.a.worker in workers else workers + [self.a.worker])
        outcome = SUCCEEDED
        if not self.store.exists(layout.key("segment", spec.run_id, m, j)):
            outcome = self._train(m, j)
        board.members.update(spec.run_id, m, segments_done=max(info.get("segments_done", 0), j + 1))
        if self._last():
            self._finish_member(m)
        return outcome

    def _train(self, m: int, j: int) -> str:
        spec, store = self.spec, self.store
        opts = options(spec)
        set_threads(spec.threads_per_task)
        recipe = recipe_of(spec)
        plan = member_plan(spec, recipe)[m]
        batch = spec.batch_for(recipe)
        reporter = TaskReporter(self.a.task, self.board.r, str(self.a.label), opts.segment_steps, batch,
                                live=(spec.run_id, live_field(self.a.label)))
        device = pick_device()
        splits = load_splits(recipe)
        if j == 0 and opts.init_from:
            blob = store.get_bytes(layout.key("final_model", opts.init_from))
            self.a.bytes_down += len(blob)
            if sha256_hex(blob) != opts.init_sha256:
                raise SpecError(f"the model of run {opts.init_from} changed since this ensemble "
                                f"started from it (sha256 {sha256_hex(blob)[:12]}…, not "
                                f"{opts.init_sha256[:12]}…)")
            model = load_model(recipe, from_bytes(blob), plan["model"], device)
        elif j == 0:
            seed_global_generators(plan["seed"])
            model = recipe.model(plan["model"]).to(device)
        else:
            blob = seals.get_bytes(store, layout.key("segment", spec.run_id, m, j - 1))
            self.a.bytes_down += len(blob)
            model = load_model(recipe, from_bytes(blob), plan["model"], device)
        opt = torch.optim.AdamW(model.parameters(), lr=plan["lr"], weight_decay=recipe.weight_decay)
        if j > 0:
            blob = seals.get_bytes(store, layout.key("optim", spec.run_id, m, j - 1))
            self.a.bytes_down += len(blob)
            load_optimizer_tensors(opt, from_bytes(blob))
        n = len(splits.y_train)
        if plan["bootstrap"]:
            rows = torch.randint(n, (n,), generator=torch.Generator().manual_seed(plan["seed"]))
        else:
            rows = torch.arange(n)
        self.a.trained_from = broker_now(self.board.r)
        train_steps(recipe, model, opt, splits.x_train, splits.y_train, rows, opts.segment_steps,
                    batch, derive_seed(plan["seed"], j), device, on_step=watch_cancelled(reporter, self.a, reporter),
                    precision=spec.precision, accumulate=spec.accumulate)
        optim_blob = to_bytes(optimizer_tensors(opt))
        weights = model_bytes({k: v.cpu() for k, v in model.state_dict().items()}, spec.recipe,
                              plan["model"], spec.recipe_options, spec.recipe_state)
        if store.exists(layout.key("segment", spec.run_id, m, j)):
            return LATE
        self.a.check_cancelled(now=True)
        # The optimizer state goes first: a stored checkpoint means the segment is complete.
        seals.put_bytes(store, layout.key("optim", spec.run_id, m, j), optim_blob)
        seals.put_bytes(store, layout.key("segment", spec.run_id, m, j), weights)
        self.a.bytes_up = len(optim_blob) + len(weights)
        self.a.rate = reporter.done()
        return SUCCEEDED

    def _finish_member(self, m: int) -> None:
        spec, store = self.spec, self.store
        recipe = recipe_of(spec)
        last = options(spec).segments - 1
        state = from_bytes(seals.get_bytes(store, layout.key("segment", spec.run_id, m, last)))
        metrics, unsound = judge(recipe, state, member_plan(spec, recipe)[m], pick_device(),
                                 spec.eval_batches)
        if unsound is None:
            self.board.members.update(spec.run_id, m, state=MemberState.SUCCEEDED, metrics=metrics)
            self.board.member_done(spec.run_id, m)
        else:  # judged on what training stored: another attempt would store the same
            drop(spec, self.board, m, unsound, str(self.a.label), self.a.worker)
        try_write_manifest(store, self.board, spec.run_id)

    def then(self) -> None:
        spec, (m, j) = self.spec, self.a.label.numbers
        if self.board.members.get(spec.run_id, m).get("state") in (MemberState.DROPPED, MemberState.SUCCEEDED):
            self.board.member_done(spec.run_id, m)  # (again: a crash may have come between)
            maybe_vote(spec, self.board)
        elif j + 1 < options(spec).segments:
            self.board.claims.once(spec.run_id, layout.segment_claim(m, j + 1),
                                   lambda: queue_segment(spec, m, j + 1))

    def give_up(self, message: str) -> None:
        drop(self.spec, self.board, self.a.label.numbers[0], message, str(self.a.label), self.a.worker)


# ---- judging a finished member -----------------------------------------------------------------

LEARNED_ACCURACY = 0.1  # how far above its untrained model's accuracy a member must be to be kept


def judge(recipe: Recipe, state: dict[str, torch.Tensor], plan: dict[str, Any],
          device: torch.device, eval_batches: int | None) -> tuple[dict[str, float], str | None]:
    """A finished member's metrics (``test_*``, and ``val_*`` where the recipe has validation
    rows), and why it must stay out of the vote — None when it is sound. Unsound, in this order:

    * weights that hold NaN or Inf;
    * a metric (the recipe's own ``evaluate``, on validation or test rows) that is NaN or Inf;
    * a member that diverged: its loss on the validation rows (the test rows where the recipe
      has none) is no lower than that of its untrained model — its architecture fresh from its
      seed, the weights a member without ``--init-from`` starts from.

    That bar is what any training must clear to have learned anything, so a sound member, even
    a weak or briefly trained one, is below it; a member a learning rate blew up is above it,
    confidently wrong — what spoils a vote. For classification an untrained model's loss is
    about ln(classes), the loss of guessing: digits-mlp members (validation loss, 2.30 untrained)
    end at 1.96–2.26 after 5 steps at the recipe's learning rate, at 2.8–8.3 after 60 steps at
    ``--lr 9.9`` (2.40 after 1,200); diabetes regression members at 0.67–0.87 after 60 steps
    (0.93–1.07 untrained), at 134–1,528 after 20 at ``--lr 9.9``. A member that collapsed to one constant guess
    lands near the bar on either side; in a soft vote it shifts every class alike. A
    fine-tuned member (``--init-from``) is held to the same random start, not to the model it
    was tuned from, which a sound member may end slightly worse than. The bar needs no other
    member (an ensemble whose members all diverged is judged as one with one diverged), and it
    is deterministic: one seed builds one untrained model on every machine. A recipe whose
    ``evaluate`` reports no ``loss`` is judged on finite weights and metrics alone, and a member
    whose loss is past the bar but whose accuracy is LEARNED_ACCURACY above the untrained model's
    (overfit: confident where wrong, yet mostly right) is kept; members a learning rate blew up
    stay near the untrained model's accuracy (digits at --lr 9.9: 0.10, chance for 10 classes)."""
    broken = next((name for name, v in state.items() if not bool(torch.isfinite(v).all())), None)
    if broken is not None:
        return {}, f"non-finite weights (NaN/Inf in {broken})"
    model = load_model(recipe, state, plan["model"], device)
    test = recipe.evaluate_split(model, "test", device, eval_batches)
    val = recipe.evaluate_split(model, "val", device, eval_batches)
    del model  # one model on the device at a time
    metrics = {**{f"val_{k}": v for k, v in val.items()}, **{f"test_{k}": v for k, v in test.items()}}
    broken = next((name for name, v in metrics.items() if not math.isfinite(v)), None)
    if broken is not None:
        return {}, f"evaluates to NaN/Inf (its {broken} is {metrics[broken]})"
    split, measured = ("val", val) if val else ("test", test)
    if "loss" in measured:
        base = recipe.evaluate_split(untrained_model(recipe, plan, device), split, device, eval_batches)
        bar = base["loss"]
        # an overfit member's loss can pass the bar while it still classifies well (kept): its
        # accuracy is LEARNED_ACCURACY above the untrained model's, where a diverged one's is not
        learned = ("accuracy" in measured
                   and measured["accuracy"] >= base.get("accuracy", math.inf) + LEARNED_ACCURACY)
        if math.isfinite(bar) and measured["loss"] >= bar and not learned:
            return {}, (f"diverged: its {split} loss {measured['loss']:.4g} is no lower than its "
                        f"untrained model's {bar:.4g}")
    return metrics, None


def untrained_model(recipe: Recipe, plan: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """Member ``plan``'s architecture initialised from its seed, as its first segment builds it
    (the global RNG is left as it was)."""
    with torch.random.fork_rng(devices=[]):
        seed_global_generators(plan["seed"])
        return recipe.model(plan["model"]).to(device)
