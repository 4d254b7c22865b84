"""Experiment trackers: a run's rounds, members and end logged to MLflow, TensorBoard or W&B
(``run --track``, ``tensorturn track RUN``), fed from the descriptions the launch already follows.

* :mod:`~tensorturn.track.base` — what is logged, taken from a description; the :class:`Tracker`
  interface;
* :mod:`~tensorturn.track.feed` — :class:`Feed` (each round once), :class:`Tracking` (the
  launch's observer), :func:`track_run`;
* one small class per backend: :mod:`~tensorturn.track.to_mlflow`,
  :mod:`~tensorturn.track.to_tensorboard`, :mod:`~tensorturn.track.to_wandb` (each an optional
  extra: ``tensorturn[mlflow]`` and so on).
"""

from tensorturn.track.base import Final, Logged, ModelRef, Tracker
from tensorturn.track.feed import (
    BACKENDS,
    Feed,
    Tracking,
    check,
    check_dir,
    log_ended,
    open_tracker,
    opened,
    track_run,
)

__all__ = ["BACKENDS", "Feed", "Final", "Logged", "ModelRef", "Tracker", "Tracking", "check",
           "check_dir", "log_ended", "open_tracker", "opened", "track_run"]
