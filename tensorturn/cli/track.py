"""Experiment trackers on the command line: ``--track`` for ``run``, ``resume`` and ``distill``,
and ``tensorturn track RUN --to ...`` for a run that ran detached or has finished
(:mod:`tensorturn.track`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tensorturn.cli import cli, emit_json, pool_options
from tensorturn.cli.output import launched, say

if TYPE_CHECKING:
    from tensorturn.runs.launch import Observer

BACKENDS = ("mlflow", "tensorboard", "wandb")  # tensorturn.track.BACKENDS, without importing it for --help
TRACK_DIR_HELP = ("Where trackers write on this machine: mlflow.db + mlruns/ (MLflow, unless "
                  "MLFLOW_TRACKING_URI is set), runs/RUN/ (TensorBoard), wandb/ (W&B) "
                  "[default: the current folder].")


def track_options(fn: Callable) -> Callable:
    """``--track`` (repeatable) and ``--track-dir``."""
    fn = click.option("--track-dir", type=click.Path(path_type=Path), default=Path("."),
                      help=TRACK_DIR_HELP)(fn)
    return click.option(
        "--track", "track", multiple=True, type=click.Choice(BACKENDS),
        help="Log each round (train/val loss and metrics, samples, bytes, each machine's samples/s, "
             "async staleness), the run's options and the final model to an experiment tracker, "
             "as the run trains. Repeatable. Each is an extra: pip install 'tensorturn[mlflow]' "
             "(or [tensorboard], [wandb]); W&B is offline unless you are logged in.")(fn)


def tracking(track: tuple[str, ...], track_dir: Path, detach: bool = False
             ) -> Callable[["Observer"], "Observer"]:
    """The launch's observer, feeding ``track``'s trackers when any are named; refused before
    anything starts: a tracker whose library is missing, a ``--track-dir`` that cannot be written,
    and ``--detach`` (nothing follows the run)."""
    if not track:
        return lambda observer: observer
    from tensorturn.errors import SpecError
    from tensorturn.track import Tracking, check, check_dir

    if detach:
        raise SpecError("--track logs the run as this command follows it: drop --detach, or log it "
                        "afterwards with `tensorturn track RUN --to ...`")
    check(track)
    check_dir(track_dir)
    return lambda observer: Tracking(observer, track, track_dir)


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--to", "to", multiple=True, required=True, type=click.Choice(BACKENDS),
              help="The tracker to log to (repeatable).")
@click.option("--track-dir", type=click.Path(path_type=Path), default=Path("."),
              help=TRACK_DIR_HELP)
@click.option("--timeout", "timeout_s", type=float, default=None,
              help="A live run: stop following it after this many seconds (it goes on; track it again later).")
@click.option("--json", "as_json", is_flag=True, help="Print where each tracker logged as one JSON object.")
@pool_options("Redis URL of the pool: a run still training there is followed to its end; without "
              "it the run is read from the store (it must have finished).")
def track(broker, store, run_id, to, track_dir, timeout_s, as_json):
    """Log a run to experiment trackers after the fact.

    For a run that ran with --detach, or without --track: its recorded rounds (or ensemble
    members), settings, final figures and model are logged as `run --track` would have. A run
    still training on the pool is followed to its end. What a tracker already holds of the run
    (a run --track logged, an earlier `track`) is not logged again: it goes on in the same
    tracker run.

    \b
    Examples:
      tensorturn track RUN --to mlflow --to tensorboard
      tensorturn track RUN --to wandb --join-file .tensorturn/join   # still running: follows it
    """
    from tensorturn.spec import check_bounds
    from tensorturn.track import track_run

    check_bounds({"timeout": timeout_s})
    logged: list[dict[str, Any]] = launched(
        lambda observer: track_run(run_id, to, track_dir, broker, store, observer, timeout_s))
    if as_json:
        emit_json({"run_id": run_id, "trackers": logged})
        return
    for line in logged:
        held = (f"{len(line['rounds'])} round(s)" if line["rounds"] else f"{len(line['members'])} member(s)")
        say(f"run {run_id} → {line['to']}: {held}{', finished' if line['finished'] else ''}; {line['where']}")
