"""Runs as a user handles them — the one Python API the CLI, tests and benchmarks call:

* :mod:`~tensorturn.runs.submit` — validate a spec, queue its run (:func:`submit`);
* :mod:`~tensorturn.runs.follow` — wait for a run to end (:func:`wait`), say why one stalls;
* :mod:`~tensorturn.runs.launch` — launch runs on a standing or an embedded pool and follow them
  to their end (``run``, ``distill``, ``resume``);
* :mod:`~tensorturn.runs.control` — :func:`cancel` a live run, :func:`resume` a stopped one;
* :mod:`~tensorturn.runs.records` — :func:`describe`, :func:`list_runs`, :func:`workers`,
  :func:`remove_run` and the like, from the broker or the store;
* :mod:`~tensorturn.runs.display` — a run as text (progress, outcome);
  :mod:`~tensorturn.runs.report` — its figures as plots.
"""

from tensorturn.runs.control import cancel, resume
from tensorturn.runs.follow import annotate, wait
from tensorturn.runs.launch import (
    Interrupted,
    Observer,
    Quiet,
    launch_distill,
    launch_resume,
    launch_run,
    launch_stages,
)
from tensorturn.runs.records import describe, list_runs, prune, refusals, remove_run, workers
from tensorturn.runs.submit import start_answer, submit, validate

__all__ = ["Interrupted", "Observer", "Quiet", "annotate", "cancel", "describe", "launch_stages",
           "launch_distill", "launch_resume", "launch_run", "list_runs", "prune", "refusals",
           "remove_run", "resume", "start_answer", "submit", "validate", "wait", "workers"]
