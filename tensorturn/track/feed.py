"""Runs' descriptions to trackers: :class:`Feed` logs what a description holds that a tracker has
not logged yet (each round, member and end once); :class:`Tracking` is the launch's
:class:`~tensorturn.runs.launch.Observer` that feeds every run it follows (``run --track``);
:func:`track_run` logs a run afterwards (``tensorturn track RUN``), following it first when it
still runs.

A tracker that fails while a run trains — starting included: it opens its files and database in
its ``start``, inside the feed's guard — is dropped with one warning line: the run is worth more
than its log, and ``tensorturn track RUN --to ...`` logs it again later, once (what the tracker
holds is skipped). What can be checked before a run starts is: the library installed
(:func:`check`), the folder writable (:func:`check_dir`)."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorturn import config
from tensorturn.errors import SpecError
from tensorturn.spec import FINISHED, MemberState
from tensorturn.track.base import Logged, Tracker, final, member_metrics, params, round_metrics

if TYPE_CHECKING:
    from tensorturn.runs.follow import Update
    from tensorturn.runs.launch import Observer

log = logging.getLogger(__name__)

# backend → (modules it needs, the extra that installs them)
NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "mlflow": (("mlflow", "sqlalchemy", "alembic", "pandas"), "mlflow"),
    "tensorboard": (("tensorboard",), "tensorboard"),
    "wandb": (("wandb",), "wandb"),
}
BACKENDS = tuple(NEEDS)
Say = Callable[[str], None]


def check(names: tuple[str, ...] | list[str]) -> None:
    """SpecError, before anything starts, for a tracker whose library is not installed here."""
    for name in names:
        if name not in NEEDS:
            raise SpecError(f"unknown tracker {name!r}: choose from {', '.join(BACKENDS)}")
        modules, extra = NEEDS[name]
        missing = [m for m in modules if absent(m)]
        if missing:
            raise SpecError(f"--track {name} needs {', '.join(missing)}, not installed here: "
                            f"pip install 'tensorturn[{extra}]'")


def check_dir(track_dir: Path) -> None:
    """SpecError, before anything starts, when ``track_dir`` cannot be a folder trackers write
    in: it is a file, or it (or the folder it would be made in) cannot be written."""
    path = Path(track_dir).expanduser()
    if path.exists() and not path.is_dir():
        raise SpecError(f"--track-dir {track_dir} is a file, not a folder: name a folder the trackers may write in")
    where = path
    while not where.exists():  # made when the first tracker starts: its first existing parent decides
        where = where.parent
    if not where.is_dir():
        raise SpecError(f"--track-dir {track_dir} cannot be made: {where} is a file, not a folder")
    if not os.access(where, os.W_OK | os.X_OK):
        raise SpecError(f"--track-dir {track_dir} cannot be written here: {where} is not writable by this user")


def absent(module: str) -> bool:
    """Whether ``module`` cannot be imported here (found without importing it: MLflow takes seconds)."""
    try:
        return importlib.util.find_spec(module) is None
    except ValueError:  # sys.modules holds None for it: imports of it are blocked
        return True


def opened(names: tuple[str, ...] | list[str], track_dir: Path, say: Say, run_id: str = "RUN") -> list[Tracker]:
    """The trackers of ``names`` under ``track_dir``: one that cannot even be made is left out
    with its one warning line (:func:`stopped`), as one that fails later is."""
    out = []
    for name in dict.fromkeys(names):
        try:
            out.append(open_tracker(name, track_dir))
        except Exception as exc:  # noqa: BLE001 - a tracker's failure must not stop the run it logs
            say(stopped(name, exc, run_id))
    return out


def stopped(name: str, exc: BaseException, run_id: str = "RUN") -> str:
    """The one warning line of a tracker dropped for ``exc``: the run goes on, and how to log it later."""
    why = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]  # one line, whatever it says
    return (f"warning: --track {name} stopped logging: {config.mask_text(why)} (the run goes on; "
            f"`tensorturn track {run_id} --to {name}` logs it later)")


def open_tracker(name: str, track_dir: Path) -> Tracker:
    """A tracker of backend ``name`` writing under ``track_dir`` (unless its own settings, such as
    MLFLOW_TRACKING_URI or a W&B login, send it elsewhere). Nothing is written or opened until
    its ``start``."""
    if name == "mlflow":
        from tensorturn.track.to_mlflow import MlflowTracker

        return MlflowTracker(track_dir)
    if name == "tensorboard":
        from tensorturn.track.to_tensorboard import TensorBoardTracker

        return TensorBoardTracker(track_dir)
    from tensorturn.track.to_wandb import WandbTracker

    return WandbTracker(track_dir)


class Feed:
    """Feeds one run's descriptions to its trackers: call it with each description, then
    :meth:`end` with the last. Each round (fused), finished member (ensemble) and the end is
    logged once per tracker, however often a description shows it."""

    def __init__(self, trackers: list[Tracker], say: Say | None = None):
        self.trackers = list(trackers)
        self.say = say or (lambda line: log.warning(line))
        self.logged: dict[str, Logged] = {}
        self.last: dict[str, Any] | None = None

    def __call__(self, doc: dict[str, Any]) -> None:
        self.last = doc
        for tracker in list(self.trackers):
            self._guarded(tracker, lambda t: self._feed(t, doc))

    def end(self, doc: dict[str, Any] | None = None) -> None:
        """Following ends: a finished run's end is logged; every tracker lets go."""
        doc = doc or self.last
        if doc is not None and doc is not self.last:
            self(doc)
        for tracker in list(self.trackers):
            def ending(t: Tracker) -> None:
                logged = self.logged.get(t.name)
                if doc is not None and logged is not None and doc.get("state") in FINISHED and not logged.finished:
                    logged.finished = True
                    t.finish(final(doc), logged)
            self._guarded(tracker, ending)
            self._guarded(tracker, lambda t: t.close())

    def summary(self) -> list[dict[str, Any]]:
        """Where each tracker logged and what it holds of the run."""
        return [{"to": t.name, "where": t.where(), **self.logged.get(t.name, Logged()).to_json()}
                for t in self.trackers]

    def _feed(self, tracker: Tracker, doc: dict[str, Any]) -> None:
        logged = self.logged.get(tracker.name)
        if logged is None:
            logged = self.logged[tracker.name] = tracker.start(doc["run_id"], params(doc))
        for record in sorted(doc.get("rounds") or [], key=lambda r: r["round"]):
            r = int(record["round"])
            if r not in logged.rounds:
                logged.rounds.add(r)  # with the step: a tracker that keeps the record saves it as it logs
                tracker.step(r, round_metrics(doc, record), logged)
        for member in doc.get("members") or []:
            m = int(member["member"])
            if m not in logged.members and member.get("state") == MemberState.SUCCEEDED and member.get("metrics"):
                logged.members.add(m)
                tracker.step(int(member.get("segments_done") or 0), member_metrics(member), logged)

    def _guarded(self, tracker: Tracker, call: Callable[[Tracker], None]) -> None:
        try:
            call(tracker)
        except Exception as exc:  # noqa: BLE001 - a tracker's failure must not stop the run it logs
            # any exception: a tracking library raises its own (sqlite3, alembic, OSError...)
            self.trackers.remove(tracker)
            self.say(stopped(tracker.name, exc, (self.last or {}).get("run_id", "RUN")))


class Tracking:
    """A launch's observer (:class:`~tensorturn.runs.launch.Observer`) that tells ``inner``
    everything and feeds each run it follows to a fresh set of trackers (``names``, under
    ``track_dir``): an ensemble and the student distilled from it are two tracked runs."""

    def __init__(self, inner: "Observer", names: tuple[str, ...] | list[str], track_dir: Path):
        check(names)
        check_dir(track_dir)
        self.inner, self.names, self.track_dir = inner, tuple(dict.fromkeys(names)), track_dir
        self.feed: Feed | None = None
        self.feeds: list[Feed] = []

    def say(self, line: str) -> None:
        self.inner.say(line)

    def watch(self, doc: dict[str, Any]) -> "Update | None":
        update = self.inner.watch(doc)
        # each tracker starts (opens its files, its database) inside the feed's guard: one that
        # cannot start is dropped with its warning line, and the run is followed all the same
        self.feed = feed = Feed(opened(self.names, self.track_dir, self.inner.say, doc["run_id"]),
                                self.inner.say)
        self.feeds.append(feed)
        feed(doc)
        for line in feed.summary():
            self.inner.say(f"tracking run {doc['run_id']} to {line['to']}: {line['where']}")

        def both(later: dict[str, Any]) -> None:
            if update is not None:
                update(later)
            feed(later)
        return both

    def unwatch(self) -> None:
        self.inner.unwatch()
        if self.feed is not None:
            self.feed.end()
            self.feed = None

    def guard(self) -> None:
        self.inner.guard()

    def unguard(self) -> None:
        self.inner.unguard()


def track_run(run_id: str, names: tuple[str, ...] | list[str], track_dir: Path, broker: str | None,
              store: str, observer: "Observer | None" = None,
              timeout_s: float | None = None) -> list[dict[str, Any]]:
    """``tensorturn track RUN``: log a run to trackers after the fact — a finished run's recorded
    rounds, members and end; a run still live on the pool at ``broker`` is followed to its end
    first (an interruption stops following, the run goes on). What each tracker already holds is
    not logged again. Returns where each logged and what it holds."""
    from tensorturn.runs.launch import Quiet, follow_on_pool
    from tensorturn.runs.records import describe

    check(names)
    check_dir(track_dir)
    observer = observer or Quiet()
    doc = describe(run_id, broker, store)
    if doc.get("state") not in FINISHED:
        if not broker:
            raise SpecError(f"run {run_id} is {doc.get('state')} and no pool is named to follow it: "
                            f"give --join-file or --broker, or track it once it has finished")
        tracking = Tracking(observer, names, track_dir)
        follow_on_pool(broker, run_id, timeout_s, tracking)
        return tracking.feeds[-1].summary()
    return log_ended(doc, names, track_dir, observer.say)


def log_ended(doc: dict[str, Any], names: tuple[str, ...] | list[str], track_dir: Path,
              say: Say | None = None) -> list[dict[str, Any]]:
    """Log an ended run's description ``doc`` (what it recorded, then its end) to the trackers
    ``names`` — what each already holds is not logged again. Where each logged, and what it holds."""
    say = say or (lambda line: log.warning(line))
    feed = Feed(opened(names, track_dir, say, doc["run_id"]), say)
    feed(doc)
    feed.end(doc)
    return feed.summary()
