"""The Python API: a pool and its runs as objects, and the functions ``tensorturn run`` is built on.

::

    import tensorturn

    with tensorturn.Pool.embedded(workers=2) as pool:          # or Pool.connect(join_file=...)
        run = pool.run(mode="fused", recipe="digits-mlp", rounds=2)   # queued; returns at once
        doc = run.result()                  # waits; what `tensorturn run --json` prints
        model = run.model()                 # a torch module with the trained weights

A run's settings are ``tensorturn run``'s flags as keyword arguments (``sync_every=10`` for
``--sync-every 10``), or a run file (``config="run.toml"``) with keyword arguments over it; they
become the :class:`~tensorturn.runs.request.RunRequest` the command makes, checked once, and
start through the pool's :class:`~tensorturn.runs.launch.Launcher`, as the command's do — so a
mistake raises the :class:`~tensorturn.errors.TensorTurnError` (``SpecError``, ``RecipeError``,
``BrokerError``...) whose message is the command's one line. Nothing here imports torch until a
run needs it.
"""

from __future__ import annotations

import atexit
import logging
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorturn import config, runfile
from tensorturn.errors import RunFailed, SpecError
from tensorturn.runs.request import RunRequest
from tensorturn.spec import FINISHED, RunState

if TYPE_CHECKING:
    from torch import nn

    from tensorturn.pool.embedded import LocalPool
    from tensorturn.runs.launch import Launcher, Observer, Stage

__all__ = ["Pool", "Run", "RunRequest"]

log = logging.getLogger(__name__)


# ---- pools and runs as objects ----------------------------------------------------------------------

class Pool:
    """A pool to run on: a private one on this machine (:meth:`embedded`: a redis-server and
    local agents, up until :meth:`close`) or a standing one (:meth:`connect`). A context manager:
    leaving it closes the pool (an embedded pool's unfinished runs are cancelled, their finished
    work kept in the store, and its processes stopped)."""

    def __init__(self, broker_url: str, store_url: str, local: "LocalPool | None" = None,
                 allow: tuple[str, ...] = ()):
        self.broker_url = broker_url
        self.store_url = store_url
        self.local = local
        self.allow = allow
        self.runs: list[Run] = []
        self.closed = False  # an embedded pool, once stopped: its runs are read from the store
        self._launcher: Launcher | None = None

    @classmethod
    def embedded(cls, workers: int = runfile.LOCAL_WORKERS, store: str | None = None,
                 allow: tuple[str, ...] | list[str] = ()) -> "Pool":
        """Start a private pool on this machine, as ``tensorturn run`` without ``--broker`` does:
        a redis-server and ``workers`` agent processes, storing to ``store`` (default
        ``./tensorturn-store``), importing the built-in recipes and those named in ``allow``
        (``module:attr``). It returns once every agent answers (on Linux, where they are forked
        from one warm parent; elsewhere once the first does, the others joining as they come
        up). Its agents' logs are kept in ``.tensorturn/logs/pool-<time>``."""
        from tensorturn import trust
        from tensorturn.pool.embedded import LocalPool, logs_dir
        from tensorturn.spec import check_bounds, new_run_id

        check_bounds({"local_workers": workers})
        store_url = config.normalize_store_url(store) if store else config.default_store_url()
        trust.pool_key_or_create()
        local = LocalPool(workers, store_url, keep_logs=logs_dir(f"pool-{new_run_id()}"),
                          allow=tuple(allow), quick=True)
        local.__enter__()  # which stops what it started if it fails
        log.info("embedded pool up: %d agents, store %s", workers, config.mask_url(store_url))
        pool = cls(local.broker_url, store_url, local, tuple(allow))
        atexit.register(pool.close)  # a script that never closes it leaves no process behind
        return pool

    @classmethod
    def connect(cls, join_file: str | Path | None = None, broker: str | None = None,
                store: str | None = None, allow: tuple[str, ...] | list[str] = ()) -> "Pool":
        """A standing pool (``tensorturn up``'s), as a command's ``--join-file``, ``--broker``
        and ``--store`` name it, the environment's (``TENSORTURN_JOIN_FILE``,
        ``TENSORTURN_BROKER_URL``...) when not given. A join file's pool key and allowed
        recipes — and ``allow``'s — become this process's, as they do a command's; BrokerError
        when the broker does not answer."""
        from tensorturn.state.broker import check_broker

        settings = config.current()
        join_path = str(join_file) if join_file else settings.join_file
        joined = bool(join_path or settings.join)
        if joined:
            from tensorturn.pool.coordinator import load_join

            settings = load_join(settings.join, join_path, settings)
        if allow:
            from tensorturn.trust import with_allowed

            settings = with_allowed(settings, allow)
        broker = broker or settings.broker_url
        if not broker:
            raise SpecError("Pool.connect needs the pool: join_file= (from `tensorturn up`) or broker= "
                            "(or TENSORTURN_JOIN_FILE / TENSORTURN_BROKER_URL); Pool.embedded() "
                            "starts a private one")
        store = store or settings.store_url
        store_url = config.normalize_store_url(store) if store else config.default_store_url()
        if joined or allow:  # the pool key and the recipes the user named, as a command's flags
            config.use(settings.with_(store_url=store_url))
        check_broker(broker)
        return cls(broker, store_url, None, tuple(allow))

    def run(self, mode: str | None = None, recipe: str | None = None, *,
            config: str | Path | None = None, track: str | list[str] | tuple[str, ...] = (),
            track_dir: str | Path | None = None, **options: Any) -> "Run":
        """Queue a run and return at once: ``tensorturn run``'s settings as keyword arguments
        (``rounds=2``, ``recipe_options={"data": "book.txt"}``, ``merge="distill"``), over those
        of the run file ``config``; the defaults are the command's. ``track`` (``"mlflow"``,
        ``["mlflow", "tensorboard"]``) and ``track_dir`` are ``--track`` and ``--track-dir``:
        the run is logged as :meth:`Run.wait` follows it, and its end once it has ended. Raises
        the command's one-line errors (SpecError...) before anything is queued."""
        if self.closed:
            raise SpecError("this embedded pool is closed: start another (Pool.embedded())")
        for launch_only, instead in (("local_workers", "Pool.embedded(workers=N)"),
                                     ("timeout", "run.wait(timeout=SECONDS)"), ("detach", "nothing: "
                                     "Pool.run returns at once")):
            if launch_only in options:
                raise SpecError(f"{launch_only} is not a setting of Pool.run: use {instead}")
        trackers = _trackers(track, track_dir)
        request = RunRequest.of({"mode": mode, "recipe": recipe, **options}, config)
        if self.local is not None:
            self._check_agents_allow(request.spec.recipe)
        # the run keeps what ran: this embedded pool's size; a standing pool has none to keep
        stages, recipes = self.launcher.stages(request, self.local.workers if self.local is not None else None)
        run = Run(self, stages, tuple(recipes) + self.allow, trackers)
        self.runs.append(run)
        return run

    @property
    def launcher(self) -> "Launcher":
        """What starts this pool's runs: its broker and store (:class:`~tensorturn.runs.launch.Launcher`)."""
        from tensorturn.runs.launch import Launcher

        if self._launcher is None:
            self._launcher = Launcher(self.broker_url, self.store_url)
        return self._launcher

    def _check_agents_allow(self, recipe: str) -> None:
        """An embedded pool's agents import the recipes allowed when it started (``allow=``, and
        this machine's allowlist): a run of another is refused here, in one line, rather than by
        every agent."""
        from tensorturn import trust
        from tensorturn.recipes import BUILTIN

        try:
            trust.check_recipe_allowed(recipe, BUILTIN, trust.with_allowed(config.current(), self.allow))
        except trust.UntrustedError:
            raise SpecError(f"recipe {recipe!r} is not allowed on this embedded pool's agents: start "
                            f"it with Pool.embedded(allow=[{recipe!r}])") from None

    def workers(self) -> list[dict[str, Any]]:
        """The pool's agents, as ``tensorturn workers --json`` lists them."""
        from tensorturn.runs.records import workers

        return workers(self.broker_url)

    def close(self) -> None:
        """An embedded pool: cancel its unfinished runs (their finished work stays in the store;
        ``tensorturn resume RUN`` continues them), save every run's manifest, stop its processes.
        A standing pool: nothing to stop (its runs go on)."""
        if self.local is None or self.closed:
            return
        atexit.unregister(self.close)
        try:
            for run in self.runs:
                run.settle()
        finally:
            self.local.stop()
            self.closed = True

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _trackers(track: str | list[str] | tuple[str, ...], track_dir: str | Path | None
              ) -> tuple[tuple[str, ...], Path] | None:
    """``Pool.run``'s ``track`` and ``track_dir``, checked as ``--track`` is (the library
    installed, the folder writable): (names, folder), or None for no tracking."""
    names = (track,) if isinstance(track, str) else tuple(track or ())
    if not names:
        if track_dir is not None:
            raise SpecError("track_dir is where trackers write: name them too, e.g. track=['mlflow']")
        return None
    from tensorturn.track import check, check_dir

    folder = Path(track_dir if track_dir is not None else ".")
    check(names)
    check_dir(folder)
    return names, folder


def _logging() -> "Observer":
    """The observer of a run the Python API follows: its lines go to this module's log (a
    warning, such as a tracker that stopped, as a warning)."""
    from tensorturn.runs.launch import Quiet

    class Logging(Quiet):
        def say(self, line: str) -> None:
            log.log(logging.WARNING if line.startswith("warning:") else logging.INFO, "%s", line)

    return Logging()


class Run:
    """A run queued by :meth:`Pool.run`. With ``merge="distill"`` it is two runs, the ensemble
    then its student: :attr:`run_id` names the one under way (the student once it starts)."""

    def __init__(self, pool: Pool, stages: "list[Stage]", recipes: tuple[str, ...],
                 track: tuple[tuple[str, ...], Path] | None = None):
        self.pool = pool
        self.recipes = recipes
        self.track = track  # (trackers, folder): what --track and --track-dir would say
        self.tracked: set[str] = set()  # the runs whose end their trackers were shown
        self.docs: list[dict[str, Any]] = []  # the finished stages' last descriptions
        self._later = list(stages)
        self.run_id = ""
        self._start_next()

    def __repr__(self) -> str:
        return f"<tensorturn.Run {self.run_id}>"

    def _start_next(self) -> None:
        self.run_id, start = self._later.pop(0)
        start(self.pool.broker_url, lambda line: log.info("%s", line))

    def status(self) -> dict[str, Any]:
        """The run's description now, as ``tensorturn status RUN --json`` prints it."""
        from tensorturn.runs.records import describe

        return describe(self.run_id, None if self.pool.closed else self.pool.broker_url, self.pool.store_url)

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait until the run has ended (a merge: until its student has) or ``timeout`` seconds
        have passed; its description then, whatever its state. The run's manifest holds its
        final state once it has ended."""
        from tensorturn.runs.launch import follow
        from tensorturn.spec import check_bounds

        check_bounds({"timeout": timeout})
        if self.pool.closed:  # its pool stopped it: the store has its last state
            return self.status()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            doc = follow(self.pool.broker_url, self.run_id, left, self._observer())
            if doc["state"] not in FINISHED:
                return doc
            self.tracked.add(self.run_id)
            doc = self._save()
            if doc["state"] != RunState.SUCCEEDED or not self._later:
                return doc
            self.docs.append(doc)
            self._start_next()  # the distillation of the ensemble that just succeeded

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """The finished run, as ``tensorturn run --json`` prints it (a merge: the student's, with
        the ensemble's as ``ensemble``). RunFailed (the command's error line) when it failed or
        was cancelled; TimeoutError when it has not ended within ``timeout`` seconds."""
        from tensorturn.runs.display import as_one

        doc = self.wait(timeout)
        if doc["state"] == RunState.FAILED:
            raise RunFailed(config.mask_text(doc.get("error") or f"run {self.run_id} failed"))
        if doc["state"] == RunState.CANCELLED:
            raise RunFailed(f"run {self.run_id} was cancelled; `tensorturn resume {self.run_id}` continues it")
        if doc["state"] not in FINISHED:
            raise TimeoutError(f"run {self.run_id} has not finished within {timeout:g} s (it goes on)")
        return as_one([*self.docs, doc])

    def cancel(self) -> dict[str, Any]:
        """Cancel the run, as ``tensorturn cancel RUN`` does: its description after."""
        from tensorturn.runs.control import cancel

        self._later.clear()
        doc, what = cancel(self.run_id, self.pool.broker_url, self.pool.store_url,
                           by=f"the Python API on {socket.gethostname()}")
        log.info("%s", what)
        return doc

    def model(self) -> "nn.Module":
        """The trained model as the inference API loads it (checked against its signed
        manifest): the fused model, or the ensemble as one module that votes. Waits for the run;
        RunFailed when it did not succeed."""
        from tensorturn.predictor import load_result
        from tensorturn.store.objects import open_store

        self.result()
        predictor, _ = load_result(open_store(self.pool.store_url), self.run_id, self.recipes)
        return predictor.as_model()

    def _observer(self) -> "Observer | None":
        """Who hears of the run as :meth:`wait` follows it: its trackers, fed each description
        (:class:`~tensorturn.track.Tracking`, as ``run --track``), or nobody."""
        if self.track is None:
            return None
        from tensorturn.track import Tracking

        return Tracking(_logging(), *self.track)

    def _save(self) -> dict[str, Any]:
        """Save the run's manifest (its final state, before an embedded pool's Redis goes)."""
        from tensorturn.state.board import RunBoard
        from tensorturn.state.broker import check_broker
        from tensorturn.state.manifest import write_manifest
        from tensorturn.store.objects import open_store

        return write_manifest(open_store(self.pool.store_url), RunBoard(check_broker(self.pool.broker_url)),
                              self.run_id)

    def settle(self) -> None:
        """Before its embedded pool stops: cancel the run if it has not ended, and save its
        manifest (what :meth:`Pool.close` does for each run)."""
        from tensorturn.errors import TensorTurnError

        self._later.clear()
        try:
            if self.status()["state"] not in FINISHED:
                self.cancel()
            doc = self._save()
            if self.track is not None and self.run_id not in self.tracked:  # nobody waited for its end
                from tensorturn.track import log_ended

                log_ended(doc, *self.track, say=_logging().say)
        except TensorTurnError as exc:  # the pool stops whatever happens: say why this one is not saved
            log.warning("run %s: %s", self.run_id, exc)
