"""The agent: a Celery worker of :mod:`tensorturn.pool.celery_app` that trains what the pool queues.

It opens outbound connections only (Redis and the object store) and takes one task per process
at a time (prefetch 1, late acks), so a faster machine simply comes back for work sooner.
"""

from __future__ import annotations

import os
import socket

from tensorturn import config


def worker_argv(name: str | None, concurrency: int, loglevel: str) -> list[str]:
    """Arguments for ``celery worker``: hostname ``NAME@host``, prefork pool, task events off
    until a monitor (Flower) enables them, and
    the queues of every model size this machine's device memory can hold — for training, for
    outer steps (:mod:`.routing`), or both, by its role — and its own queue."""
    from tensorturn.layout import agent_queue
    from tensorturn.pool.telemetry import agent_queues

    node = f"{name or 'agent'}@{socket.gethostname()}"
    queues = ",".join([*agent_queues(), agent_queue(node)])
    return ["worker", "--hostname", node, "--concurrency", str(concurrency), "--pool", "prefork",
            "--loglevel", loglevel, "--without-mingle", "--without-gossip",
            "--queues", queues]


def run_agent(name: str | None, concurrency: int, loglevel: str | None = None) -> None:
    from tensorturn.pool.celery_app import app
    from tensorturn.recipes import warm_up

    level = loglevel or config.current().loglevel
    # CUDA must not start in this process, whose forks run the tasks: torch's look for a GPU
    # asks the driver through NVML instead (telemetry asks nvidia-smi; tasks start CUDA themselves)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    warm_up()  # before the pool forks: every pool process starts with torch and the recipes loaded
    app.worker_main(worker_argv(name, concurrency, level))
