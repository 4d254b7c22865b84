"""An ensemble's members on the broker: each member's record (``tt:run:<id>:members``: state,
config, metrics) and which have finished (``members_done``)."""

from __future__ import annotations

import json
from typing import Any

from tensorturn import layout
from tensorturn.state.clock import broker_now


class Members:
    """The members of an ensemble run, by number."""

    def __init__(self, client: Any):
        self.r = client

    def record(self, run_id: str, member: int, info: dict[str, Any], pipe: Any = None) -> None:
        (pipe or self.r).hset(layout.run_key(run_id, "members"), str(member), json.dumps(info))

    def update(self, run_id: str, member: int, **fields: Any) -> dict[str, Any]:
        info = self.get(run_id, member)
        info.update(fields)
        self.record(run_id, member, info)
        return info

    def get(self, run_id: str, member: int) -> dict[str, Any]:
        raw = self.r.hget(layout.run_key(run_id, "members"), str(member))
        return json.loads(raw) if raw else {}

    def all(self, run_id: str) -> list[dict[str, Any]]:
        raw = self.r.hgetall(layout.run_key(run_id, "members"))
        return [json.loads(raw[k]) for k in sorted(raw, key=int)]

    def done(self, run_id: str, member: int) -> int:
        """Mark a member finished (succeeded or dropped) once; returns how many are finished."""
        self.r.hsetnx(layout.run_key(run_id, "members_done"), str(member), broker_now(self.r))
        return self.done_count(run_id)

    def done_count(self, run_id: str) -> int:
        return int(self.r.hlen(layout.run_key(run_id, "members_done")))

    def undone(self, run_id: str, member: int) -> None:
        """The member trains again (a resume): no longer counted finished."""
        self.r.hdel(layout.run_key(run_id, "members_done"), str(member))
