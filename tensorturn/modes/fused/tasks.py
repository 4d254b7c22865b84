"""The fused mode's entry points — start and resume a run — and the module Celery includes for
it: importing it registers the rounds' tasks (:mod:`.driver`) and, through the driver, the
asynchronous updates' (:mod:`.update`).

What every policy shares happens here (the options settled from the data and the plan —
:mod:`.plan`, from the pool's figures and θ_0's step timed here —, θ_0 and the spec stored,
the run on the board); then the driver queues the work the run's :class:`~.sync.base.SyncPolicy`
plans.
"""

from __future__ import annotations

from collections.abc import Collection

from tensorturn import layout
from tensorturn.modes.fused import driver
from tensorturn.modes.fused.options import options, settle_options
from tensorturn.modes.fused.timing import figures_or_reason
from tensorturn.modes.fused.weights import global_bytes
from tensorturn.recipes import recipe_for
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.manifest import save_spec, write_manifest
from tensorturn.store import seals
from tensorturn.store.objects import Store, sha256_hex
from tensorturn.train.diloco import initial_state


def _here() -> str:
    """The agent this start runs on (its Celery name), or this machine outside a task."""
    from celery import current_task

    return (current_task.request.hostname if current_task else None) or "this machine"


def start(spec: RunSpec, store: Store, board: RunBoard, allow: Collection[str] = ()) -> None:
    """Write the spec and initial weights, record the run, and let its sync policy queue the
    first work (``allow``: recipe names allowed here besides the machine's allowlist,
    :func:`tensorturn.recipes.resolve`)."""
    recipe = recipe_for(spec, allow)
    state = initial_state(recipe, spec.seed)
    figures, unplanned = figures_or_reason(spec, recipe, state, board.r, board.runs, _here()) \
        if options(spec).plan == "auto" else (None, None)
    warnings = [w for w in (unplanned,) if w] + settle_options(spec, recipe, figures)
    theta0 = global_bytes(spec, recipe, state)
    options(spec).init_sha256 = sha256_hex(theta0)  # machines rebuild θ_0 from the seed, verified
    spec.settle_run_config(recipe)  # kept: the shards, H and outer step chosen here too
    save_spec(store, spec)
    seals.put_bytes(store, layout.key("global", spec.run_id, 0), theta0)
    board.runs.create(spec)
    for warning in warnings:
        board.incidents.warn(spec.run_id, warning)
    write_manifest(store, board, spec.run_id)
    driver.start(spec, store, board)


def resume(spec: RunSpec, store: Store, board: RunBoard, allow: Collection[str] = ()) -> str:
    """Queue whatever is missing from the store (the run's sync policy knows what; it builds no
    recipe here, so ``allow`` is unused); says what it did."""
    return driver.resume(spec, store, board)
