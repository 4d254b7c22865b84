"""The agent: a Celery worker of :mod:`tensorturn.pool.celery_app` that trains what the pool queues.

It opens outbound connections only (Redis and the object store) and takes one task per process
at a time (prefetch 1, late acks), so a faster machine simply comes back for work sooner.
"""

from __future__ import annotations

import logging
import os
import socket
import warnings

from tensorturn import config, platforms
from tensorturn.pool.threads import CLASS as THREADS
from tensorturn.pool.threads import pool_of

log = logging.getLogger(__name__)


def worker_argv(name: str | None, concurrency: int, loglevel: str, pool: str = "prefork") -> list[str]:
    """Arguments for ``celery worker``: hostname ``NAME@host``, its pool (prefork; the threads
    pool is set in the app's configuration, :mod:`.threads`), task events off until a monitor
    (Flower) enables them, and
    the queues of every model size this machine's device memory can hold — for training, for
    outer steps (:mod:`.routing`), or both, by its role — and its own queue."""
    from tensorturn.layout import agent_queue
    from tensorturn.pool.telemetry import agent_queues

    node = f"{name or 'agent'}@{socket.gethostname()}"
    queues = ",".join([*agent_queues(), agent_queue(node)])
    argv = ["worker", "--hostname", node, "--concurrency", str(concurrency),
            "--loglevel", loglevel, "--without-mingle", "--without-gossip", "--queues", queues]
    return argv + (["--pool", "prefork"] if pool == "prefork" else [])


def run_agent(name: str | None, concurrency: int, loglevel: str | None = None) -> None:
    from tensorturn.pool.celery_app import app
    from tensorturn.recipes import warm_up

    level = loglevel or config.current().loglevel
    pool = pool_of(config.current())
    # CUDA must not start in this process, whose forks run the tasks: torch's look for a GPU
    # asks the driver through NVML instead (telemetry asks nvidia-smi; tasks start CUDA themselves)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    warm_up()  # before the pool forks: every pool process starts with torch and the recipes loaded
    quiet_root_advice()
    from celery.signals import worker_ready

    # once Celery's stop handlers are in place: Ctrl-Break (Windows) stops as Ctrl-C does
    worker_ready.connect(lambda **_: platforms.stop_on_break(), weak=False)
    if pool == "threads":
        app.conf.worker_pool = THREADS  # a class path: Celery's --pool takes only its own names
    app.worker_main(worker_argv(name, concurrency, level, pool))


def quiet_root_advice() -> None:
    """Celery warns a worker started as root (or in the sudo or wheel group) with advice for
    its own ``--uid`` option, which ``tensorturn agent`` has not: that advice is silenced, and
    an agent run as root says so in one line of its own. (Its refusal to run as root with
    pickle cannot apply: the pool accepts JSON only.)"""
    from celery.exceptions import SecurityWarning

    warnings.filterwarnings("ignore", category=SecurityWarning)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        log.warning("this agent runs as root: the recipes it runs have root's rights on this "
                    "machine; start it as an ordinary user where you can")
