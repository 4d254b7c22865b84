"""Submitting runs and following them: the functions behind ``tensorturn run``, ``status``,
``runs``, ``resume`` and ``workers``.

The CLI only parses options and calls these; tests and benchmarks call them too. Nothing here
imports torch, Celery or boto3 until a function needs them: ``runs`` and ``status`` answer at
once, and a bad option or recipe name is refused before anything heavy loads.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tensorturn import config, layout
from tensorturn.errors import BrokerError, NotFound, RecipeError, SpecError, StoreError, TensorTurnError
from tensorturn.spec import FINISHED, RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import check_broker

Update = Callable[[dict[str, Any]], None]


def validate(spec: RunSpec) -> None:
    """Everything about a spec that can be checked without torch, a broker or a store."""
    from tensorturn.recipes import check_name

    spec.validate()
    check_name(spec.recipe)


START_TASK = "tensorturn.start_run"
START_WAIT_S = 300.0  # how long `run` waits for an agent to prepare the run before giving up


def submit(spec: RunSpec, broker_url: str, here: bool = False) -> dict[str, Any]:
    """Validate everything a user can get wrong, then queue the run; returns its description.

    Nothing is queued unless the spec is valid, the recipe builds, both the broker and the store
    answer, and some connected machine can hold the model. Building the recipe, the memory check
    and θ_0 need torch: when the pool has an idle agent (torch and the recipes already loaded),
    that agent does them (:func:`start`, in the ``tensorturn.start_run`` task) and this process
    never loads torch; otherwise, or with ``here``, they run in this process.
    """
    from tensorturn import trust
    from tensorturn.state.roster import list_workers
    from tensorturn.store.objects import open_store

    validate(spec)
    trust.pool_key()  # one clear error now rather than a refusal from every agent
    client = check_broker(broker_url)
    store = open_store(spec.store_url)
    store.check()
    pool = list_workers(client)
    if not here and any(w["state"] == "idle" for w in pool):
        return start_on_an_agent(spec, broker_url)
    # built here: the recipe this user named on this machine is theirs to import here
    config.use(trust.with_allowed(config.current(), [spec.recipe]))
    start(spec, broker_url, store, pool)
    return RunBoard(client).describe(spec.run_id)


def start(spec: RunSpec, broker_url: str, store: Any, pool: list[dict[str, Any]]) -> None:
    """Build the recipe, fill what depends on the pool, check the model fits and the recipe keeps
    its contract (:func:`tensorturn.recipes.check.check_contract`), store what the run starts
    from and queue its first work (on an agent, or in the submitting process)."""
    from tensorturn.modes import get_mode
    from tensorturn.pool.capacity import check_fits
    from tensorturn.pool.celery_app import configure
    from tensorturn.recipes import resolve
    from tensorturn.recipes.check import check_contract

    recipe = resolve(spec.recipe, spec.recipe_options)
    spec.recipe_options.update(recipe.pinned_options())  # e.g. the dataset version it found
    configure(broker_url)
    mode = get_mode(spec.mode)
    mode.prepare(spec, len([w for w in pool if w["state"] in ("idle", "busy")]))
    spec.validate()
    need = memory_needed(spec, recipe)
    check_fits(need, pool)  # first: a model too big for every machine is told so, whatever else
    check_contract(spec.recipe, recipe, "nothing was queued")
    spec.memory_needed_bytes = need["total_bytes"]
    mode.start(spec, store, RunBoard(check_broker(broker_url)))


def start_on_an_agent(spec: RunSpec, broker_url: str) -> dict[str, Any]:
    """Have an idle agent :func:`start` the run, and wait for its answer: the run's description,
    or the error it met, raised here with its exit code (nothing is queued then)."""
    from tensorturn.pool import remote_control
    from tensorturn.pool.celery_app import app, configure

    configure(broker_url)
    client = check_broker(broker_url)
    # the answer comes back on a Redis list of the run's (no Celery result, no subscription)
    from tensorturn import trust

    doc = spec.to_json()
    sent = app.send_task(START_TASK, args=[doc], kwargs={"sig": trust.pool_key().sign("submit", doc)},
                         queue=layout.DEFAULT_QUEUE, ignore_result=True)
    reply = start_answer(client, spec.run_id)
    if reply is None:
        remote_control.send(app, "revoke", {"task_id": sent.id})  # signed: agents refuse others
        raise BrokerError(f"no agent started run {spec.run_id} within {START_WAIT_S:.0f}s (every "
                          f"agent busy?); nothing was queued, try again")
    if "error" in reply:
        error = TensorTurnError(reply["error"])
        error.exit_code = int(reply.get("exit_code", 2))
        raise error
    return RunBoard(client).describe(spec.run_id)


def start_answer(client: Any, run_id: str) -> dict[str, Any] | None:
    """An agent's answer to the request to start ``run_id``, or its refusal of the request's
    signature — kept only in ``tt:refused``, as every refusal is; None after START_WAIT_S."""
    import json

    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        answer = client.blpop([layout.run_key(run_id, "started")], timeout=1)
        if answer is not None:
            return json.loads(answer[1])
        for raw in client.lrange(layout.REFUSED, 0, -1):
            try:
                entry = json.loads(raw)
            except ValueError:  # not an agent's: anyone with the password can write there
                continue
            if isinstance(entry, dict) and entry.get("run_id") == run_id \
                    and entry.get("task") == START_TASK:
                return {"error": f"agent {entry.get('worker')} refused run {run_id}: "
                                 f"{entry.get('reason')}", "exit_code": 2}
    return None


def memory_needed(spec: RunSpec, recipe: Any) -> dict[str, Any]:
    """The memory estimate of the largest model the run trains (any ensemble member)."""
    from tensorturn.modes import get_mode
    from tensorturn.pool.capacity import estimate

    batch = spec.batch_size or recipe.batch_size
    try:
        configs = get_mode(spec.mode).model_configs(spec, recipe)
        return max((estimate(recipe, c, batch) for c in configs), key=lambda e: e["total_bytes"])
    except Exception as exc:  # noqa: BLE001 - the user's recipe failed; say so in one line
        raise RecipeError(f"recipe {spec.recipe!r} could not build its model to estimate its "
                          f"memory: {type(exc).__name__}: {exc}") from exc


def resume(run_id: str, broker_url: str, store_url: str) -> tuple[dict[str, Any], str]:
    """Continue a run whose chain was lost (Redis lost its data, the embedded pool was stopped)
    or that failed and whose cause is fixed, from the store alone.

    Returns the run's description and a sentence on what was resumed.
    """
    from tensorturn.modes import get_mode
    from tensorturn.pool.celery_app import configure
    from tensorturn.state.manifest import load_spec, save_spec, try_write_manifest
    from tensorturn.store.objects import ObjectMissing, open_store

    store = open_store(store_url)
    try:
        spec = load_spec(store, run_id)
    except ObjectMissing:
        raise NotFound(f"no run {run_id!r} in the store {config.mask_url(store_url)}") from None
    client = check_broker(broker_url)
    configure(broker_url)
    board = RunBoard(client)
    if board.exists(run_id):
        if board.state(run_id) == "succeeded":
            raise SpecError(f"run {run_id} already succeeded; nothing to resume")
        board.reopen(run_id)
    else:  # lost, or partly: what is left of the chain (queued, or written since) goes first
        manifest = _manifest(store, run_id)
        if manifest and manifest.get("state") == "succeeded":
            raise SpecError(f"run {run_id} already succeeded; nothing to resume")
        drop_queued(client, run_id)
        board.restore(spec, manifest)
    if spec.store_url != store.url:  # the store moved: tasks follow the one given here
        spec.store_url = store.url
        save_spec(store, spec)
        board.update_spec(spec)
    try:
        what = get_mode(spec.mode).resume(spec, store, board)
    except Exception as exc:
        # reopened but nothing queued: say so on the run rather than leave it `running`
        board.fail(run_id, f"resume failed: {type(exc).__name__}: {exc}; try "
                           f"`tensorturn resume {run_id}` again once the cause is fixed")
        try_write_manifest(store, board, run_id)
        raise
    return board.describe(run_id), what


CANCEL_WAIT_S = 30.0  # how long `cancel` waits for running attempts to stop before it answers


def cancel(run_id: str, broker_url: str, store_url: str, by: str,
           wait_s: float = CANCEL_WAIT_S) -> tuple[dict[str, Any], str]:
    """Cancel a live run: it is ``cancelled`` at once, its queued task messages are dropped, and
    its running attempts stop at their next look (about a second) and store nothing; then
    its manifest is saved. Returns the run's description and a sentence on what happened.

    ``resume`` continues a cancelled run from its last complete round or checkpoints."""
    from tensorturn.state.manifest import try_write_manifest
    from tensorturn.store.objects import open_store

    client = check_broker(broker_url)
    board = RunBoard(client)
    if not board.exists(run_id):
        raise NotFound(board.absent(run_id))
    if not board.cancel(run_id, by):
        state = board.state(run_id)
        if state == "cancelled":
            return board.describe(run_id), f"run {run_id} was cancelled already"
        raise SpecError(f"run {run_id} has {state}: there is nothing to cancel")
    dropped = drop_queued(client, run_id)
    deadline = time.monotonic() + wait_s
    running = _running_attempts(board, run_id)
    while running and time.monotonic() < deadline:
        time.sleep(0.25)
        running = _running_attempts(board, run_id)
    try_write_manifest(open_store(store_url), board, run_id)
    what = f"run {run_id} cancelled; {dropped} queued task{'s' * (dropped != 1)} dropped"
    if running:  # their machines stopped answering: those attempts end when the machine does
        what += (f"; {len(running)} attempt{'s' * (len(running) != 1)} still marked running "
                 f"({', '.join(a['task'] + ' on ' + a['worker'] for a in running)}): "
                 f"nothing they finish is used")
    return board.describe(run_id), what


def _running_attempts(board: RunBoard, run_id: str) -> list[dict[str, Any]]:
    return [a for a in board.attempts(run_id) if a["outcome"] == "running"]


def drop_queued(client: Any, run_id: str) -> int:
    """Remove the run's task messages waiting in any TensorTurn queue; returns how many. Those
    already handed to an agent are dropped by the agent (a finished run's task does nothing)."""
    dropped = 0
    for queue in layout.task_queues(client):
        for raw in client.lrange(queue, 0, -1):
            if run_id in (layout.task_args(raw) or []):
                dropped += int(client.lrem(queue, 1, raw))
    return dropped


def _manifest(store: Any, run_id: str) -> dict[str, Any] | None:
    from tensorturn.state.manifest import read_manifest
    from tensorturn.store.objects import ObjectMissing

    try:
        return read_manifest(store, run_id)
    except ObjectMissing:
        return None


def refusals(broker_url: str) -> tuple[int, list[dict[str, Any]]]:
    """How many task messages agents refused (bad signatures, and the like) since the broker
    started, and the last hundred of them, newest first. The count is kept apart from the list
    so that a flood of refusals cannot hide how many there were, or that the first ones came."""
    import json

    pipe = check_broker(broker_url).pipeline(transaction=False)
    pipe.get(layout.REFUSED_TOTAL)
    pipe.lrange(layout.REFUSED, 0, -1)
    total, raw = pipe.execute()
    last = []
    for text in raw:
        try:
            entry = json.loads(text)
        except ValueError:  # not an agent's: anyone with the password can write there
            continue
        if isinstance(entry, dict):
            last.append(entry)
    return max(int(total) if str(total or "").isdigit() else 0, len(last)), last


def workers(broker_url: str) -> list[dict[str, Any]]:
    """The pool's agents with their inventory, live figures and state; one offline for longer
    than ``TENSORTURN_AGENT_TTL_S`` is forgotten (:mod:`tensorturn.state.housekeeping`), not listed."""
    from tensorturn.state.housekeeping import forgotten
    from tensorturn.state.roster import list_workers

    return [w for w in list_workers(check_broker(broker_url)) if not forgotten(w)]


def prune(broker_url: str) -> dict[str, Any]:
    """Prune the broker's leftovers now (:func:`tensorturn.state.housekeeping.prune`)."""
    from tensorturn.state.housekeeping import prune as prune_now

    return prune_now(check_broker(broker_url))


SETTLE_S = 10.0  # how long a finished run's attempts still running on live machines are awaited


def wait(broker_url: str, run_id: str, on_update: Update | None = None,
         poll_s: float = 0.5, timeout_s: float | None = None) -> dict[str, Any]:
    """Poll the run until it finishes (or ``timeout_s`` passes); returns its description.

    A finished run is returned once its records are complete: the task that finishes a run
    records its own attempt and figures with the state, but others can still be running then
    (a backup copy stopping, an asynchronous update's task, a cancelled run's attempts), and
    are awaited up to SETTLE_S while their machines are live. A failed run is returned at once:
    its error matters more than shards that may train on for minutes."""
    board = RunBoard(check_broker(broker_url))
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    settle_by = None
    while True:
        try:
            doc = annotate(board.describe(run_id), board)
        except NotFound:
            raise BrokerError(f"the broker lost run {run_id}'s records while it ran (Redis "
                              f"restarted without its data, or its keys were deleted?); the "
                              f"finished work is in the store: continue with `tensorturn "
                              f"resume {run_id}`") from None
        if on_update:
            on_update(doc)
        if doc["state"] in FINISHED:
            settle_by = settle_by or time.monotonic() + SETTLE_S
            if (doc["state"] == "failed" or time.monotonic() >= settle_by
                    or not running_on_live_workers(doc, board)):
                return doc
        elif deadline and time.monotonic() > deadline:
            return doc
        time.sleep(poll_s)


def running_on_live_workers(doc: dict[str, Any], board: RunBoard) -> list[dict[str, Any]]:
    """The run's attempts still running on an agent that is online (one on a machine that
    stopped answering was lost with it)."""
    from tensorturn.state.roster import list_workers

    running = [a for a in doc.get("attempts", []) if a["outcome"] == "running"]
    if not running:
        return []
    live = {w["name"] for w in list_workers(board.r) if w["state"] in ("idle", "busy")}
    return [a for a in running if a["worker"] in live]


def annotate(doc: dict[str, Any], board: RunBoard | None = None) -> dict[str, Any]:
    """Add ``note`` to a live run that has made no progress for ``TENSORTURN_STALL_S``
    seconds, saying what it waits for. A run with an attempt running on a live agent is not
    stalled: the note then says which outer step (or the vote) is doing what, and for how long."""
    from tensorturn.pool.capacity import why_unheld
    from tensorturn.state.roster import list_workers

    if doc.get("state") in FINISHED or not doc.get("progress_at"):
        return doc
    now = time.time()
    idle = now - float(doc["progress_at"])
    if idle < config.current().stall_s:
        return doc
    why = "its tasks are queued but no attempt started or finished"
    if board is not None:
        running = running_on_live_workers(doc, board)
        silent = _silent_training(running, board.live(doc["run_id"]), now) if running else []
        if running and not silent:  # work goes on, only nothing started or finished lately
            for o in doc.get("outer_steps") or []:
                doc["note"] = (f"round {o['round']}'s outer step is {o['phase']} on {o['worker']} "
                               f"({now - o['since']:.0f}s)")
            for a in running:
                if a["task"] == str(layout.vote_label()):
                    doc["note"] = f"the vote is running on {a['worker']} ({now - a['started_at']:.0f}s)"
            return doc
        if silent:
            task, worker, quiet = silent[0]
            doc["note"] = (f"no progress for {idle:.0f}s: {task} on {worker} has reported no "
                           f"training step for {quiet:.0f}s (a slow download, or stuck?)")
            return doc
        pool = list_workers(board.r)
        if not pool:
            why = "no agent is online to take its tasks"
        else:  # a machine that could hold it may join: the run waits, and says so
            why = why_unheld((doc.get("spec") or {}).get("memory_needed_bytes"), pool) or why
    failed = [a for a in doc.get("attempts", []) if a["outcome"].startswith("failed")]
    if failed:
        why += f"; the last failure: {failed[-1]['task']} {failed[-1]['outcome']}"
    doc["note"] = f"no progress for {idle:.0f}s: {why}"
    return doc


TRAINING_KINDS = ("shard", "backup", "update", "update_backup", "segment")  # they report steps


def _silent_training(running: list[dict[str, Any]], entries: dict[str, dict[str, Any]],
                     now: float) -> list[tuple[str, str, float]]:
    """(task, worker, seconds) of the running training attempts that reported no step for
    ``stall_s``: a training task reports at least once a second while it steps (outer steps
    and the vote report phases, not steps, and are not judged here)."""
    stall = config.current().stall_s
    out = []
    for a in running:
        named = layout.parse_label(a["task"])
        if named is None or named.kind not in TRAINING_KINDS:
            continue
        last = max([float(e.get("at") or 0) for e in entries.values()
                    if e.get("label") == a["task"] and e.get("worker") == a["worker"]]
                   + [float(a["started_at"])])
        if now - last >= stall:
            out.append((a["task"], a["worker"], now - last))
    return out


BrokerDown = Callable[[BrokerError], None]


def _board(broker_url: str | None, on_broker_down: BrokerDown | None
           ) -> tuple[RunBoard | None, BrokerError | None]:
    """The broker's runs, and why there are none: (None, None) without a broker; (None, the
    error) when it does not answer and the caller reads the store instead (``on_broker_down``
    is told; without it, BrokerError is raised)."""
    if not broker_url:
        return None, None
    try:
        return RunBoard(check_broker(broker_url)), None
    except BrokerError as exc:
        if on_broker_down is None:
            raise
        on_broker_down(exc)
        return None, exc


def describe(run_id: str, broker_url: str | None, store_url: str,
             on_broker_down: BrokerDown | None = None) -> dict[str, Any]:
    """A run's description from the broker, or from its manifest in the store when the broker
    has no record of it (after an embedded run, whose Redis is gone, or a Redis that lost its
    data — then ``note`` says so and how to continue). With ``on_broker_down``, a broker that
    does not answer is reported to it and the store is read too."""
    from tensorturn.store.objects import open_store

    board, down = _board(broker_url, on_broker_down)
    if board is not None and board.exists(run_id):
        return annotate(board.describe(run_id), board)
    doc = _manifest(open_store(store_url), run_id)
    if doc is None and down:  # it may well be on the broker: that is what went wrong
        raise BrokerError(f"{down}; and the store has no run {run_id!r}")
    if doc is None:
        where = "on the broker or in the store" if board is not None else "in the store"
        raise NotFound(f"no run {run_id!r} {where} (see `tensorturn runs`)")
    if doc.get("state") not in FINISHED:
        if board is not None:
            why = "the broker has no record of the run (Redis lost its data, or its keys were deleted?)"
        elif broker_url:
            why = "the broker does not answer (start the coordinator again to follow it)"
        else:
            why = "no broker is following it"
        doc["note"] = (f"the last saved state is '{doc.get('state')}', but {why}; "
                       f"continue it with `tensorturn resume {run_id}`")
    return doc


SUMMARY = ("run_id", "mode", "state", "recipe", "created_at", "finished_at", "metrics", "error")


def list_runs(broker_url: str | None, store_url: str,
              on_broker_down: BrokerDown | None = None) -> list[dict[str, Any]]:
    """Runs known to the broker and the manifests in the store, newest first; a run the store
    knows but the broker lost says so in ``note``. With ``on_broker_down``, a broker that does
    not answer is reported to it and the store's runs are listed."""
    from tensorturn.store.objects import open_store

    runs: dict[str, dict[str, Any]] = {}
    board, _ = _board(broker_url, on_broker_down)
    if board is not None:
        runs = {m["run_id"]: m for m in board.list_runs()}
    store = open_store(store_url)
    for key in store.list(layout.RUNS):
        parts = layout.parse("manifest", key)
        run_id = parts["run_id"] if parts else None
        if run_id is None or run_id in runs:
            continue
        try:
            m = store.get_json(key)
        except StoreError:
            continue
        summary = {k: m.get(k) for k in SUMMARY}  # the signature is not among them
        if board is not None and summary["state"] not in FINISHED:
            summary["note"] = f"not on this broker; `tensorturn resume {run_id}` continues it"
        runs[run_id] = summary
    return sorted(runs.values(), key=lambda m: m.get("created_at") or 0, reverse=True)


Confirm = Callable[[dict[str, Any]], bool]


def remove_run(run_id: str, broker_url: str | None, store_url: str,
               confirm: Confirm | None = None, force: bool = False) -> dict[str, Any] | None:
    """Delete a run: every object under ``runs/<id>/`` in the store, then its keys on the broker.

    Refused (SpecError, nothing deleted) while the run may still be used: unless it finished —
    by the broker's record, or, where the broker has none, by its manifest (an unfinished one
    only with ``force``: the broker asked may be another pool's) — while a live run on the
    broker reads it (its ``--init-from``, the teacher of a distillation), and while a server marks it as served
    (:func:`tensorturn.state.manifest.servers`). ``confirm`` is asked last, with what would go:
    False deletes nothing and returns None. Returns what was deleted."""
    from tensorturn.state.manifest import servers
    from tensorturn.store.objects import open_store

    if not layout.RUN_ID.fullmatch(run_id):
        raise SpecError(f"{run_id!r} is not a run id (see `tensorturn runs`)")
    store = open_store(store_url)
    board, _ = _board(broker_url, None)  # a broker that does not answer: BrokerError, nothing deleted
    sizes = store.sizes(f"{layout.RUNS}{run_id}/")
    if not sizes and not (board and board.keys(run_id)):
        where = "on the broker or in the store" if board else "in the store"
        raise NotFound(f"no run {run_id!r} {where} (see `tensorturn runs`)")
    plan = {"run_id": run_id, "state": _removable_state(run_id, board, store, force),
            "objects": len(sizes), "bytes": sum(sizes.values())}
    readers = [other for other, spec in (board.live_specs() if board else {}).items()
               if run_id in _runs_read(spec)]
    if readers:
        raise SpecError(f"run {run_id} is read by run{'s' * (len(readers) > 1)} "
                        f"{', '.join(readers)}, still running; nothing was removed")
    serving = servers(store, run_id)
    if serving:
        mark = serving[0]
        raise SpecError(f"run {run_id} is being served ({mark.get('where')} on {mark.get('host')}, "
                        f"seen {mark['age_s']:.0f}s ago): stop that server first; nothing was removed")
    if confirm is not None and not confirm(plan):
        return None
    store.delete_folder(f"{layout.RUNS}{run_id}/")
    plan["broker_keys"] = board.forget(run_id) if board else 0
    return plan


def _removable_state(run_id: str, board: RunBoard | None, store: Any, force: bool = False) -> str:
    """The state of a run ``remove_run`` may delete; SpecError for one that may be running."""
    if board is not None and board.exists(run_id):
        state = board.state(run_id) or "unknown"
        if state not in FINISHED:
            raise SpecError(f"run {run_id} is {state}: cancel it first (`tensorturn cancel {run_id}`); "
                            f"nothing was removed")
        return state
    manifest = _manifest(store, run_id)
    state = str(manifest.get("state")) if isinstance(manifest, dict) else "unknown"
    if state in FINISHED:
        return state
    if not force:
        where = ("the broker has no record of it (is it this run's pool?)" if board is not None
                 else "without its pool's broker (--join-file or --broker) nothing says whether it still runs")
        raise SpecError(f"run {run_id}'s last saved state is '{state}', and {where}; nothing was "
                        f"removed (--force removes it all the same)")
    return f"{state} (removed by --force: no broker record says it finished)"


def _runs_read(spec: dict[str, Any]) -> set[str]:
    """The runs whose files a run with ``spec`` reads as it trains."""
    options = spec.get("options") or {}
    recipe_options = spec.get("recipe_options") or {}
    return {str(v) for v in (options.get("init_from"), recipe_options.get("teacher")) if v}
