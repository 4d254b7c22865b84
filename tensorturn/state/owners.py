"""What a machine's owner asked of its agent from any machine holding the join file: one hash
per agent (``tt:owner:<name>``), the one owner of every write to it.

Two marks, each signed with the pool key (:func:`mark_doc`): ``paused`` (why: ``tensorturn
pause``) and ``policy`` (the owner's rules, JSON: ``tensorturn rules``, which replaces the rules
the agent was started with; the field keeps the name it had before they were called rules).
``unpause`` and ``rules --clear`` write a mark too, saying nothing (``value``
None): an owner's word is never a deletion, so a broker that loses a mark changes nothing
(:class:`tensorturn.pool.owner.MarkMemory` keeps the last word the agent took).

A mark is signed for one agent, one start of it (its heartbeat's ``incarnation``) and a
sequence number (the broker's clock in microseconds, above the last mark's): anyone with only
the Redis password can write a signed mark back that they copied before, and the agent takes
none that is not newer than the one it holds, nor one for another start of it than this one
and the one before (whose last word it kept on its own disk).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tensorturn import layout, trust
from tensorturn.state.clock import broker_now

PURPOSE = "owner"
FIELDS = ("paused", "policy")


@dataclass(frozen=True)
class Mark:
    """One owner's word for one agent: ``field`` says ``value`` (None: nothing — resumed, or
    back to the rules the agent was started with), for start ``incarnation`` of the agent,
    numbered ``seq``."""

    worker: str
    field: str
    value: str | None
    incarnation: str
    seq: int
    sig: str = ""

    def doc(self) -> dict[str, Any]:
        """What its signature covers: everything but the signature."""
        return mark_doc(self.worker, self.field, self.value, self.incarnation, self.seq)

    def signed(self, key: trust.PoolKey) -> Mark:
        return Mark(**{**self.doc(), "sig": key.sign(PURPOSE, self.doc())})

    def verifies(self, key: trust.PoolKey) -> bool:
        return key.verify(PURPOSE, self.doc(), self.sig)

    def to_json(self) -> str:
        return json.dumps({**self.doc(), "sig": self.sig}, sort_keys=True)

    @classmethod
    def from_json(cls, text: Any) -> Mark | None:
        """The mark ``text`` holds; None for anything that is not one (a forged field is just
        not a mark)."""
        try:
            doc = json.loads(text)
            mark = cls(worker=doc["worker"], field=doc["field"], value=doc["value"],
                       incarnation=doc["incarnation"], seq=doc["seq"], sig=doc["sig"])
        except (TypeError, ValueError, KeyError):
            return None
        typed = (isinstance(mark.worker, str) and mark.field in FIELDS and isinstance(mark.incarnation, str)
                 and isinstance(mark.seq, int) and isinstance(mark.sig, str)
                 and (mark.value is None or isinstance(mark.value, str)))
        return mark if typed else None


def mark_doc(worker: str, field: str, value: str | None, incarnation: str, seq: int) -> dict[str, Any]:
    """What a mark's signature covers: the agent, the start of it, which mark, what it says,
    and its number."""
    return {"worker": worker, "field": field, "value": value, "incarnation": incarnation, "seq": seq}


class Owners:
    """Every agent's owner marks."""

    def __init__(self, client: Any):
        self.r = client

    def set(self, worker: str, incarnation: str, field: str, value: str | None, key: trust.PoolKey,
            held: int = 0) -> Mark:
        """Write ``worker``'s mark ``field`` (``paused`` or ``policy``; ``value`` None: nothing),
        for its start ``incarnation``, signed with ``key``, numbered above ``held`` (the number
        the agent's signed heartbeat says it holds) and the last mark that verifies; the mark."""
        last = self.read(worker, key).get(field)
        # the broker's clock numbers the marks; one that stepped back (or a mark deleted) still
        # numbers them upwards of what the agent holds, never of what an unsigned mark claims
        seq = max(int(broker_now(self.r) * 1e6), (last.seq + 1) if last else 0, held + 1)
        mark = Mark(worker, field, value, incarnation, seq).signed(key)
        self.r.hset(layout.owner_key(worker), field, mark.to_json())
        return mark

    def read(self, worker: str, key: trust.PoolKey | None) -> dict[str, Mark]:
        """``worker``'s marks that verify with ``key`` (none without a key), by field."""
        if key is None:
            return {}
        h = self.r.hgetall(layout.owner_key(worker))
        out = {}
        for field in FIELDS:
            mark = Mark.from_json(h.get(field))
            if mark is not None and mark.worker == worker and mark.field == field and mark.verifies(key):
                out[field] = mark
        return out
