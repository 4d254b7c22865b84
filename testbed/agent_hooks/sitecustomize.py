"""Testbed stand-ins for an agent's readings of its machine, loaded by every Python process that
has this folder on its ``PYTHONPATH`` (Python imports ``sitecustomize`` at start); a test puts it
there for the agents it starts and no other process.

``TT_TESTBED_OTHERS_CPU_FILE``: a file holding a percentage. The owner watch's CPU reading
(:meth:`tensorturn.pool.owner.CpuWatch.sample`) still reads the machine, then answers that
percentage as the share other processes used: a test says when the owner "plays" and when they
leave, whatever else the machine runs (other test modules, other sessions). An empty or missing
file: the real reading. The arithmetic of the real reading is checked on its own
(tests/integration/test_owner_policy.py)."""

from __future__ import annotations

import os

_FILE = os.environ.get("TT_TESTBED_OTHERS_CPU_FILE")

if _FILE:
    from tensorturn.pool import owner as _owner

    _real_sample = _owner.CpuWatch.sample

    def _sample(self):
        real = _real_sample(self)
        try:
            said = open(_FILE).read().strip()
        except OSError:
            return real
        return real if not said or real is None else float(said)

    _owner.CpuWatch.sample = _sample
