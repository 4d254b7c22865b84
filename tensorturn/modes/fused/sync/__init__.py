"""Sync policies: how a fused run's shards meet — a barrier per round (:mod:`.rounds`), rounds
with backup copies of stragglers (:mod:`.backup`), no barrier at all (:mod:`.asynchronous`), or
rounds one step apart (:mod:`.overlapped`). Each is one :class:`~.base.SyncPolicy` class in its
own module, named by one line of :data:`tensorturn.modes.fused.policies.POLICIES`; they decide, and the
driver (:mod:`tensorturn.modes.fused.driver`) queues what they decide.
"""
