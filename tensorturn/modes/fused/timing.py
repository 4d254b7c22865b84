"""A step of the run's model timed where its plan is made (:mod:`.plan`), and the figures the
plan reads from the pool gathered with it (:func:`plan_figures`).

θ_0's steps are timed on the agent that builds θ_0 (``tasks.start``): that machine has the
recipe's data and device ready, and a trainer of the pool has the same kind of figure from its
own shard tasks (``step_s``: :meth:`tensorturn.state.workers.Workers.step_time`), which wins where it
exists. The timing leaves the run untouched: its random generators are restored and θ_0 is
copied into a model of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import replace
from typing import Any

import torch

from tensorturn.errors import SpecError
from tensorturn.modes.fused.measured import outer_side, pool_machines
from tensorturn.modes.fused.options import STEP_GRID_S, PlanFigures, options, samples_per_step, step_matters
from tensorturn.modes.fused.plan import Machine, Plan
from tensorturn.recipes import Recipe
from tensorturn.spec import RunSpec
from tensorturn.state.runs import Runs
from tensorturn.store.tensors import StateDict, float_keys
from tensorturn.train.device import pick_device
from tensorturn.train.loop import load_model, set_threads, train_steps

log = logging.getLogger(__name__)

TIMED_STEPS = 3    # steps timed after one to warm up ...
TIMING_BUDGET_S = 2.0  # ... or fewer, once this long has gone (at least one)
# a warm-up step this long is the figure itself (a large model on a slow device: one more step
# would hold the run's start as long again); shorter, it is not one: a first step also allocates
# the optimizer's state and warms the device (85.5M values: 3.35 s for a 2.0 s step)
WARM_UP_ALONE_S = 30.0


class StepFailed(Exception):
    """θ_0's step, timed for the plan, failed (what the recipe raised, in a line) or ended an
    earlier try's process."""


def float_values(state: StateDict) -> int:
    """The values the codecs move: every float tensor's."""
    return sum(state[k].numel() for k in float_keys(state))


def time_step(spec: RunSpec, recipe: Recipe, theta: StateDict) -> float:
    """Seconds of one inner step of ``recipe``'s model from ``theta`` on this machine, at the
    run's batch, precision and threads: one step to warm up (its own time when it takes
    :data:`WARM_UP_ALONE_S` or more: a large model on a slow device), then up to
    :data:`TIMED_STEPS` within :data:`TIMING_BUDGET_S`, at least one (the testbed's step pacer
    applies, as in a shard task)."""
    device = pick_device()
    set_threads(spec.threads_per_task)
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        model = load_model(recipe, theta, recipe.default_config(), device)
        opt = torch.optim.AdamW(model.parameters(), lr=spec.lr or recipe.lr, weight_decay=recipe.weight_decay)
        x, y, rows = recipe.shard_data(0, options(spec).shards or 1, spec.seed)

        def step() -> None:
            train_steps(recipe, model, opt, x, y, rows, 1, spec.batch_for(recipe), spec.seed, device,
                        precision=spec.precision, accumulate=spec.accumulate)

        t0 = time.perf_counter()
        step()  # the first warms up; when it alone takes WARM_UP_ALONE_S, its time is the figure
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if time.perf_counter() - t0 >= WARM_UP_ALONE_S:
            return time.perf_counter() - t0
        t0, n = time.perf_counter(), 0
        while n < TIMED_STEPS and (n == 0 or time.perf_counter() - t0 < TIMING_BUDGET_S):
            step()
            n += 1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / n


def plan_figures(spec: RunSpec, recipe: Recipe, theta: StateDict, client: Any | None,
                 runs: Runs | None = None, worker: str = "?") -> PlanFigures:
    """What :func:`.options.make_plan` needs: the model's values, the pool's trainers (from broker
    ``client``; None: this machine alone) and a step's seconds: the trainers' own where every
    one has timed the recipe; else θ_0's step timed here — unless the plan chooses alike at any
    step time (:func:`.options.step_matters`: a small model whose H was given), when nothing is
    trained here and the plan predicts no utilisation. A step that fails here raises
    :class:`StepFailed`; so does a start that ``runs`` marks as timing it already — an earlier
    try whose process the step ended (:meth:`~tensorturn.state.runs.Runs.first_timing`)."""
    # the data's shards first (settle_options finds them set): θ_0's steps read one shard's rows
    options(spec).fill_from_data(recipe.train_rows(), samples_per_step(spec, recipe))
    machines, beside, notes = pool_machines(client, spec.recipe) if client is not None else ([], False, [])
    outer = None
    if machines:
        outer, said = outer_side(client, spec.recipe)
        notes.append(said)
    figures = PlanFigures(float_values(theta), None, tuple(machines), beside, outer=outer)
    if machines and all(m.step_s is not None for m in machines):
        step_s: float | None = min(m.step_s for m in machines if m.step_s is not None)
    elif step_matters(spec, recipe, figures):
        step_s = _timed_once(spec, recipe, theta, runs, worker)
        notes.append(f"a step of θ_0 timed on this machine: {step_s:.3g} s "
                     f"(batch {samples_per_step(spec, recipe)})")
    else:
        step_s = None
        notes.append(f"no step timed: the plan chooses alike at any step time from "
                     f"{STEP_GRID_S[0] * 1e3:g} ms to {STEP_GRID_S[-1]:g} s (so it predicts no utilisation)")
    if not machines:
        notes.append("no trainer in the pool yet: planned for this machine alone, its links loopback")
    return replace(figures, step_s=step_s, notes=tuple(notes))


def _timed_once(spec: RunSpec, recipe: Recipe, theta: StateDict, runs: Runs | None, worker: str) -> float:
    """:func:`time_step`, under ``runs``' mark for the run's start (when given): a start delivered
    again after its process died in this step does not take it again, and the mark goes once
    the step has ended either way. Raises :class:`StepFailed` saying what happened."""
    before = runs.first_timing(spec.run_id, worker) if runs is not None else None
    try:
        if before is not None:
            raise StepFailed(f"the plan's step of θ_0 ended its process on {before} (out of memory? killed?)")
        return time_step(spec, recipe, theta)
    except StepFailed:
        raise
    except Exception as exc:  # noqa: BLE001 — the recipe's own step: whatever it raises
        said = str(exc).strip().splitlines()
        what = f"{type(exc).__name__}: {said[0]}" if said else type(exc).__name__
        raise StepFailed(f"the plan could not time a step of θ_0 ({what})") from exc
    finally:
        if runs is not None:
            runs.timed(spec.run_id)  # this process lived through the step: no mark left behind


def figures_or_reason(spec: RunSpec, recipe: Recipe, theta: StateDict, client: Any | None,
                      runs: Runs | None = None, worker: str = "?") -> tuple[PlanFigures | None, str | None]:
    """:func:`plan_figures` at a run's start, or None and the warning to record where θ_0's
    step failed here, or ended an earlier try's process: the run starts with the fixed
    defaults (fp32, blocking rounds, the data's H), and its shard tasks meet the same failure
    where attempts, retries and logs account for it — a plan is an estimate, and never what
    fails a run."""
    try:
        return plan_figures(spec, recipe, theta, client, runs, worker), None
    except StepFailed as exc:
        log.warning("run %s: %s", spec.run_id, exc)
        return None, f"{exc}: the run starts with fp32, blocking rounds and the data's H"


def plan_for(spec: RunSpec, client: Any | None, local_workers: int, allow: Collection[str] = ()) -> Plan:
    """What ``--plan auto`` would choose for ``spec`` now (``run --plan-only``), made in this
    process — nothing queued, nothing stored: the recipe built here (``allow``: the names the
    user gave on this machine's command line), the data's shards and H, θ_0's step timed here
    unless every trainer of the pool on broker ``client`` has timed the recipe. Without a pool
    (``client`` None): the embedded pool's ``local_workers`` agents on this machine, loopback."""
    from tensorturn.data.source import pinned
    from tensorturn.modes.fused.options import make_plan
    from tensorturn.recipes import resolve
    from tensorturn.train.diloco import initial_state

    with pinned(spec.datasets):
        recipe = resolve(spec.recipe, spec.recipe_options, allow)
    state = initial_state(recipe, spec.seed)
    figures = plan_figures(spec, recipe, state, client)
    if client is None:
        local = tuple(Machine(f"local-{i + 1}") for i in range(local_workers))
        notes = tuple(n for n in figures.notes if not n.startswith("no trainer"))
        figures = replace(figures, machines=local, notes=(
            *notes, f"an embedded pool of {local_workers} agents on this machine: links loopback"))
    return make_plan(spec, recipe, figures)


def replan(spec: RunSpec, client: Any, allow: Collection[str] = ()) -> str:
    """``resume --replan``: the plan made again for a stopped run from today's figures — the
    pool's links and step times on broker ``client``, θ_0's step timed here where a trainer has
    none — for what TensorTurn chose at start (:meth:`.options.FusedOptions.replan`); the next
    round the resume queues uses it. Returns a sentence on what changed."""
    from tensorturn.modes.fused.options import make_plan
    from tensorturn.recipes import recipe_for
    from tensorturn.train.diloco import initial_state

    opts = options(spec)
    if opts.plan != "auto":
        raise SpecError(f"run {spec.run_id} was started with --plan off: there is no plan to make "
                        f"again (resume it without --replan)")
    recipe = recipe_for(spec, allow)
    figures = plan_figures(spec, recipe, initial_state(recipe, spec.seed), client)
    before = dict(opts.planned)
    # the policy and the shards stay: planned around them
    opts.planned = {**before, "shards_fixed": True, "chose": [c for c in opts.plan_chose if c != "sync"]}
    planned = make_plan(spec, recipe, figures)
    opts.planned = before
    if "sync" in opts.plan_chose:
        planned.why = [f"sync {opts.sync}: kept from the run's start (a run changes its policy only "
                       f"when started again)" if w == f"sync {opts.sync}: given" else w for w in planned.why]
    changed = opts.replan(planned)
    what = "; ".join(changed) or "nothing changed"
    predicted = planned.predicted_utilisation
    return (f"planned again from today's figures: {what}"
            + (f" (predicted utilisation {predicted:.2f})" if predicted is not None else ""))
