"""Where test and benchmark tooling plugs in: the pace of a training step, the battery sensor and
the reading of the CPU share other processes use.

Not settings: a user never sets these, and TensorTurn itself never changes them. The tooling
beside the package (``testbed/``) does, in the processes the tests and benchmarks start:
``testbed/site/sitecustomize.py``, on their ``PYTHONPATH``, installs emulations configured by
variables of the testbed's own (:mod:`testbed.emulate`) — every agent process kind sees them: one
``tensorturn agent`` starts, an embedded pool's, the agents its warm parent forks (they inherit
the parent's), and a threads pool's tasks (threads of the agent). The defaults do nothing, and
importing this module costs nothing (no torch): every Python process the tooling starts
imports it.
"""

from __future__ import annotations

from collections.abc import Callable

# after each step of a loop: that step's compute time in seconds (it may sleep, to emulate a
# slower machine)
StepPacer = Callable[[float], None]


def no_pacer() -> StepPacer | None:
    return None


# Called as each training loop starts (:func:`tensorturn.train.loop.train_steps`): what is called
# after each of its steps, or None (the default: steps take what their compute takes).
step_pacer: Callable[[], StepPacer | None] = no_pacer

# Stands in for the machine's battery sensor (:func:`tensorturn.pool.owner.on_battery`): True on
# battery, False on mains, None without a battery. None (the default): the machine's own sensor.
battery_sensor: Callable[[], bool | None] | None = None

# Stands in for the owner watch's reading of the share of the CPU other processes used
# (:meth:`tensorturn.pool.owner.CpuWatch.sample`): given the machine's reading, what the watch
# sees. None (the default): the machine's reading.
others_cpu: Callable[[float | None], float | None] | None = None
