"""A fused run's rounds on the broker: each recorded round's figures (``tt:run:<id>:rounds``)."""

from __future__ import annotations

import json
from typing import Any

from tensorturn import layout


class Rounds:
    """The rounds a run recorded, by number."""

    def __init__(self, client: Any):
        self.r = client

    def record(self, run_id: str, round_: int, info: dict[str, Any], pipe: Any = None) -> None:
        """Record round ``round_``'s figures (in ``pipe``, when given)."""
        (pipe or self.r).hset(layout.run_key(run_id, "rounds"), str(round_), json.dumps(info))

    def has(self, run_id: str, round_: int) -> bool:
        return bool(self.r.hexists(layout.run_key(run_id, "rounds"), str(round_)))

    def all(self, run_id: str) -> list[dict[str, Any]]:
        raw = self.r.hgetall(layout.run_key(run_id, "rounds"))
        return [json.loads(raw[k]) for k in sorted(raw, key=int)]
