"""Worker hardware inventory and live figures, published to Redis every few seconds.

Each agent's main process runs the :class:`Heartbeat` bootstep: it writes the machine's inventory
once and its live figures (CPU, memory, GPU) every ``TENSORTURN_HEARTBEAT_S`` seconds
to ``tt:worker:<name>``. The task being trained reports its own progress (current task, step,
samples/s) into the same hash and, every few seconds, as Celery ``task-progress`` events, which
Flower shows.
The pool's roster (:mod:`tensorturn.state.roster`) reads it back.

What a heartbeat says about the machine is signed with the pool key, and so is a quarantine
mark, for this start of the agent (:data:`INCARNATION`): the roster counts no machine whose
heartbeat anyone with the Redis password could have written, and the heartbeat removes a
quarantine mark that this agent's own tasks did not sign.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import psutil
from celery import bootsteps
from celery.worker import state as worker_state

from tensorturn import config, trust
from tensorturn.layout import OUTER_PREFIX, agent_queue
from tensorturn.pool import routing
from tensorturn.pool.capacity import queues_for
from tensorturn.pool.owner import OwnerRules, standing
from tensorturn.pool.threads import pool_of
from tensorturn.state import roster
from tensorturn.state.broker import redis_client
from tensorturn.state.budget import Budget
from tensorturn.state.clock import broker_now
from tensorturn.state.workers import Workers
from tensorturn.store.links import DOWN, UP, Ewma, Sample, meter, probe

log = logging.getLogger(__name__)

PROGRESS_EVERY_S = 1.0     # how often a training task reports progress
PROGRESS_EVENT_EVERY_S = 10.0  # how often it also sends a Celery task-progress event (Flower)
GB = 1024 ** 3
MIB = 1024 ** 2
# This start of the agent: made in the main process before the pool forks, so its tasks share
# it. Signed quarantine marks and remote-control commands (:mod:`.remote_control`) name it, so a
# copy of one replayed after a restart binds nobody. Read it as ``telemetry.INCARNATION``, when
# needed: an agent forked from a warm parent makes its own (:func:`new_incarnation`).
INCARNATION = secrets.token_hex(8)


def new_incarnation() -> None:
    """Make this process a new start of an agent (:data:`INCARNATION`): an agent forked from an
    embedded pool's warm parent (:mod:`.warm`), which imported this module, would otherwise
    share the parent's with every agent it forks — those it forks again after a kill included,
    which a mark or command signed for the killed one would then bind."""
    global INCARNATION
    INCARNATION = secrets.token_hex(8)


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

    from tensorturn.train.device import pick_device

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
        name, total_mib, count = _gpu("name,memory.total,count") or _gpu_from_torch()
        info.update(device_name=name, vram_gb=round(float(total_mib) * MIB / GB, 2), gpu_count=int(count))
    elif device.type == "mps":
        info.update(device_name="Apple MPS")
    offered = info["vram_gb"] if info["vram_gb"] else info["memory_total_gb"]
    cap = config.current().device_memory_gb
    if cap:
        offered = min(offered, cap)
    info["device_memory_gb"] = offered
    info["role"] = config.current().role
    info["pool"] = pool_of(config.current())
    return info


def live_figures() -> dict[str, Any]:
    """What this machine is doing now."""
    vm = psutil.virtual_memory()
    out: dict[str, Any] = {"cpu_percent": psutil.cpu_percent(interval=None),
                           "memory_used_gb": round((vm.total - vm.available) / GB, 2),
                           "gpu_util_percent": None, "gpu_memory_used_gb": None}
    if inventory()["device"] == "cuda":
        used = _gpu("memory.used,utilization.gpu", timeout_s=2)  # on the heartbeat: never long
        if used:
            with contextlib.suppress(ValueError):  # "[N/A]" on some boards: left out
                out["gpu_memory_used_gb"] = round(float(used[0]) * MIB / GB, 2)
                out["gpu_util_percent"] = float(used[1])
    return out


# The agent's main process never starts CUDA: Celery's pool processes are forked from it, and a
# process forked after CUDA started cannot use the GPU ("Cannot re-initialize CUDA in forked
# subprocess" — every task failed so on a GPU machine). So what the main process says about
# the GPU it asks of the driver (``nvidia-smi``, NVML's command-line face, which comes with every
# NVIDIA driver), and torch answers only in a process of its own.

def _gpu(fields: str, timeout_s: float = 10) -> list[str] | None:
    """``fields`` of the GPU tasks use (the first visible one), from ``nvidia-smi``; None without it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    command = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    if visible.isdigit():
        command += ["-i", visible]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = done.stdout.strip().splitlines() if done.returncode == 0 else []
    values = [v.strip() for v in lines[0].split(",")] if lines else []
    return values if len(values) == len(fields.split(",")) else None


def _gpu_from_torch() -> list[str]:
    """(name, MiB, count) from torch in a child process, where there is no ``nvidia-smi``."""
    code = ("import torch; p = torch.cuda.get_device_properties(0); "
            "print(p.name, p.total_memory // 2 ** 20, torch.cuda.device_count(), sep='\\t')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        return ["CUDA device", "0", "1"]  # VRAM unknown: it offers its memory, as a CPU machine does
    return done.stdout.strip().split("\t")


def agent_queues(role: str | None = None) -> list[str]:
    """The queues this machine's agent consumes (its own queue aside), by its role (default:
    the configured one) and the device memory it offers."""
    return routing.consumed(role or config.current().role, queues_for(inventory()["device_memory_gb"]))


def outer_queues() -> list[str]:
    """The outer queues this agent serves (its role and device memory decide; :mod:`.routing`)."""
    return [q for q in agent_queues() if q.startswith(OUTER_PREFIX)]


PINGS = 3        # the broker's round trip is the median of this many PINGs...
PING_EVERY = 10  # ...every this many heartbeats (the first one's too)


def hand_over(node: str, broker_url: str) -> Callable[[Sample], None]:
    """What a process of agent ``node`` does with a timed store transfer: hand it to the agent's
    heartbeat through the broker (its pool processes are not the process that beats). A
    client per process: a forked pool process makes its own."""
    clients: dict[int, Any] = {}

    def hook(sample: Sample) -> None:
        client = clients.get(os.getpid())
        if client is None:
            client = clients[os.getpid()] = redis_client(broker_url)
        Workers(client).link_sample(node, sample.direction, sample.nbytes, sample.seconds)

    return hook


class Links:
    """What the heartbeat says of the machine's links: the measured rates to and from the store
    (an average of every timed transfer of the agent's processes, the start's probe first) and
    when they were measured, on the broker's clock; the broker's round trip, every
    :data:`PING_EVERY` beats."""

    def __init__(self) -> None:
        self.ewma = {UP: Ewma(), DOWN: Ewma()}
        self.measured_at = 0.0
        self.rtt_s: float | None = None
        self.beats = 0

    def fold(self, samples: list[list[Any]], now: float) -> None:
        """Timed transfers (direction, bytes, seconds), oldest first."""
        for direction, nbytes, seconds in samples:
            self.ewma[direction].add(nbytes / seconds)
            self.measured_at = now

    def ping(self, workers: Workers) -> None:
        """The median of :data:`PINGS` round trips to the broker."""
        self.rtt_s = statistics.median(workers.round_trips(PINGS))

    def fields(self, rules: OwnerRules, data_used: int | None) -> dict[str, str]:
        """The heartbeat's link fields (:data:`tensorturn.state.roster.LINK_FIELDS`): strings, ""
        for what was never measured (never a figure made up)."""
        cap = rules.data
        up, down = self.ewma[UP].value, self.ewma[DOWN].value
        return {"link_up_bps": "" if up is None else f"{up:.0f}",
                "link_down_bps": "" if down is None else f"{down:.0f}",
                "link_measured_at": repr(self.measured_at) if self.measured_at else "",
                "broker_rtt_s": "" if self.rtt_s is None else f"{self.rtt_s:.6f}",
                "cap_up_bps": f"{rules.cap_up_bps:.0f}", "cap_down_bps": f"{rules.cap_down_bps:.0f}",
                "data_cap_bytes": str(cap.bytes if cap else 0), "data_cap_period": cap.period if cap else "",
                "data_used_bytes": str(data_used or 0) if cap else "0"}


class Heartbeat(bootsteps.StartStopStep):
    """Worker bootstep: publish inventory once and live figures every heartbeat; measure the
    link to the store once at the start (:func:`tensorturn.store.links.probe`, on a thread of
    its own) and the broker's round trip every :data:`PING_EVERY` beats."""

    requires = {"celery.worker.components:Timer"}

    def __init__(self, worker, **kwargs):
        super().__init__(worker, **kwargs)
        self.tref = None
        self.client: Any = None
        self.node = ""
        self.outer: list[str] = []
        self.links: Links | None = Links()
        # before the pool forks (it starts after this step is made): every process of the agent
        # hands its timed transfers to this heartbeat
        meter.on_sample = hand_over(worker.hostname, worker.app.conf.broker_url)

    def start(self, worker):
        self.node = worker.hostname
        self.client = redis_client(worker.app.conf.broker_url)
        worker.tt_heartbeat = self.beat  # the owner watch beats at once when it pauses or resumes
        worker.tt_queues = [*agent_queues(), agent_queue(self.node)]  # what it consumes again on resume
        worker.tt_incarnation = INCARNATION  # what the owner's marks are signed for (.owner)
        self.outer = outer_queues()
        psutil.cpu_percent(interval=None)  # prime the counter
        local = OwnerRules.from_settings(config.current())
        meter.set_caps(local.cap_up_bps, local.cap_down_bps)  # until the owner watch has looked
        self.beat(first=True)
        self.tref = worker.timer.call_repeatedly(config.current().heartbeat_s, self.beat,
                                                 priority=5)
        if config.current().store_url:  # an agent of a pool with a store of its own says how far it is
            threading.Thread(target=self.probe, args=(config.current().store_url,),
                             name="tt-link-probe", daemon=True).start()

    def probe(self, url: str) -> None:
        """Measure the link to the store (at most 4 MB or 2 s each way) and count what it moved
        against the data budget; the heartbeats after it say what it measured."""
        from tensorturn.store.objects import open_store

        try:
            done = probe(open_store(url), self.node)
            Budget(self.client).add(self.node, done.nbytes)
            log.info("link to the store: %s up, %s down", _rate(done.up_bps), _rate(done.down_bps))
        except Exception as exc:  # noqa: BLE001 - the figure stays "not measured"
            log.warning("the link to the store was not measured: %s", exc)

    @property
    def workers(self) -> Workers:
        """The pool's machines on the broker this agent beats to."""
        return Workers(self.client)

    def beat(self, first: bool = False):
        try:
            now = broker_now(self.client)
            links = self.links = getattr(self, "links", None) or Links()  # (tests make the step bare)
            links.beats += 1
            if links.beats % PING_EVERY == 1:
                links.ping(self.workers)
            rules = standing.rules or OwnerRules.from_settings(config.current())
            # the inventory goes out with every beat: a Redis that lost its data (restarted
            # without AOF) lists the machine again at the next heartbeat; a killed pool child
            # leaves its progress behind (cleared while no task runs). The transfers timed
            # since the last beat come back in the same round trip: the next beat says them.
            mark, sig, samples = self.workers.beat(
                self.node, {**signed_beat(self.node, now, links.fields(rules, standing.data_used)),
                            "live": json.dumps(live_figures()), "pid": os.getpid()},
                first=first, idle=not worker_state.active_requests)
            links.fold(samples, now)
            quarantined = standing.quarantined = self.quarantined(mark, sig)
            if self.outer and not quarantined and not standing.paused:
                routing.advertise(self.client, self.node, self.outer)
            elif self.outer and standing.paused:  # its owner needs it: no outer step waits for it
                routing.withdraw(self.client, self.node, self.outer)
            routing.reroute(self.client)
        except Exception as exc:  # noqa: BLE001 - the broker may be restarting
            log.warning("heartbeat failed: %s", exc)

    def quarantined(self, mark: str | None, sig: str | None) -> bool:
        """Whether this agent is out of rotation: a quarantine ``mark`` signed (``sig``) for
        this start of it. Any other mark is removed (nobody with only the Redis password takes
        an agent out of rotation for longer than a heartbeat)."""
        if not mark:
            return False
        key = trust.find_key()
        h = {"name": self.node, "quarantined": mark, roster.QUARANTINE_SIGNATURE: sig}
        if key is not None and roster.quarantine_verified(key, h, INCARNATION):
            return True
        log.warning("removed a quarantine mark this agent did not sign: %.200s", mark)
        self.workers.unquarantine(self.node)
        return False

    def stop(self, worker):
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None
        try:  # a clean stop is offline at once, not after three missed heartbeats
            self.workers.stopped(self.node)
            routing.withdraw(self.client, self.node, self.outer)
        except Exception:  # noqa: BLE001
            pass

    def terminate(self, worker):
        # a cold shutdown (the agent's SIGTERM) calls terminate, not stop: the base class's
        # would do nothing here, and the stop would look like a crash for three heartbeats
        self.stop(worker)


def signed_beat(node: str, now: float, links: dict[str, str] | None = None) -> dict[str, str]:
    """This agent's heartbeat fields, signed with the pool key (unsigned without one: such an
    agent refuses every task anyway, and the roster says ``unverified``). ``paused``: why its
    owner's policy has it step aside (:mod:`.owner`), empty while it works; ``owner``: the
    numbers of its owner's marks it holds (so `tensorturn workers --json` shows which word of
    the owner's it took); ``links``: what it measured of its links, and its owner's caps
    (:meth:`Links.fields`; every one "" when not given: not measured, no cap)."""
    fields = {"name": node, "inventory": json.dumps(inventory()),
              "queues": json.dumps(agent_queues()), "last_seen": repr(now),
              "incarnation": INCARNATION, "paused": standing.paused or "",
              "owner": json.dumps(standing.marks, sort_keys=True),
              **{f: "" for f in roster.LINK_FIELDS}, **(links or {})}
    key = trust.find_key()
    if key is not None:
        fields[roster.SIGNATURE] = key.sign("inventory", roster.heartbeat_doc(fields))
    return fields


def quarantine_mark(node: str, reason: str) -> dict[str, str]:
    """The fields that take agent ``node`` — this one, from one of its tasks — out of rotation,
    signed for this start of it."""
    sig = trust.pool_key().sign("quarantine", roster.quarantine_doc(node, reason, INCARNATION))
    return {"quarantined": reason, roster.QUARANTINE_SIGNATURE: sig}


class TaskReporter:
    """Progress of the task a pool process is training: Redis for ``tensorturn workers``, and
    Celery ``task-progress`` events for Flower. Reports at most once per PROGRESS_EVERY_S, and
    at the last step if it reported before; a task shorter than that reports nothing (the
    attempt's begin names the task on the worker's hash, its end says it is done). Celery events go at most once per
    PROGRESS_EVENT_EVERY_S: each is a broker command, and nobody may be listening.

    With ``live`` (run id, field) the same report goes to the run's live progress
    (:func:`tensorturn.layout.live_key`), in the same round trip, for ``run`` to show inside a
    round; the field is the task's place (``shard-3``, ``m1``), so the hash stays that small.
    That round trip also reads the run's state (``run_state``) and whether the agent is paused
    (``paused``): a training loop learns of a cancel, or that its machine's owner needs it, from
    its progress report, with no call of its own."""

    def __init__(self, task, client, label: str, steps: int, batch_size: int,
                 live: tuple[str, str] | None = None):
        self.task, self.workers, self.label = task, Workers(client), label
        self.steps, self.batch_size, self.live = steps, batch_size, live
        self.run_state: str | None = None  # as the last report read it (with ``live``)
        self.paused: str | None = None     # why this machine's owner needs it, as the last report read
        self.read_at_end = False  # the last report was the last step's, and read the run's state
        self.reported = False
        self.worker = task.request.hostname or "?"
        self.t0 = self.last = time.monotonic()
        self.evented = self.t0

    def _write(self, progress: dict[str, Any]) -> None:
        self.read_at_end, self.reported = False, True
        try:
            live = None
            if self.live is not None:
                run_id, field = self.live
                live = (run_id, field, {
                    "label": self.label, "step": progress["step"], "steps": self.steps,
                    "loss": progress.get("loss"), "worker": self.worker, "at": broker_now(self.workers.r)})
            state, self.paused = self.workers.report(self.worker, self.label, progress, live)
            if self.live is not None:
                self.run_state = state
                self.read_at_end = progress["step"] >= self.steps
            if time.monotonic() - self.evented >= PROGRESS_EVENT_EVERY_S:
                self.evented = time.monotonic()
                self.task.send_event("task-progress", **progress)
        except Exception as exc:  # noqa: BLE001 - progress is best effort
            log.debug("progress report failed: %s", exc)

    def __call__(self, step: int, loss: float) -> None:
        now = time.monotonic()
        if now - self.last < PROGRESS_EVERY_S and (step < self.steps or not self.reported):
            return  # the last step is reported when an earlier one was: a short task reports none
        self.last = now
        rate = step * self.batch_size / max(now - self.t0, 1e-9)
        self._write({"task": self.label, "step": step, "steps": self.steps, "loss": loss,
                     "samples_per_s": round(rate, 1)})

    def done(self) -> float:
        """This machine's training rate over the whole task, samples/s (backup copies weigh it):
        the attempt's end records it with the task done."""
        return round(self.steps * self.batch_size / max(time.monotonic() - self.t0, 1e-9), 1)


def _rate(bps: float | None) -> str:
    return "not measured" if bps is None else f"{bps * 8 / 1e6:.1f} Mbit/s"
