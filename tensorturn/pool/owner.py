"""The owner comes first: an agent that steps aside while its machine's owner needs it.

A gaming PC trains at night and is played on in the evening; a laptop runs on battery; a
workstation is used by day; a home line carries a video call, and a metered one has an allowance.
Each agent has its owner's **rules** (:class:`OwnerRules`; no relation to a fused run's sync
policy) — allowed hours, pause on battery, pause while other processes keep the CPU busy or use
the GPU, caps on its store transfers in Mbit/s (a token bucket: :mod:`tensorturn.store.links`)
and a data cap per day, week or month (past it, it pauses: :mod:`tensorturn.state.budget`) —
from its command line
(``tensorturn agent --hours 22:00-08:00 --pause-on-battery ...``) or ``TENSORTURN_*`` variables,
replaced while it runs by ``tensorturn rules MACHINE ...`` (``policy``, its older name, still
works) from any machine holding the join file,
and the owner may pause it outright (``tensorturn pause MACHINE`` / ``unpause``).

:class:`OwnerWatch` (a worker bootstep, on a thread of its own) looks every second. When the
machine should step aside it

1. stops consuming every queue (nothing new is fetched),
2. says so in its signed heartbeat — ``paused`` with the reason, for ``workers``, ``status`` and
   Flower — and in the same field the running task's progress report reads: a training task
   hands itself back within about a second (:class:`HandedBack`): the attempt is recorded
   ``handed back``, costs none of the run's attempts, and its message goes back to the queue for
   another machine — from the same weights with the same seed, so the same result;
3. and when the rules allow again, consumes its queues again.

A round's slot waiting for its weights reads the same field and hands itself back too.
Outer steps and evaluations finish first (they are short: the outer step runs in the task of a
round's last shard, or beside the store where an agent serves there).

The readings (hours, battery, CPU, GPU) are the machine's own, so the hours are its local
time — the owner's clock, not the broker's. CPU: the share of all cores that processes other than
this agent and its pool used since the last look, over :data:`BUSY_LOOKS` looks in a row to pause
and :data:`CALM_LOOKS` to resume (a game's loading screen must not flap the agent). GPU: another
process on it, from ``nvidia-smi`` (where there is none, the rules have nothing to read).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime
from datetime import time as clock_time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
from celery import bootsteps

from tensorturn import config, platforms, testbed_hooks, trust
from tensorturn.errors import SpecError
from tensorturn.state.broker import redis_client
from tensorturn.state.budget import Budget, DataCap, parse_cap
from tensorturn.state.owners import Mark, Owners
from tensorturn.store.links import MBIT, meter

log = logging.getLogger(__name__)

LOOK_S = 1.0     # how often the agent looks at its owner's marks and its machine
BUSY_LOOKS = 2   # looks in a row over the CPU threshold before it pauses
CALM_LOOKS = 5   # looks in a row under it before it resumes
HOURS = re.compile(r"^([01]?\d|2[0-3]):([0-5]\d)-([01]?\d|2[0-3]):([0-5]\d)$")


class HandedBack(Exception):
    """This machine's owner needs it: the attempt ends ``handed back: <why>``, costs none of the
    run's attempts, and its task goes back to the queue for another machine."""


# ---- the owner's rules -------------------------------------------------------------------------

@dataclass(frozen=True)
class OwnerRules:
    """When an agent steps aside for its machine's owner (stored in the owner's ``policy`` mark,
    the field's name since before these were called rules). ``hours``: the local times it may work, ``HH:MM-HH:MM``
    ranges, comma-separated (a range may pass midnight); None: any time. ``busy_percent``: pause
    while other processes use more than this share of the CPU (0: never)."""

    hours: str | None = None
    on_battery: bool = False
    busy_percent: float = 0.0
    gpu_shared: bool = False
    max_upload_mbit: float = 0.0    # the store link's caps, Mbit/s (0: none): a token bucket
    max_download_mbit: float = 0.0  # on every transfer (:mod:`tensorturn.store.links`)
    data_cap: str = ""              # GB per day, week or month, "200/month" ("": none)

    def __post_init__(self) -> None:
        if self.hours is not None:
            parse_hours(self.hours)
        if not 0 <= self.busy_percent <= 100:
            raise SpecError(f"the CPU threshold must be a percentage from 0 to 100 (got {self.busy_percent:g})")
        for what, mbit in (("upload", self.max_upload_mbit), ("download", self.max_download_mbit)):
            if not (math.isfinite(mbit) and mbit >= 0):
                raise SpecError(f"the {what} cap must be a number of Mbit/s ≥ 0; 0: none (got {mbit:g})")
        if self.data_cap:
            parse_cap(self.data_cap)

    @classmethod
    def from_settings(cls, settings: config.Settings) -> OwnerRules:
        return cls(hours=settings.hours or None, on_battery=bool(settings.pause_on_battery),
                   busy_percent=float(settings.pause_busy_percent), gpu_shared=bool(settings.pause_gpu_shared),
                   max_upload_mbit=float(settings.max_upload_mbit), max_download_mbit=float(settings.max_download_mbit),
                   data_cap=settings.data_cap_gb or "")

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> OwnerRules:
        doc = json.loads(text)
        return cls(hours=doc.get("hours"), on_battery=bool(doc.get("on_battery")),
                   busy_percent=float(doc.get("busy_percent") or 0), gpu_shared=bool(doc.get("gpu_shared")),
                   max_upload_mbit=float(doc.get("max_upload_mbit") or 0),
                   max_download_mbit=float(doc.get("max_download_mbit") or 0),
                   data_cap=str(doc.get("data_cap") or ""))

    @property
    def cap_up_bps(self) -> float:
        """The upload cap in bytes/s (0: none)."""
        return self.max_upload_mbit * MBIT

    @property
    def cap_down_bps(self) -> float:
        return self.max_download_mbit * MBIT

    @property
    def data(self) -> DataCap | None:
        """The data cap (None: none)."""
        return parse_cap(self.data_cap) if self.data_cap else None

    def describe(self) -> str:
        parts = [f"hours {self.hours}" if self.hours else "any hour"]
        if self.on_battery:
            parts.append("pause on battery")
        if self.busy_percent:
            parts.append(f"pause while others use > {self.busy_percent:g}% CPU")
        if self.gpu_shared:
            parts.append("pause while another process uses the GPU")
        if self.max_upload_mbit:
            parts.append(f"upload ≤ {self.max_upload_mbit:g} Mbit/s")
        if self.max_download_mbit:
            parts.append(f"download ≤ {self.max_download_mbit:g} Mbit/s")
        if self.data_cap:
            parts.append(f"pause past {self.data}")
        return ", ".join(parts)


def parse_hours(text: str) -> list[tuple[clock_time, clock_time]]:
    """``22:00-08:00,12:00-13:30`` as (start, end) pairs; SpecError for anything else."""
    ranges = []
    for part in text.replace(" ", "").split(","):
        m = HOURS.match(part)
        if not m:
            raise SpecError(f"hours must be HH:MM-HH:MM ranges, comma-separated, e.g. 22:00-08:00 (got {text!r})")
        start, end = clock_time(int(m[1]), int(m[2])), clock_time(int(m[3]), int(m[4]))
        if start == end:
            raise SpecError(f"the hours {part} are empty: start and end are the same")
        ranges.append((start, end))
    return ranges


def within_hours(text: str, now: clock_time) -> bool:
    """Whether the local time ``now`` is in one of the ranges of ``text``."""
    for start, end in parse_hours(text):
        if (start <= now < end) if start < end else (now >= start or now < end):
            return True
    return False


@dataclass
class Readings:
    """What the machine says now."""

    local_time: clock_time
    on_battery: bool | None = None          # None: no battery, or no sensor
    others_busy: bool = False               # other processes over the CPU threshold, held
    others_percent: float | None = None
    gpu_others: list[tuple[int, float]] = field(default_factory=list)  # (pid, MiB) of others on the GPU
    data_used: int | None = None            # bytes moved in the data cap's period (None: not read)


def why_paused(rules: OwnerRules, readings: Readings) -> str | None:
    """Why the owner's rules want the machine left alone now, in words; None when it may work."""
    if rules.hours and not within_hours(rules.hours, readings.local_time):
        return f"outside hours ({rules.hours})"
    if rules.on_battery and readings.on_battery:
        return "on battery"
    if rules.busy_percent and readings.others_busy:  # (not the live figure: the reason stays put)
        return f"owner: other processes use over {rules.busy_percent:g}% of the CPU"
    if rules.gpu_shared and readings.gpu_others:
        pid, mib = readings.gpu_others[0]
        return f"owner: another process uses the GPU (pid {pid}, {mib / 1024:.1f} GB)"
    cap = rules.data
    if cap is not None and readings.data_used is not None and readings.data_used >= cap.bytes:
        return f"data cap ({cap})"
    return None


# ---- the machine's readings --------------------------------------------------------------------

def on_battery() -> bool | None:
    """Whether the machine runs on battery now; None without a battery. Its sensor's reading
    (:func:`battery_sensor`), or where tests emulate one, theirs
    (:data:`tensorturn.testbed_hooks.battery_sensor`)."""
    return (testbed_hooks.battery_sensor or battery_sensor)()


def battery_sensor() -> bool | None:
    """The machine's battery sensor: on battery, on mains, or None (no battery, no sensor)."""
    try:
        battery = psutil.sensors_battery()
    except (AttributeError, NotImplementedError, OSError):
        return None
    return None if battery is None or battery.power_plugged is None else not battery.power_plugged


def own_processes(root: int | None = None) -> list[psutil.Process]:
    """This agent's processes: its main process and every descendant (the pool, a spawned helper)."""
    try:
        me = psutil.Process(root or os.getpid())
        return [me, *me.children(recursive=True)]
    except psutil.Error:
        return []


class CpuWatch:
    """The share of all cores that processes other than this agent's used between two looks,
    and whether it stayed over a threshold for :data:`BUSY_LOOKS` looks (then until it stayed
    under for :data:`CALM_LOOKS`)."""

    def __init__(self, processes: Callable[[], list[psutil.Process]] = own_processes,
                 clock: Callable[[], float] = time.monotonic):
        self.processes, self.clock = processes, clock
        self.last: tuple[float, float, dict[int, float]] | None = None
        self.over = self.under = 0
        self.busy = False
        self.percent: float | None = None

    def look(self, threshold: float) -> bool:
        """Whether others keep the CPU busy over ``threshold`` percent (0: not watched)."""
        if not threshold:  # not watched: nothing read, and a later threshold starts afresh
            self.last, self.over, self.under, self.busy, self.percent = None, 0, 0, False, None
            return False
        self.percent = self.sample()
        if self.percent is None:
            return self.busy
        if self.percent > threshold:
            self.over, self.under = self.over + 1, 0
        else:
            self.over, self.under = 0, self.under + 1
        if not self.busy and self.over >= BUSY_LOOKS:
            self.busy = True
        elif self.busy and self.under >= CALM_LOOKS:
            self.busy = False
        return self.busy

    def sample(self) -> float | None:
        """Others' percent of the machine since the last call (None on the first); where tests
        emulate an owner, what :data:`tensorturn.testbed_hooks.others_cpu` makes of it."""
        reading = self.reading()
        return testbed_hooks.others_cpu(reading) if testbed_hooks.others_cpu else reading

    def reading(self) -> float | None:
        """The machine's own figure for :meth:`sample`."""
        times = psutil.cpu_times()
        busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
        own = {}
        for p in self.processes():
            try:
                t = p.cpu_times()
                own[p.pid] = t.user + t.system
            except psutil.Error:
                continue
        now, last = self.clock(), self.last
        self.last = (now, busy, own)
        if last is None:
            return None
        then, busy_then, own_then = last
        mine = sum(cpu - own_then.get(pid, 0.0) for pid, cpu in own.items())
        span = (now - then) * (psutil.cpu_count() or 1)
        return max(0.0, min(100.0, 100.0 * (busy - busy_then - mine) / span)) if span > 0 else None


def gpu_others(own: set[int]) -> list[tuple[int, float]]:
    """(pid, MiB) of the processes other than ``own`` on this machine's GPUs, from ``nvidia-smi``;
    empty without one."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_compute_apps(done.stdout, own) if done.returncode == 0 else []


def parse_compute_apps(text: str, own: set[int]) -> list[tuple[int, float]]:
    """``nvidia-smi --query-compute-apps=pid,used_memory``'s lines, less ``own`` processes."""
    out = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2 or not parts[0].isdigit():
            continue
        try:
            mib = float(parts[1])
        except ValueError:  # "[N/A]" where the driver does not say
            mib = 0.0
        if int(parts[0]) not in own:
            out.append((int(parts[0]), mib))
    return out


# ---- the agent's side --------------------------------------------------------------------------

class Standing:
    """Whether this agent is paused and why (None: at work): what its heartbeat says, set by
    :class:`OwnerWatch`. One per agent process (its pool processes read the broker instead)."""

    def __init__(self) -> None:
        self.paused: str | None = None
        self.rules: OwnerRules | None = None
        self.quarantined = False  # as its last heartbeat read its quarantine mark
        self.marks: dict[str, int] = {}  # the owner's marks it holds, by field: their numbers
        self.data_used: int | None = None  # bytes moved in the data cap's period, as last read


standing = Standing()


class OwnerWatch(bootsteps.StartStopStep):
    """Worker bootstep: look at the owner's marks and the machine every :data:`LOOK_S`, and
    step aside (or back) as the owner's rules say.

    What it wants (``standing.paused``) and what Celery does are kept apart: each look asks the
    event loop (:meth:`apply`, on the loop's thread, where Celery's consumer lives) to make the
    consumer match, until it does — so a pause decided before the consumer exists (an agent
    started outside its hours) still takes hold, and a pause, resume and pause in quick
    succession cannot leave it consuming."""

    requires = {"tensorturn.pool.telemetry:Heartbeat"}

    def __init__(self, worker, **kwargs):
        super().__init__(worker, **kwargs)
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None
        self.worker = worker
        self.cpu = CpuWatch()
        self.marks: MarkMemory  # at start: it needs the agent's name and start
        self.budget: Budget     # at start: it needs the broker
        self.applied = False  # the consumer was paused by this watch (apply: the loop's thread only)

    def start(self, worker):
        self.worker = worker
        self.stopping.clear()
        self.thread = threading.Thread(target=self.keep, args=(redis_client(worker.app.conf.broker_url),),
                                       name="tt-owner-watch", daemon=True)
        self.thread.start()

    def stop(self, worker):
        self.stopping.set()

    terminate = stop

    def keep(self, client: Any) -> None:
        settings = config.current()
        local = OwnerRules.from_settings(settings)
        owners = Owners(client)
        self.budget = Budget(client)
        node = self.worker.hostname
        self.marks = MarkMemory(node, self.worker.tt_incarnation, trust.find_key(),  # (the Heartbeat step's)
                                memory_path(settings, node, self.worker.app.conf.broker_url))
        standing.marks = self.marks.seqs()
        while True:  # the first look at once: a pause it kept from its last start holds from the start
            try:
                self.look(owners, local)
            except Exception as exc:  # noqa: BLE001 - the broker may be restarting: the next look
                log.warning("owner rules: %s", exc)
            if self.stopping.wait(LOOK_S):
                return

    def look(self, owners: Owners, local: OwnerRules) -> None:
        node = self.worker.hostname
        took = self.marks.take(owners.read(node, trust.find_key()))
        marks = self.marks.values()
        try:
            rules = OwnerRules.from_json(marks["policy"]) if "policy" in marks else local
        except (ValueError, SpecError) as exc:
            log.warning("ignored the rules set for %s: %s", node, exc)
            rules = local
        cap = rules.data
        standing.data_used = self.budget.used(node, cap.period) if cap is not None else None
        readings = Readings(local_time=datetime.now().time(),
                            on_battery=on_battery() if rules.on_battery else None,
                            others_busy=self.cpu.look(rules.busy_percent), others_percent=self.cpu.percent,
                            gpu_others=gpu_others({p.pid for p in own_processes()}) if rules.gpu_shared else [],
                            data_used=standing.data_used)
        why = ("owner: " + marks["paused"]) if "paused" in marks else why_paused(rules, readings)
        standing.rules = rules
        meter.set_caps(rules.cap_up_bps, rules.cap_down_bps)  # this process's transfers (the probe)
        consumer = getattr(self.worker, "consumer", None)
        if consumer is not None and consumer.task_consumer is not None:
            consumer.call_soon(self.apply)  # until Celery does what is wanted (idempotent)
        if why == standing.paused and not took:
            return
        was, standing.paused, standing.marks = standing.paused, why, self.marks.seqs()
        if why is None and was is not None:
            log.warning("resuming: %s no longer holds", was)
        elif why is not None and was is None:
            log.warning("pausing: %s", why)
        beat = getattr(self.worker, "tt_heartbeat", None)
        if beat is not None:  # at once: the running task reads it, `workers` shows it
            beat()

    def apply(self) -> None:
        """On the event loop's thread: while ``standing`` wants a pause, consume no queue; once
        it no longer does, consume again the queues it was started with — only after a pause of
        its own (a quarantine cancels them too, and this leaves that alone)."""
        consumer = self.worker.consumer
        if consumer.task_consumer is None:
            return
        if standing.paused is not None:
            for name in {q.name for q in consumer.task_consumer.queues}:
                if consumer.task_consumer.consuming_from(name):
                    consumer.cancel_task_queue(name)
            self.applied = True
        elif self.applied:
            self.applied = False
            if not standing.quarantined:  # out of rotation meanwhile: it stays so until restarted
                for name in getattr(self.worker, "tt_queues", []):  # the queues it was started with
                    if not consumer.task_consumer.consuming_from(name):
                        consumer.add_task_queue(name)


class MarkMemory:
    """The owner's last word, kept by the agent: for each mark (``paused``, ``policy``: the rules) the
    newest signed one it took (:class:`tensorturn.state.owners.Mark`). A broker that loses a
    mark (an ``HDEL`` by someone with only the Redis password, a restart without its data)
    changes nothing here: only a newer signed mark does — ``unpause`` writes one saying nothing.

    A mark is taken only when its ``seq`` is above the one held, and when it is signed for this
    start of the agent or the one before, whose last word this start read back from its own
    disk (``path``; None: none kept; written once it took a mark). So the owner's pause
    outlives a restart of the agent, a mark signed as it restarted is taken when it is back,
    and a copy written back, before or after a restart, is never taken again. Without that file
    (a new machine, a cleared cache) nothing from before this start is taken."""

    def __init__(self, worker: str, incarnation: str, key: trust.PoolKey | None, path: Path | None = None):
        self.worker, self.incarnation, self.key, self.path = worker, incarnation, key, path
        self.held: dict[str, Mark] = {}
        self.earlier: str | None = None  # the start before this one, as its file says
        if self.load():
            self.save()  # this start is the one a later start reads back

    def take(self, marks: dict[str, Mark]) -> bool:
        """Hold what is newer in ``marks`` (verified, :meth:`Owners.read`); whether any was."""
        changed = False
        for name, mark in marks.items():
            held = self.held.get(name)
            if mark.incarnation in (self.incarnation, self.earlier) and (held is None or mark.seq > held.seq):
                self.held[name], changed = mark, True
        if changed:
            self.save()
        return changed

    def values(self) -> dict[str, str]:
        """What the marks held say, by field (a mark saying nothing is left out)."""
        return {name: mark.value for name, mark in self.held.items() if mark.value is not None}

    def seqs(self) -> dict[str, int]:
        """The numbers of the marks held (the heartbeat's ``owner``: which word it took)."""
        return {name: mark.seq for name, mark in sorted(self.held.items())}

    def load(self) -> bool:
        """Read back what the start before kept; whether there was a file (an agent that never
        took a mark keeps none: an embedded pool's agents leave nothing behind)."""
        if self.path is None or self.key is None:
            return False
        try:
            doc = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return False
        except (OSError, ValueError):
            return True  # unreadable: nothing from before this start is taken, and it is rewritten
        if not isinstance(doc, dict) or not isinstance(doc.get("marks"), list):
            return True
        self.earlier = doc["incarnation"] if isinstance(doc.get("incarnation"), str) else None
        for text in doc["marks"]:
            mark = Mark.from_json(text)
            if mark is not None and mark.worker == self.worker and mark.verifies(self.key):
                self.held[mark.field] = mark
        return True

    def save(self) -> None:
        if self.path is None:
            return
        doc = {"incarnation": self.incarnation, "marks": [m.to_json() for _, m in sorted(self.held.items())]}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            part = self.path.with_name(f".{self.path.name}.{os.getpid()}")
            part.write_text(json.dumps(doc), encoding="utf-8")
            os.replace(part, self.path)  # whole or not at all: a start reads one or the other
        except OSError as exc:  # held in memory still; only a restart would forget it
            log.warning("the owner's marks were not kept on disk (%s): %s", self.path, exc)


def memory_path(settings: config.Settings, worker: str, broker_url: str) -> Path:
    """Where agent ``worker`` of the pool at ``broker_url`` keeps its owner's last word: beside
    its chunk cache, named for the agent and the broker's address (two pools on one machine
    may have agents of the same name)."""
    base = Path(settings.cache_dir).parent if settings.cache_dir else platforms.cache_dir().parent
    where = urlsplit(broker_url)
    pool = hashlib.sha256(f"{where.hostname}:{where.port}{where.path}".encode()).hexdigest()[:12]
    return base / "owner" / f"{re.sub(r'[^A-Za-z0-9_.@-]', '_', worker)}-{pool}.json"
