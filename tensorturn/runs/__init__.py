"""Runs as a user handles them — the one Python API the CLI, tests and benchmarks call:

* :mod:`~tensorturn.runs.request` — a run as a user asks for it, checked once (:class:`RunRequest`);
* :mod:`~tensorturn.runs.submit` — queue a run: set it up on an idle agent or here (:func:`submit`);
* :mod:`~tensorturn.runs.follow` — wait for a run to end (:func:`wait`), say why one stalls;
* :mod:`~tensorturn.runs.launch` — the one way runs start: a :class:`Launcher` holds the pool and
  the store, starts runs on it (or on an embedded pool) and follows them to their end (``run``,
  ``distill``, ``resume``);
* :mod:`~tensorturn.runs.control` — :func:`cancel` a live run, :func:`resume` a stopped one;
* :mod:`~tensorturn.runs.records` — :func:`describe`, :func:`list_runs`, :func:`workers`,
  :func:`remove_run` and the like, from the broker or the store;
* :mod:`~tensorturn.runs.display` — a run as text (progress, outcome);
  :mod:`~tensorturn.runs.report` — its figures as plots.
"""

from tensorturn.runs.control import cancel, resume
from tensorturn.runs.follow import annotate, wait
from tensorturn.runs.launch import Interrupted, Launcher, Observer, Quiet
from tensorturn.runs.records import describe, list_runs, prune, refusals, remove_run, workers
from tensorturn.runs.request import RunRequest, validate
from tensorturn.runs.submit import start_answer, submit

__all__ = ["Interrupted", "Launcher", "Observer", "Quiet", "RunRequest", "annotate", "cancel",
           "describe", "list_runs", "prune", "refusals", "remove_run", "resume",
           "start_answer", "submit", "validate", "wait", "workers"]
