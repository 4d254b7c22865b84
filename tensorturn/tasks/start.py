"""Setting a run up — the recipe built, the model checked against the pool, θ_0 stored, the first
work queued (:func:`start`) — and the task an idle agent does it in, for a submitter that loads no
torch (:func:`tensorturn.runs.submit.submit`)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from celery import Task

from tensorturn import config, layout, trust
from tensorturn.config import mask_text
from tensorturn.errors import RecipeError, SpecError, TensorTurnError
from tensorturn.pool.celery_app import app
from tensorturn.recipes import BUILTIN
from tensorturn.registry import get_mode
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import check_broker
from tensorturn.state.refusals import refuse
from tensorturn.state.roster import TAKES_TASKS
from tensorturn.store.objects import moved as store_moved
from tensorturn.tasks.attempt import agent_store, board_for
from tensorturn.trust import check_recipe_allowed

START_TASK = "tensorturn.start_run"  # the name the submitter sends it by


def start(spec: RunSpec, broker_url: str, store: Any, pool: list[dict[str, Any]],
          allow: Collection[str] = ()) -> None:
    """Build the recipe, fill what depends on the pool, check the model fits and the recipe keeps
    its contract (:func:`tensorturn.recipes.contract.check_contract`), store what the run starts
    from and queue its first work (on an agent, or in the submitting process). ``allow``: recipe
    names the submitting user allows here besides the machine's allowlist (an agent: none)."""
    from tensorturn.data.source import pinned
    from tensorturn.pool.capacity import check_fits
    from tensorturn.pool.celery_app import configure
    from tensorturn.recipes import recipe_for, resolve
    from tensorturn.recipes.contract import check_contract, check_fresh
    from tensorturn.recipes.learned import state_of

    with pinned(spec.datasets) as read:
        recipe = resolve(spec.recipe, spec.recipe_options, allow)
    spec.recipe_options.update(recipe.pinned_options())  # e.g. the dataset version it found
    # and the bytes of each dataset index it read: the index is not sealed (a push writes it, not
    # a run), so the signed spec holds its sha256 — a store writer cannot swap a run's chunks
    spec.datasets = read
    configure(broker_url)
    mode = get_mode(spec.mode)
    mode.prepare(spec, len([w for w in pool if w["state"] in TAKES_TASKS]))
    spec.validate()
    need = memory_needed(spec, recipe)
    check_fits(need, pool)  # first: a model too big for every machine is told so, whatever else
    check_contract(spec.recipe, recipe, "nothing was queued")
    # what raw_data learned (it ran here, for the checks above) is the run's, and every other
    # machine builds the recipe from it: its hooks are tried so, evaluation included, now
    try:
        spec.recipe_state = state_of(recipe)
    except RecipeError as exc:
        raise RecipeError(f"recipe {spec.recipe!r} failed at data: {exc}; nothing was queued") from None
    check_fresh(spec.recipe, recipe_for(spec, allow), "nothing was queued",
                getattr(spec.options, "vote", None))
    spec.memory_needed_bytes = need["total_bytes"]
    mode.start(spec, store, RunBoard(check_broker(broker_url)), allow)


def memory_needed(spec: RunSpec, recipe: Any) -> dict[str, Any]:
    """The memory estimate of the largest model the run trains (any ensemble member)."""
    from tensorturn.pool.capacity import estimate

    batch = spec.batch_for(recipe)
    try:
        configs = get_mode(spec.mode).model_configs(spec, recipe)
        return max((estimate(recipe, c, batch) for c in configs), key=lambda e: e["total_bytes"])
    except Exception as exc:  # noqa: BLE001 - the user's recipe failed; say so in one line
        raise RecipeError(f"recipe {spec.recipe!r} could not build its model to estimate its "
                          f"memory: {type(exc).__name__}: {exc}") from exc


@app.task(bind=True, name=START_TASK, ignore_result=True)
def start_run(self: Task, spec_json: Any, sig: str | None = None) -> None:
    """Build the recipe, check the model fits, store θ_0 and queue the first work; answers the
    submitter (on ``tt:run:<id>:started``) with the run id, or with the error a user should see
    and its exit code — then nothing was queued.

    Checked first, before anything is read or imported: the request is signed with the pool
    key, it names this agent's own store, and its recipe is one this agent allows. A request
    that is not signed writes nothing but its entry in ``tt:refused`` — not even an answer
    under the run id it names (anyone with the Redis password could choose that id); the
    submitter finds its refusal there (:func:`tensorturn.runs.submit.start_on_an_agent`)."""
    worker = self.request.hostname or "?"
    board = board_for(self.app.conf.broker_url)
    run_id = spec_json.get("run_id") if isinstance(spec_json, dict) else None
    key = trust.find_key()
    if not isinstance(run_id, str) or key is None or not key.verify("submit", spec_json, sig):
        reason = ("this agent has no pool key" if key is None else
                  f"missing or bad signature: the submitter and the agents must share the pool "
                  f"key (agent key {key.key_id})")
        refuse(board.r, worker, self.name, run_id, reason)
        return
    spec = RunSpec.from_json(spec_json)
    reply: dict[str, Any] = {"run_id": spec.run_id}
    if board.runs.exists(spec.run_id):  # a replayed request: a run starts once
        refuse(board.r, worker, self.name, run_id, "this run exists already (a replayed request?)")
        return
    before = store_moved()
    try:
        store = agent_store()
        if config.normalize_store_url(spec.store_url).rstrip("/") != store.url.rstrip("/"):
            raise SpecError(f"this pool's agents use the store {config.mask_url(store.url)}, not "
                            f"{config.mask_url(spec.store_url)}: submit with --store "
                            f"{config.mask_url(store.url)} (or --join-file)")
        if store.exists(layout.key("spec", spec.run_id)):  # replayed once its Redis record expired
            refuse(board.r, worker, self.name, run_id, "this run exists in the store already "
                                                        "(a replayed request?)")
            return
        check_recipe_allowed(spec.recipe, BUILTIN)
        start(spec, self.app.conf.broker_url, store, board.workers.all())
    except RecipeError as exc:
        reply = {"error": mask_text(f"{exc} (on worker {worker})"), "exit_code": exc.exit_code}
    except TensorTurnError as exc:
        reply = {"error": mask_text(str(exc)), "exit_code": exc.exit_code}
    except Exception as exc:  # noqa: BLE001 - a recipe's own failure, said in one line
        reply = {"error": mask_text(f"starting run {spec.run_id} failed on {worker}: "
                                    f"{type(exc).__name__}: {' '.join(str(exc).split())}"),
                 "exit_code": 2}
    if "error" not in reply:  # what starting moved (θ_0, the spec, the manifest), for the run
        after = store_moved()
        board.traffic.add_store_bytes(spec.run_id, after[0] - before[0], after[1] - before[1], worker)
    _answer(board, spec.run_id, reply)


def _answer(board: RunBoard, run_id: str, reply: dict[str, Any]) -> None:
    board.runs.answer_start(run_id, reply)  # read at once by the submitter; kept a while for nobody else
