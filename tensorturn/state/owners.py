"""What a machine's owner asked of its agent from any machine holding the join file: one hash
per agent (``tt:owner:<name>``), the one owner of every write to it.

Two marks, each signed with the pool key for that agent (:func:`mark_doc`): ``paused`` (why:
``tensorturn pause``) and ``policy`` (JSON: ``tensorturn policy``, which replaces the policy the
agent was started with). The agent reads both every second (:mod:`tensorturn.pool.owner`) and
ignores a mark whose signature does not verify — anyone with only the Redis password could
write one. Unlike a quarantine, the marks outlive a restart of the agent: an owner who paused
the gaming PC does not want it back at work because its agent restarted.
"""

from __future__ import annotations

from typing import Any

from tensorturn import layout, trust

PURPOSE = "owner"


def mark_doc(worker: str, field: str, value: str) -> dict[str, str]:
    """What a mark's signature covers: the agent, which mark, and what it says."""
    return {"worker": worker, "field": field, "value": value}


class Owners:
    """Every agent's owner marks."""

    def __init__(self, client: Any):
        self.r = client

    def set(self, worker: str, field: str, value: str, key: trust.PoolKey) -> None:
        """Write ``worker``'s mark ``field`` (``paused`` or ``policy``), signed with ``key``."""
        self.r.hset(layout.owner_key(worker), mapping={
            field: value, f"{field}_sig": key.sign(PURPOSE, mark_doc(worker, field, value))})

    def clear(self, worker: str, field: str) -> bool:
        """Remove ``worker``'s mark ``field``; whether there was one."""
        return bool(self.r.hdel(layout.owner_key(worker), field, f"{field}_sig"))

    def read(self, worker: str, key: trust.PoolKey | None) -> dict[str, str]:
        """``worker``'s marks that verify with ``key`` (none without a key), by field."""
        h = self.r.hgetall(layout.owner_key(worker))
        if key is None:
            return {}
        return {field: h[field] for field in ("paused", "policy")
                if field in h and key.verify(PURPOSE, mark_doc(worker, field, h[field]), h.get(f"{field}_sig"))}
