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
from tensorturn.state.clock import broker_now

PURPOSE = "owner"


def mark_doc(worker: str, field: str, value: str, at: str) -> dict[str, str]:
    """What a mark's signature covers: the agent, which mark, what it says, and when it was set
    (on the broker's clock: an agent does not take again a mark no newer than one it saw
    removed — :class:`tensorturn.pool.owner.MarkMemory`)."""
    return {"worker": worker, "field": field, "value": value, "at": at}


class Owners:
    """Every agent's owner marks."""

    def __init__(self, client: Any):
        self.r = client

    def set(self, worker: str, field: str, value: str, key: trust.PoolKey) -> None:
        """Write ``worker``'s mark ``field`` (``paused`` or ``policy``), signed with ``key``."""
        at = repr(broker_now(self.r))
        self.r.hset(layout.owner_key(worker), mapping={
            field: value, f"{field}_at": at, f"{field}_sig": key.sign(PURPOSE, mark_doc(worker, field, value, at))})

    def clear(self, worker: str, field: str) -> bool:
        """Remove ``worker``'s mark ``field``; whether there was one."""
        return bool(self.r.hdel(layout.owner_key(worker), field, f"{field}_at", f"{field}_sig"))

    def read(self, worker: str, key: trust.PoolKey | None) -> dict[str, tuple[float, str]]:
        """``worker``'s marks that verify with ``key`` (none without a key), by field: (when it
        was set, what it says)."""
        h = self.r.hgetall(layout.owner_key(worker))
        if key is None:
            return {}
        out = {}
        for field in ("paused", "policy"):
            value, at = h.get(field), h.get(f"{field}_at")
            if value is None or at is None:
                continue
            if key.verify(PURPOSE, mark_doc(worker, field, value, at), h.get(f"{field}_sig")):
                try:
                    out[field] = (float(at), value)
                except ValueError:
                    continue
        return out
