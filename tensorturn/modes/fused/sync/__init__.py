"""Sync policies: how a fused run's shards meet — a barrier per round (:mod:`.rounds`), rounds
with backup copies of stragglers (:mod:`.backup`), or no barrier at all (:mod:`.asynchronous`).
Each is one :class:`~.base.SyncPolicy` class in its own module, listed by name in
:data:`tensorturn.modes.fused.policies.POLICIES`.
"""
