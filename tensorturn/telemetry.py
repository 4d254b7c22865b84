"""Worker hardware inventory and live figures, published to Redis every few seconds.

Each agent's main process runs the :class:`Heartbeat` bootstep: it writes the machine's inventory
once and its live figures (CPU, memory, GPU) every ``TENSORTURN_HEARTBEAT_S`` seconds
to ``tt:worker:<name>``. The task being trained reports its own progress (current task, step,
samples/s) into the same hash and as Celery ``task-progress`` events, which Flower shows.
The pool's roster (:mod:`tensorturn.roster`) reads it back.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import socket
import time
from functools import lru_cache
from typing import Any

import psutil
from celery import bootsteps
from celery.worker import state as worker_state

from . import config, routing
from .broker import redis_client
from .layout import live_key, run_key, worker_key

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 1.0     # how often a training task reports progress
GB = 1024 ** 3


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=1)
def inventory() -> dict[str, Any]:
    """What this machine is: fixed for the life of the agent."""
    import torch

    from .device import pick_device

    device = pick_device()
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "os": platform.platform(terse=True),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "memory_total_gb": round(psutil.virtual_memory().total / GB, 2),
        "device": device.type,
        "device_name": _cpu_model(),
        "vram_gb": None,
        "torch": torch.__version__,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device_name=props.name, vram_gb=round(props.total_memory / GB, 2),
                    gpu_count=torch.cuda.device_count())
    elif device.type == "mps":
        info.update(device_name="Apple MPS")
    offered = info["vram_gb"] if info["vram_gb"] else info["memory_total_gb"]
    cap = config.current().device_memory_gb
    if cap:
        offered = min(offered, cap)
    info["device_memory_gb"] = offered
    info["role"] = config.current().role
    return info


def live_figures() -> dict[str, Any]:
    """What this machine is doing now."""
    vm = psutil.virtual_memory()
    out: dict[str, Any] = {"cpu_percent": psutil.cpu_percent(interval=None),
                           "memory_used_gb": round((vm.total - vm.available) / GB, 2),
                           "gpu_util_percent": None, "gpu_memory_used_gb": None}
    if inventory()["device"] == "cuda":
        import torch

        try:
            free, total = torch.cuda.mem_get_info()
            out["gpu_memory_used_gb"] = round((total - free) / GB, 2)
            out["gpu_util_percent"] = torch.cuda.utilization()
        except Exception:  # noqa: BLE001 - pynvml may be missing; memory is enough
            pass
    return out


def outer_queues() -> list[str]:
    """The outer queues this agent serves (its role and device memory decide; :mod:`.routing`)."""
    return [q for q in routing.agent_queues() if q.startswith(routing.OUTER_PREFIX)]


class Heartbeat(bootsteps.StartStopStep):
    """Worker bootstep: publish inventory once and live figures every heartbeat."""

    requires = {"celery.worker.components:Timer"}

    def __init__(self, worker, **kwargs):
        super().__init__(worker, **kwargs)
        self.tref = None
        self.client: Any = None
        self.node = ""
        self.outer: list[str] = []

    def start(self, worker):
        self.node = worker.hostname
        self.client = redis_client(worker.app.conf.broker_url)
        self.outer = outer_queues()
        psutil.cpu_percent(interval=None)  # prime the counter
        self.beat(first=True)
        self.tref = worker.timer.call_repeatedly(config.current().heartbeat_s, self.beat,
                                                 priority=5)

    def beat(self, first: bool = False):
        try:
            key = worker_key(self.node)
            pipe = self.client.pipeline()
            if first:
                pipe.delete(key)
                pipe.hset(key, mapping={"started_at": time.time(), "tasks_done": 0})
            # the inventory goes out with every beat: a Redis that lost its data (restarted
            # without AOF) lists the machine again at the next heartbeat
            pipe.hset(key, mapping={"name": self.node, "inventory": json.dumps(inventory()),
                                    "live": json.dumps(live_figures()), "last_seen": time.time(),
                                    "pid": os.getpid()})
            if not worker_state.active_requests:  # a killed pool child leaves its progress behind
                pipe.hdel(key, "task", "progress")
            pipe.expire(key, 7 * 24 * 3600)
            pipe.hget(key, "quarantined")
            quarantined = pipe.execute()[-1]
            if self.outer and not quarantined:
                routing.advertise(self.client, self.node, self.outer)
            routing.reroute(self.client)
        except Exception as exc:  # noqa: BLE001 - the broker may be restarting
            log.warning("heartbeat failed: %s", exc)

    def stop(self, worker):
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None
        try:  # a clean stop is offline at once, not after three missed heartbeats
            self.client.hset(worker_key(self.node), "stopped_at", time.time())
            routing.withdraw(self.client, self.node, self.outer)
        except Exception:  # noqa: BLE001
            pass

    def terminate(self, worker):
        # a cold shutdown (the agent's SIGTERM) calls terminate, not stop: the base class's
        # would do nothing here, and the stop would look like a crash for three heartbeats
        self.stop(worker)


class TaskReporter:
    """Progress of the task a pool process is training: Redis for ``tensorturn workers``, and
    Celery ``task-progress`` events for Flower. Reports at most once per PROGRESS_EVERY_S.

    With ``live`` (run id, field) the same report goes to the run's live progress
    (:func:`tensorturn.layout.live_key`), in the same round trip, for ``run`` to show inside a
    round; the field is the task's place (``shard-3``, ``m1``), so the hash stays that small.
    That round trip also reads the run's state (``run_state``): a training loop learns of a
    cancel from its progress report, with no call of its own."""

    def __init__(self, task, client, label: str, steps: int, batch_size: int,
                 live: tuple[str, str] | None = None):
        self.task, self.client, self.label = task, client, label
        self.steps, self.batch_size, self.live = steps, batch_size, live
        self.run_state: str | None = None  # as the last report read it (with ``live``)
        self.worker = task.request.hostname or "?"
        self.t0 = self.last = time.monotonic()
        self._write({"task": label, "step": 0, "steps": steps, "samples_per_s": None})

    def _write(self, progress: dict[str, Any]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            pipe.hset(worker_key(self.worker), mapping={
                "task": self.label, "progress": json.dumps(progress)})
            if self.live is not None:
                run_id, field = self.live
                pipe.hset(live_key(run_id), field, json.dumps({
                    "label": self.label, "step": progress["step"], "steps": self.steps,
                    "loss": progress.get("loss"), "worker": self.worker, "at": time.time()}))
                pipe.hget(run_key(run_id), "state")
            replies = pipe.execute()
            if self.live is not None:
                self.run_state = replies[-1]
            self.task.send_event("task-progress", **progress)
        except Exception as exc:  # noqa: BLE001 - progress is best effort
            log.debug("progress report failed: %s", exc)

    def __call__(self, step: int, loss: float) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S and step < self.steps:
            return
        self.last = now
        rate = step * self.batch_size / max(now - self.t0, 1e-9)
        self._write({"task": self.label, "step": step, "steps": self.steps, "loss": loss,
                     "samples_per_s": round(rate, 1)})

    def done(self) -> None:
        try:
            pipe = self.client.pipeline()
            pipe.hdel(worker_key(self.worker), "task")
            pipe.hincrby(worker_key(self.worker), "tasks_done", 1)
            # this machine's training rate over its last whole task (backup copies weigh it)
            elapsed = max(time.monotonic() - self.t0, 1e-9)
            pipe.hset(worker_key(self.worker), "last_rate", round(self.steps * self.batch_size / elapsed, 1))
            pipe.execute()
        except Exception as exc:  # noqa: BLE001
            log.debug("progress report failed: %s", exc)
