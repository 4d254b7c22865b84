"""Emulated machines, for tests and benchmarks: a training step's time, a slower machine, a
battery sensor, a busy owner — installed into TensorTurn's hooks (:mod:`tensorturn.testbed_hooks`), never
TensorTurn settings.

Each is a variable in the environment of the agents a test or benchmark starts:

* ``TESTBED_SIM_STEP_S`` — each training step lasts this many seconds (sleeping out what its
  compute did not use): many agents of different speeds share two cores without competing.
* ``TESTBED_SLOWDOWN`` — training takes this many times its compute time (> 1; sleeping).
* ``TESTBED_BATTERY_FILE`` — a file saying ``battery`` or ``ac`` is the battery sensor.
* ``TESTBED_OTHERS_CPU_FILE`` — a file holding the percentage of the CPU the owner watch sees
  other processes use (empty: the machine's reading).

They reach every agent through ``sitecustomize`` (``testbed/site/``, which Python imports as it
starts): :func:`reach_children` puts that folder on the ``PYTHONPATH`` every process started
from here inherits — ``tensorturn agent`` processes, an embedded pool's, and the agents its warm
parent forks (which inherit the parent's hooks). The hooks read the variables when a loop starts
or the sensor is read, not when the process starts: a forked agent's environment is its own.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from tensorturn import testbed_hooks
from tensorturn.testbed_hooks import StepPacer

SITE = Path(__file__).resolve().parent / "site"  # sitecustomize.py: install() in each process

SIM_STEP_S = "TESTBED_SIM_STEP_S"
SLOWDOWN = "TESTBED_SLOWDOWN"
BATTERY_FILE = "TESTBED_BATTERY_FILE"
OTHERS_CPU_FILE = "TESTBED_OTHERS_CPU_FILE"


class Throttle:
    """Stretch a loop to ``factor`` × its compute time by sleeping, without burning CPU.

    Sleeps are paced against a deadline — after each step, sleep until ``factor × (compute time
    so far)`` has passed since the loop began — rather than ``(factor − 1) × step`` after every
    step: short steps would otherwise pay the sleep's own overshoot each time (a 1 ms step with a
    2 ms sleep ran ~5.7× slower instead of 3×). Sleeps shorter than ``min_sleep`` are deferred.
    """

    def __init__(self, factor: float, min_sleep: float = 0.02, clock=time.perf_counter, sleep=time.sleep):
        self.factor, self.min_sleep, self.clock, self.sleep = factor, min_sleep, clock, sleep
        self.start = clock()
        self.compute = 0.0

    def step(self, seconds: float) -> None:
        """Account one step of ``seconds`` of work; sleep if the loop is ahead of its pace."""
        self.compute += seconds
        ahead = self.start + self.factor * self.compute - self.clock()
        if ahead >= self.min_sleep:
            self.sleep(ahead)


class SimulatedStep:
    """Make every step of a loop take ``seconds`` of wall time, sleeping out what its compute
    did not use.

    Paced against a deadline from the loop's start — step i ends at start + i × seconds — so a
    sleep's overshoot is paid back by the next one; a step whose compute takes longer than
    ``seconds`` simply runs late (the figure is then the compute's, not the emulated one).
    """

    def __init__(self, seconds: float, clock=time.perf_counter, sleep=time.sleep):
        self.seconds, self.clock, self.sleep = seconds, clock, sleep
        self.start = clock()
        self.steps = 0

    def step(self, compute_s: float = 0.0) -> None:
        """One step ended (its compute time, ``compute_s``, plays no part)."""
        self.steps += 1
        ahead = self.start + self.steps * self.seconds - self.clock()
        if ahead > 0:
            self.sleep(ahead)


def _number(name: str) -> float:
    raw = os.environ.get(name, "")
    return float(raw) if raw else 0.0


def step_pacer() -> StepPacer | None:
    """A training loop's pace from ``TESTBED_SLOWDOWN`` and ``TESTBED_SIM_STEP_S`` (both: the
    slowdown first, then the emulated step); None when neither is set."""
    paces = []
    if (factor := _number(SLOWDOWN)) > 1:
        paces.append(Throttle(factor).step)
    if (seconds := _number(SIM_STEP_S)) > 0:
        paces.append(SimulatedStep(seconds).step)
    if len(paces) < 2:
        return paces[0] if paces else None

    def both(compute_s: float) -> None:
        for pace in paces:
            pace(compute_s)

    return both


def battery_sensor() -> bool | None:
    """The battery file's word (``battery``: True; anything else: False; no file: None) where
    ``TESTBED_BATTERY_FILE`` is set; the machine's own sensor where it is not."""
    path = os.environ.get(BATTERY_FILE)
    if not path:
        from tensorturn.pool.owner import battery_sensor as machines

        return machines()
    try:
        return Path(path).read_text().strip() == "battery"
    except OSError:
        return None


def others_cpu(reading: float | None) -> float | None:
    """The percentage in the file ``TESTBED_OTHERS_CPU_FILE`` names as the share of the CPU other
    processes used (a test says when the owner "plays" and when they leave, whatever else the
    machine runs); the machine's ``reading`` where it is unset, empty or missing, and before the
    watch has a first reading."""
    path = os.environ.get(OTHERS_CPU_FILE)
    try:
        said = Path(path).read_text().strip() if path else ""
    except OSError:
        said = ""
    return reading if not said or reading is None else float(said)


def install() -> None:
    """Put the emulations into this process's hooks (``sitecustomize`` does, as Python starts)."""
    testbed_hooks.step_pacer = step_pacer
    testbed_hooks.battery_sensor = battery_sensor
    testbed_hooks.others_cpu = others_cpu


def reach_children(environ: dict[str, str] | os._Environ = os.environ) -> None:
    """Put ``sitecustomize`` on ``environ``'s ``PYTHONPATH``: every Python process started with
    it installs the emulations (:func:`install`)."""
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(SITE) not in paths:
        environ["PYTHONPATH"] = os.pathsep.join([str(SITE), *paths])
