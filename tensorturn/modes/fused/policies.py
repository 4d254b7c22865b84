"""The sync policy registry: the ``--sync`` value → its :class:`~.sync.base.SyncPolicy` class
(:mod:`.sync`: a barrier per round, rounds with backup copies of stragglers, no barrier, or
rounds one step apart).

:data:`POLICIES` maps the ``--sync`` value to its class, by name, as the mode registry does
(:mod:`tensorturn.registry`): the options (no torch) read the choices from it, and a policy —
whose module imports torch — is imported only when asked for, by the driver (:mod:`.driver`).
A new policy is its own module in :mod:`.sync` plus one line here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorturn.modes.fused.sync.base import SyncPolicy

POLICIES: dict[str, str] = {
    "rounds": "tensorturn.modes.fused.sync.rounds:Rounds",
    "backup": "tensorturn.modes.fused.sync.backup:Backup",
    "async": "tensorturn.modes.fused.sync.asynchronous:Async",
    "overlap": "tensorturn.modes.fused.sync.overlapped:Overlap",
}
SYNCS = tuple(POLICIES)


def policy(name: str) -> SyncPolicy:
    """The policy of ``--sync name`` (a KeyError for a name the options would have refused)."""
    module, _, cls = POLICIES[name].partition(":")
    return getattr(importlib.import_module(module), cls)()
