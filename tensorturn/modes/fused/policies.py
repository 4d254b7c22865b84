"""The sync policy registry: the ``--sync`` value → where its :class:`~.sync.base.SyncPolicy`
lives (:mod:`.sync`: a barrier per round, rounds with backup copies of stragglers, no barrier,
or rounds one step apart).

A new policy is its own module in :mod:`.sync` plus one line in :data:`POLICIES`. The entries
are ``"module:Class"`` names, imported when a run asks for the policy (Celery names its pools
and result backends the same way): so the registry imports nothing, and the options — read by
the command line without torch — offer its keys as the ``--sync`` choices. Only the driver
(:mod:`.driver`) asks for a policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tensorturn.modes.fused.sync.base import SyncPolicy

POLICIES: dict[str, str] = {
    "rounds": "tensorturn.modes.fused.sync.rounds:Rounds",
    "backup": "tensorturn.modes.fused.sync.backup:Backup",
    "async": "tensorturn.modes.fused.sync.asynchronous:Async",
    "overlap": "tensorturn.modes.fused.sync.overlapped:Overlap",
}


def policy_class(name: str) -> type[SyncPolicy]:
    """The class registered for ``--sync name`` (a KeyError for a name the options would have
    refused)."""
    from kombu.utils.imports import symbol_by_name

    return symbol_by_name(POLICIES[name])


def policy(name: str) -> SyncPolicy:
    """The policy of ``--sync name``."""
    return policy_class(name)()
