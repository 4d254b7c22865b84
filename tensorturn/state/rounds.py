"""A fused run's rounds on the broker: each recorded round's figures (``tt:run:<id>:rounds``) and
how often each round's chord was re-queued (``chord_requeues``)."""

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

    def requeued(self, run_id: str, round_: int) -> int:
        """Count one more re-queue of round ``round_``'s chord; returns how many so far."""
        return int(self.r.hincrby(layout.run_key(run_id, "chord_requeues"), str(round_), 1))

    def reset_requeues(self, run_id: str) -> None:
        """Each round's chord gets its re-queues again (a resume)."""
        self.r.delete(layout.run_key(run_id, "chord_requeues"))
