"""Submitting runs and following them: the functions behind ``tensorturn run`` and ``status``.

The CLI only parses options and calls these; tests and the serving API call them too.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from .capacity import check_fits, estimate
from .errors import NotFound, RecipeError, StoreError
from .recipes import Recipe, resolve
from .runs import FINISHED, RunBoard, RunSpec, check_broker, manifest_key
from .store import ObjectMissing, open_store
from .telemetry import list_workers

Update = Callable[[dict[str, Any]], None]


def submit(spec: RunSpec, broker_url: str) -> dict[str, Any]:
    """Validate everything a user can get wrong, then queue the run; returns its description.

    Nothing is queued unless the spec is valid, the recipe imports here, and both the broker and
    the store answer.
    """
    from .celery_app import configure

    spec.validate()
    recipe = resolve(spec.recipe, spec.recipe_options)
    client = check_broker(broker_url)
    store = open_store(spec.store_url)
    store.check()
    configure(broker_url)
    board = RunBoard(client)
    if spec.mode == "ensemble" and spec.members is None:  # one per online machine, at least 2
        spec.members = max(2, len(online_workers()))
        spec.validate()
    need = memory_needed(spec, recipe)
    check_fits(need, list_workers(client))
    spec.memory_needed_bytes = need["total_bytes"]
    if spec.mode == "fused":
        from . import fused

        fused.start(spec, store, board)
    else:
        from . import ensemble

        ensemble.start(spec, store, board)
    return board.describe(spec.run_id)


def resume(run_id: str, broker_url: str, store_url: str) -> tuple[dict[str, Any], str]:
    """Continue a run whose chain was lost (say Redis lost its data) from the store alone.

    Returns the run's description and a sentence on what was resumed.
    """
    from . import ensemble, fused
    from .celery_app import configure
    from .errors import SpecError
    from .runs import load_spec

    store = open_store(store_url)
    try:
        spec = load_spec(store, run_id)
    except ObjectMissing:
        raise NotFound(f"no run {run_id!r} in the store {store_url}") from None
    client = check_broker(broker_url)
    configure(broker_url)
    board = RunBoard(client)
    if board.exists(run_id):
        if board.state(run_id) == "succeeded":
            raise SpecError(f"run {run_id} already succeeded; nothing to resume")
        board.reopen(run_id)
    else:
        try:
            manifest = store.get_json(manifest_key(run_id))
        except ObjectMissing:
            manifest = None
        if manifest and manifest.get("state") == "succeeded":
            raise SpecError(f"run {run_id} already succeeded; nothing to resume")
        board.restore(spec, manifest)
    if spec.store_url != store.url:  # the store moved: tasks follow the one given here
        spec.store_url = store.url
        store.put_json(f"runs/{run_id}/spec.json", spec.to_json())
    what = (fused if spec.mode == "fused" else ensemble).resume(spec, store, board)
    return board.describe(run_id), what


def memory_needed(spec: RunSpec, recipe: Recipe) -> dict[str, Any]:
    """The memory estimate of the largest model the run trains (any ensemble member)."""
    from .ensemble import member_plan

    batch = spec.batch_size or recipe.batch_size
    configs = ([recipe.default_config()] if spec.mode == "fused"
               else [m["model"] for m in member_plan(spec, recipe)])
    try:
        return max((estimate(recipe, c, batch) for c in configs), key=lambda e: e["total_bytes"])
    except Exception as exc:  # noqa: BLE001 - the user's recipe failed; say so in one line
        raise RecipeError(f"recipe {spec.recipe!r} could not build its model to estimate its "
                          f"memory: {type(exc).__name__}: {exc}") from exc


def workers(broker_url: str) -> list[dict[str, Any]]:
    """The pool's agents with their inventory, live figures and state."""
    return list_workers(check_broker(broker_url))


def online_workers(timeout_s: float = 1.0) -> list[str]:
    """Names of the agents that answer a ping on the configured broker."""
    from .celery_app import app

    return sorted(name for reply in (app.control.ping(timeout=timeout_s) or []) for name in reply)


def wait(broker_url: str, run_id: str, on_update: Update | None = None,
         poll_s: float = 0.5, timeout_s: float | None = None) -> dict[str, Any]:
    """Poll the run until it finishes (or ``timeout_s`` passes); returns its description."""
    board = RunBoard(check_broker(broker_url))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        doc = board.describe(run_id)
        if on_update:
            on_update(doc)
        if doc["state"] in FINISHED or (deadline and time.monotonic() > deadline):
            return doc
        time.sleep(poll_s)


def describe(run_id: str, broker_url: str | None, store_url: str) -> dict[str, Any]:
    """A run's description from the broker, or from its manifest in the store when the broker
    has no record of it (for instance after an embedded run, whose Redis is gone)."""
    if broker_url:
        board = RunBoard(check_broker(broker_url))
        if board.exists(run_id):
            return board.describe(run_id)
    try:
        return open_store(store_url).get_json(manifest_key(run_id))
    except ObjectMissing:
        raise NotFound(f"no run {run_id!r} on the broker or in the store") from None


def list_runs(broker_url: str | None, store_url: str) -> list[dict[str, Any]]:
    """Runs known to the broker, else the manifests in the store; newest first."""
    if broker_url:
        return RunBoard(check_broker(broker_url)).list_runs()
    store = open_store(store_url)
    out = []
    for key in store.list("runs/"):
        if key.endswith("/manifest.json") and key.count("/") == 2:
            try:
                m = store.get_json(key)
            except StoreError:
                continue
            out.append({k: m.get(k) for k in ("run_id", "mode", "state", "recipe", "created_at",
                                              "finished_at", "metrics", "error")})
    return sorted(out, key=lambda m: m.get("created_at") or 0, reverse=True)
