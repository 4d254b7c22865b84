"""The sync policy registry: the ``--sync`` value → its :class:`~.sync.base.SyncPolicy` (:mod:`.sync`:
a barrier per round, rounds with backup copies of stragglers, no barrier, or rounds one step
apart).

A new policy is its own module in :mod:`.sync` plus one line in :data:`POLICIES` — and its name
in :data:`~.options.SYNCS`, which the options (read without torch, by the command line) offer
as choices; a test checks the two agree. Only the driver (:mod:`.driver`) asks for a policy.
"""

from __future__ import annotations

from tensorturn.modes.fused.sync.asynchronous import Async
from tensorturn.modes.fused.sync.backup import Backup
from tensorturn.modes.fused.sync.base import SyncPolicy
from tensorturn.modes.fused.sync.overlapped import Overlap
from tensorturn.modes.fused.sync.rounds import Rounds

POLICIES: dict[str, type[SyncPolicy]] = {p.name: p for p in (Rounds, Backup, Async, Overlap)}


def policy(name: str) -> SyncPolicy:
    """The policy of ``--sync name`` (a KeyError for a name the options would have refused)."""
    return POLICIES[name]()
