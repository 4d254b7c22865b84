"""Queueing a run: what a checked spec can still fail (the recipe builds, the broker and the
store answer, a machine can hold the model), then the run set up by the one set-up function
(:func:`tensorturn.tasks.start.start`) — on an idle agent (torch and the recipes loaded there)
or, without one, in this process. :class:`~tensorturn.runs.launch.Launcher` calls
:func:`queue_run`; :func:`submit` is the same for a spec made by hand (tests, benchmarks).

Nothing here imports torch, Celery or boto3 until a function needs them: a bad option or recipe
name is refused before anything heavy loads.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from tensorturn import layout
from tensorturn.errors import BrokerError, TensorTurnError
from tensorturn.runs.request import validate
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import check_broker
from tensorturn.state.runs import Runs

if TYPE_CHECKING:
    from tensorturn.store.objects import Store

START_WAIT_S = 300.0  # how long `run` waits for an agent to prepare the run before giving up


def submit(spec: RunSpec, broker_url: str, here: bool = False, allow: Collection[str] = (),
           store: Store | None = None) -> dict[str, Any]:
    """Validate a spec made by hand (tests, benchmarks: a :class:`~tensorturn.runs.request.RunRequest`'s
    was checked when the request was made), then queue its run (:func:`queue_run`)."""
    validate(spec)
    return queue_run(spec, broker_url, here, allow, store)


def queue_run(spec: RunSpec, broker_url: str, here: bool = False, allow: Collection[str] = (),
              store: Store | None = None) -> dict[str, Any]:
    """Check everything a valid spec can still fail, then queue the run; returns its description.

    Nothing is queued unless the recipe builds, both the broker and the store (``store``, opened
    by the caller, or ``spec.store_url``'s) answer, and some connected machine can hold the
    model. Building the recipe, the memory check
    and θ_0 need torch: when the pool has an idle agent (torch and the recipes already loaded),
    that agent does them (:func:`tensorturn.tasks.start.start`, in the ``tensorturn.start_run``
    task) and this process never loads torch; otherwise, or with ``here``, they run in this process,
    which builds the spec's recipe and those named in ``allow`` (:func:`tensorturn.recipes.resolve`)
    besides what the machine allows — its settings stay as they are.
    """
    from tensorturn import trust
    from tensorturn.state.roster import WorkerState, list_workers
    from tensorturn.store.objects import open_store

    trust.pool_key()  # one clear error now rather than a refusal from every agent
    client = check_broker(broker_url)
    from tensorturn.state.clock import broker_now

    # on the broker's clock, as every time an agent compares with it (an ensemble's --deadline)
    spec.created_at = broker_now(client)
    store = store or open_store(spec.store_url)
    store.check()
    pool = list_workers(client)
    idle = [w for w in pool if w["state"] == WorkerState.IDLE]
    if not here and idle:
        # beside the store when an agent there is idle: θ_0 (a whole model) is uploaded from
        # the machine that starts the run, and a trainer's home uplink is the slow one
        beside = layout.outer_queue(layout.DEFAULT_QUEUE)
        return start_on_an_agent(spec, broker_url, beside if any(beside in w["queues"] for w in idle)
                                 else layout.DEFAULT_QUEUE)
    from tensorturn.tasks.start import start

    # built here: the recipe this user named on this machine is theirs to import here
    start(spec, broker_url, store, pool, allow=(spec.recipe, *allow))
    return RunBoard(client).describe(spec.run_id)


def start_on_an_agent(spec: RunSpec, broker_url: str, queue: str = layout.DEFAULT_QUEUE) -> dict[str, Any]:
    """Have an idle agent set the run up (:func:`tensorturn.tasks.start.start_run`), from
    ``queue``, and wait for its answer: the run's description, or the error it met, raised here
    with its exit code (nothing is queued then)."""
    from tensorturn import trust
    from tensorturn.pool import remote_control
    from tensorturn.pool.celery_app import app, configure
    from tensorturn.tasks.start import START_TASK

    configure(broker_url)
    client = check_broker(broker_url)
    # the answer comes back on a Redis list of the run's (no Celery result, no subscription)
    doc = spec.to_json()
    sent = app.send_task(START_TASK, args=[doc], kwargs={"sig": trust.pool_key().sign("submit", doc)},
                         queue=queue, ignore_result=True)
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
    from tensorturn.state.refusals import refusals
    from tensorturn.tasks.start import START_TASK

    runs = Runs(client)
    deadline = time.monotonic() + START_WAIT_S
    while time.monotonic() < deadline:
        answer = runs.start_answer(run_id, timeout_s=1)
        if answer is not None:
            return answer
        for entry in refusals(client)[1]:
            if entry.get("run_id") == run_id and entry.get("task") == START_TASK:
                return {"error": f"agent {entry.get('worker')} refused run {run_id}: "
                                 f"{entry.get('reason')}", "exit_code": 2}
    return None
