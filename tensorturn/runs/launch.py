"""Launching runs and following them to their end, on a standing pool or on a private embedded
one started for them — what ``tensorturn run``, ``distill``, ``resume`` and ``status --watch``
do, callable from Python with the same behaviour.

A :class:`Launcher` is the one way a run starts: it holds where runs go (the pool's broker, or
none: a private embedded pool for each launch) and the store, and starts a checked
:class:`~tensorturn.runs.request.RunRequest` (``tensorturn run``, ``Pool.run``), a
distillation's spec (``tensorturn distill``) or a stopped run (``tensorturn resume``).

A launch is a list of stages, each a run: an ensemble, then the student distilled from it
(``run --merge distill``). A stage starts once the one before it succeeded. On an embedded pool,
whatever ends the launch leaves the store complete before the pool (and its Redis) goes: a run
past ``--timeout`` is failed with how to continue it, an interrupted one is cancelled, and every
run's manifest holds its final state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, Protocol

from tensorturn import config
from tensorturn.errors import SpecError, TensorTurnError
from tensorturn.runfile import LOCAL_WORKERS
from tensorturn.runs.follow import Update, wait
from tensorturn.runs.request import RunRequest
from tensorturn.spec import FINISHED, RunSpec, RunState, check_bounds

if TYPE_CHECKING:
    from tensorturn.store.objects import Store

Say = Callable[[str], None]
# A stage of a launch: (run id, start(broker URL, say) — queue the run on that pool)
Stage = tuple[str, Callable[[str, Say], Any]]


class Interrupted(KeyboardInterrupt):
    """A launch interrupted (Ctrl-C, or SIGTERM where the caller turns it into one); ``str``
    says what became of the run. ``stopped``: the run was stopped with its embedded pool
    (an error), rather than only no longer followed on a standing pool (it goes on there)."""

    def __init__(self, message: str, stopped: bool):
        super().__init__(message)
        self.stopped = stopped


class Observer(Protocol):
    """What the caller of a launch is told as it goes, and when an interruption must reach it
    (:class:`Quiet` tells nobody; the CLI's prints each line on stderr, draws a run's progress
    and turns SIGTERM into an interruption)."""

    def say(self, line: str) -> None:
        """A line for the person waiting: what starts, what was queued, a run's warnings."""

    def watch(self, doc: dict[str, Any]) -> Update | None:
        """Following a run starts (``doc``: its first description): what to give each later one."""

    def unwatch(self) -> None:
        """Following that run ended."""

    def guard(self) -> None:
        """An embedded pool is about to start: an interruption must now reach the launch, which
        stops the pool (its processes must not outlive the caller)."""

    def unguard(self) -> None:
        """The runs are over: the pool stops whatever arrives now."""


class Quiet:
    """The observer of a launch nobody watches (tests, benchmarks, the Python API): silent, and
    it installs no signal handler; subclass it to hear some of it."""

    def say(self, line: str) -> None:
        pass

    def watch(self, doc: dict[str, Any]) -> Update | None:
        return None

    def unwatch(self) -> None:
        pass

    def guard(self) -> None:
        pass

    def unguard(self) -> None:
        pass


def follow(broker_url: str, run_id: str, timeout_s: float | None,
           observer: Observer | None = None) -> dict[str, Any]:
    """Wait for the run, telling ``observer`` its warnings and progress; its last description."""
    from tensorturn.state.board import RunBoard
    from tensorturn.state.broker import check_broker

    observer = observer or Quiet()
    first = RunBoard(check_broker(broker_url)).describe(run_id)
    for warning in first.get("warnings", []):
        observer.say(f"warning: {warning}")
    update = observer.watch(first)
    try:
        return wait(broker_url, run_id, on_update=update, timeout_s=timeout_s)
    finally:
        observer.unwatch()


def follow_on_pool(broker_url: str, run_id: str, timeout_s: float | None,
                   observer: Observer | None = None) -> dict[str, Any]:
    """:func:`follow` a run of a standing pool: an interruption stops following, not the run."""
    try:
        return follow(broker_url, run_id, timeout_s, observer)
    except KeyboardInterrupt:
        raise Interrupted(f"stopped following; run {run_id} goes on in the pool "
                          f"(`tensorturn status {run_id} --watch` follows it again)", stopped=False) from None


class Launcher:
    """The one way a run starts, and is followed to its end: ``tensorturn run``, ``distill`` and
    ``resume``, and :class:`tensorturn.api.Pool`, all start theirs here.

    It holds where runs go — the pool's ``broker`` (None: a private embedded pool, started for
    each launch and stopped after it) and the store, opened once — and tells ``observer`` how
    a launch goes. A store URL written wrong is refused when it is made, before a pool starts."""

    def __init__(self, broker: str | None, store_url: str, observer: Observer | None = None):
        from tensorturn.store.objects import check_store_url

        check_store_url(store_url)
        self.broker, self.store_url = broker, store_url
        self.observer: Observer = observer or Quiet()
        self._store: Store | None = None

    @property
    def store(self) -> Store:
        """The store, opened on first use (an S3 store's client is made then)."""
        if self._store is None:
            from tensorturn.store.objects import open_store

            self._store = open_store(self.store_url)
        return self._store

    # ---- what a launch starts ------------------------------------------------------------------

    def stages(self, request: RunRequest, pool_size: int | None) -> tuple[list[Stage], list[str]]:
        """The stages of ``request`` (its run; with ``merge="distill"``, then its distillation)
        and the recipes they build. ``pool_size``: the agents of the embedded pool the run will
        have (a mode sizes its run by them: an ensemble's members, and the run keeps it); None
        on a standing pool. Refused here, before anything starts: a recipe whose ensemble cannot
        be distilled."""
        spec = request.spec_for(self.store_url, pool_size)
        if pool_size is not None:
            from tensorturn.modes import get_mode

            get_mode(spec.mode).size(spec, pool_size)
        recipes = [spec.recipe, "distill"] if request.merge == "distill" else [spec.recipe]
        stages = [self.submitting(spec, recipes)]  # named by the caller: built here, imported by an embedded pool
        if request.merge == "distill":
            from tensorturn.merge.distill import check_distillable

            check_distillable(spec.recipe, spec.recipe_options)  # before the ensemble, not after it
            stages.append(self.distilling(spec.run_id, recipes, **request.training))
        return stages, recipes

    def submitting(self, spec: RunSpec, allow: Collection[str] = ()) -> Stage:
        """The stage that queues the run of ``spec`` (checked already: a request's, or a
        distillation's) on the pool; this process may build the recipes named in ``allow`` too
        (:func:`tensorturn.runs.submit.queue_run`)."""
        from tensorturn.runs.submit import queue_run

        return spec.run_id, lambda broker_url, say: queue_run(spec, broker_url, allow=allow, store=self.store)

    def distilling(self, teacher: str, allow: Collection[str] = (), **settings: Any) -> Stage:
        """The stage that distills ensemble ``teacher`` once it has finished (``run --merge``):
        its run id is chosen now, its spec (:func:`tensorturn.merge.distill.distill_spec` with
        ``settings``) built when the ensemble is done — by this process, which may build the
        recipes named in ``allow`` (the ensemble's) besides what the machine allows."""
        from tensorturn.spec import new_run_id

        run_id = new_run_id()

        def start(broker_url: str, say: Say) -> dict[str, Any]:
            from tensorturn.merge.distill import distill_spec
            from tensorturn.runs.submit import queue_run

            spec = distill_spec(teacher, self.store_url, run_id=run_id, allow=allow, **settings)
            doc = queue_run(spec, broker_url, allow=allow, store=self.store)
            say(f"distilling ensemble {teacher} into one model: run {run_id}")  # once it exists
            return doc

        return run_id, start

    # ---- launches --------------------------------------------------------------------------------

    def run(self, request: RunRequest, detach: bool = False,
            docs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """``tensorturn run``: start ``request``'s run and follow it; with ``merge="distill"``
        (an ensemble), then distill it into one model with the distillation's defaults and the
        training options (seed, lr, ...) given for the ensemble. An embedded pool has
        ``request.local_workers`` agents (default :data:`~tensorturn.runfile.LOCAL_WORKERS`)."""
        pool_size = None if self.broker else request.local_workers or LOCAL_WORKERS
        stages, recipes = self.stages(request, pool_size)
        return self.launch(stages, recipes, pool_size, detach, request.timeout, docs)

    def distill(self, spec: RunSpec, local_workers: int | None = LOCAL_WORKERS, detach: bool = False,
                timeout_s: float | None = None) -> list[dict[str, Any]]:
        """``tensorturn distill``: start a distillation's spec
        (:func:`tensorturn.merge.distill.distill_spec`, checked when made) and follow it; the
        pool's agents import the ``distill`` recipe and the ensemble's."""
        self.check_waiting(local_workers, timeout_s)
        recipes = ["distill", spec.recipe_options["recipe"]]
        return self.launch([self.submitting(spec, recipes)], recipes, local_workers, detach, timeout_s)

    def resume(self, run_id: str, local_workers: int | None = LOCAL_WORKERS, detach: bool = False,
               timeout_s: float | None = None, replan: bool = False) -> list[dict[str, Any]]:
        """``tensorturn resume``: continue a run from the store
        (:func:`tensorturn.runs.control.resume`; ``replan``: its plan made again first) and
        follow it. An unknown run, and a soup (finished when made), are refused before any pool
        starts; so is ``replan`` for a run that is not fused."""
        from tensorturn.runs import control
        from tensorturn.runs.records import describe

        self.check_waiting(local_workers, timeout_s)
        known = describe(run_id, None, self.store_url)  # an unknown run is refused before any pool starts
        if (known.get("lineage") or {}).get("souped_from"):
            raise SpecError(f"run {run_id} is a weight soup made by `tensorturn soup`: it is finished, "
                            f"there is nothing to resume")
        if replan:  # before any pool starts
            from tensorturn.runs.control import check_replan

            check_replan(RunSpec.from_json(known["spec"]))
        recipes = [known["recipe"]]
        if known["recipe"] == "distill":  # a student: its agents build the ensemble's recipe too
            recipes.append(((known.get("spec") or {}).get("recipe_options") or {}).get("recipe", ""))
        recipes = [r for r in recipes if r]
        # built here too on an embedded pool, as its agents do; on a standing pool, as this machine allows
        allow = recipes if not self.broker else []

        def start(broker_url: str, say: Say) -> None:
            _, what = control.resume(run_id, broker_url, self.store_url, allow=allow, replan=replan)
            say(f"run {run_id}: {what}")

        return self.launch([(run_id, start)], recipes, local_workers, detach, timeout_s)

    def plan(self, request: RunRequest) -> dict[str, Any]:
        """``tensorturn run --plan-only``: what ``--plan auto`` would choose for ``request``'s fused
        run on this pool (or the embedded pool it would start), with its reasons — nothing is
        queued or stored (:func:`tensorturn.modes.fused.timing.plan_for`)."""
        spec = request.spec
        if spec.mode != "fused":
            raise SpecError(f"--plan-only shows a fused run's plan; --mode {spec.mode} has none "
                            f"(drop --plan-only, or use --mode fused)")
        if getattr(spec.options, "plan", "auto") != "auto":
            raise SpecError("--plan-only shows what --plan auto chooses: drop --plan off")
        from tensorturn.modes.fused.timing import plan_for

        client = None
        if self.broker:
            from tensorturn.state.broker import check_broker

            client = check_broker(self.broker)
        spec = request.spec_for(self.store_url, None)
        chosen = plan_for(spec, client, request.local_workers or LOCAL_WORKERS, allow=(spec.recipe,))
        return {"plan": chosen.to_json()}

    def check_waiting(self, local_workers: int | None, timeout_s: float | None) -> None:
        """SpecError unless how a launch runs is in bounds: an embedded pool's agents (unused on
        a standing pool) and how long the command waits (a request checks its own when made)."""
        check_bounds({"local_workers": None if self.broker else local_workers, "timeout": timeout_s})

    def launch(self, stages: list[Stage], recipes: list[str], local_workers: int | None = LOCAL_WORKERS,
               detach: bool = False, timeout_s: float | None = None,
               docs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Start each stage's run and follow it to its end, on the pool or on a private embedded
        one of ``local_workers`` agents that import ``recipes``; a stage starts only once the
        one before it succeeded. Returns the runs' last descriptions (with ``detach``, the first
        run's as queued), appended to ``docs`` as they finish (so a caller has them when a later
        stage is refused). :class:`Interrupted` when interrupted."""
        from tensorturn.runs.records import describe

        if detach and self.broker is None:
            raise SpecError("--detach needs a pool (--broker): an embedded pool stops when the command exits")
        if detach and len(stages) > 1:
            raise SpecError("--merge waits for the ensemble to distill it: drop --detach, or run "
                            "`tensorturn distill RUN` once the ensemble has finished")
        docs = [] if docs is None else docs
        if not self.broker:
            return self.embedded(stages, local_workers or 1, timeout_s, recipes, docs)
        broker, observer = self.broker, self.observer
        for run_id, start in stages:
            doc = start(broker, observer.say)
            if detach:
                docs.append(doc if isinstance(doc, dict) else describe(run_id, broker, self.store_url))
                return docs
            observer.say(f"run {run_id} queued on {config.mask_url(broker)}")
            docs.append(self.saved(follow_on_pool(broker, run_id, timeout_s, observer), broker))
            if docs[-1]["state"] != RunState.SUCCEEDED:
                break
        return docs

    def saved(self, doc: dict[str, Any], broker: str) -> dict[str, Any]:
        """A followed run's last description as its manifest holds it: a finished run's manifest
        said its final state before the board did (:func:`tensorturn.state.manifest.end_run`);
        saved again here with the attempts that ended since (a backup copy stopping), what is
        printed is what the store holds. A store that does not answer now: the followed one."""
        from tensorturn.state.board import RunBoard
        from tensorturn.state.broker import check_broker
        from tensorturn.state.manifest import write_manifest

        if doc["state"] not in FINISHED:
            return doc
        try:
            return write_manifest(self.store, RunBoard(check_broker(broker)), doc["run_id"])
        except TensorTurnError:
            return doc

    def embedded(self, stages: list[Stage], local_workers: int, timeout_s: float | None,
                 recipes: list[str], docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Start a private pool; for each stage, start its run and follow it (the next only once
        it succeeded); stop the pool. Returns the runs' last descriptions.

        The pool's agents import ``recipes`` (the user named them on this machine's command line:
        :class:`LocalPool`'s ``allow``; this process's settings stay as they are) and share this
        machine's pool key (made on first use, ``.tensorturn/pool-key``)."""
        from tensorturn import trust
        from tensorturn.pool.embedded import LocalPool, logs_dir
        from tensorturn.state.board import RunBoard
        from tensorturn.state.broker import check_broker
        from tensorturn.state.manifest import fail_run, write_manifest

        observer = self.observer
        observer.say(f"starting an embedded pool: redis-server + {local_workers} local agents; "
                     f"store {config.mask_url(self.store_url)}")
        trust.pool_key_or_create()
        t0 = time.monotonic()
        observer.guard()
        queued, run_id = False, stages[0][0]
        try:
            logs = logs_dir(run_id)  # kept once the pool stops: a failure is explained there too
            # every agent answers before the run begins (forked warm; elsewhere the first, the
            # others joining as they come up)
            with LocalPool(local_workers, self.store_url, keep_logs=logs, allow=recipes, quick=True) as pool:
                observer.say(f"pool ready in {time.monotonic() - t0:.1f}s")  # no run id: none exists yet
                board = RunBoard(check_broker(pool.broker_url))
                for run_id, start in stages:
                    queued = False
                    try:
                        start(pool.broker_url, observer.say)  # (a refusal here: the run never existed)
                        observer.say(f"run {run_id} queued")
                        doc = follow(pool.broker_url, run_id, timeout_s, observer)
                    except BaseException as exc:  # interrupted, or following failed (a tracker, a bug)
                        why = ("interrupting its `tensorturn run`" if isinstance(exc, KeyboardInterrupt)
                               else f"an error following it ({type(exc).__name__})")
                        queued = self.stop_run(run_id, pool.broker_url, board, f"{why} (embedded pool)")
                        raise
                    if doc["state"] not in FINISHED:
                        fail_run(self.store, board, run_id, f"did not finish within --timeout "
                                 f"{timeout_s}s; continue with: tensorturn resume {run_id}")
                    # the manifest must hold the final state before this pool (and its Redis) goes away
                    docs.append({**write_manifest(self.store, board, run_id), "agent_logs": str(logs)})
                    if docs[-1]["state"] != RunState.SUCCEEDED:
                        break
                observer.unguard()
        except KeyboardInterrupt:
            if queued:
                raise Interrupted(f"interrupted: run {run_id} was cancelled and the embedded pool "
                                  f"stopped; the finished work is in the store. Continue with: "
                                  f"tensorturn resume {run_id}", stopped=True) from None
            raise Interrupted(f"interrupted before run {run_id} was queued; nothing to resume",
                              stopped=True) from None
        return docs

    def stop_run(self, run_id: str, broker_url: str, board: Any, by: str) -> bool:
        """Before an embedded pool stops early: cancel its run as ``tensorturn cancel`` would,
        or, if it just finished, save its manifest — so the store holds its final state once
        the pool's Redis is gone. Whether the run was queued at all."""
        from tensorturn.runs.control import cancel
        from tensorturn.state.manifest import write_manifest

        try:
            if not board.runs.exists(run_id):
                return False
            try:
                _, what = cancel(run_id, broker_url, self.store_url, by=by, wait_s=10.0)
                self.observer.say(what)
            except TensorTurnError:  # it finished just now: nothing to cancel
                write_manifest(self.store, board, run_id)
        except TensorTurnError as exc:  # the broker or store failed too: the pool stops all the same
            self.observer.say(f"run {run_id} could not be cancelled before the pool stopped: {exc}")
        return True
