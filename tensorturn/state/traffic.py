"""The bytes a run moved, on the broker: through the links per task (``tt:run:<id>:bytes``,
counted once per task), through the store per machine (``store_bytes``), and dataset bytes per
machine (``data_bytes`` downloaded, ``data_read`` read by its tasks). A machine's store bytes
count against its data budget in the same round trip (:mod:`tensorturn.state.budget`)."""

from __future__ import annotations

from typing import Any

from tensorturn import layout
from tensorturn.state.budget import Budget


class Traffic:
    """A run's byte counters."""

    def __init__(self, client: Any):
        self.r = client

    def add_bytes(self, run_id: str, task: str, up: int, down: int, pipe: Any = None) -> None:
        (pipe or self.r).hsetnx(layout.run_key(run_id, "bytes"), task, f"{up},{down}")

    def bytes_moved(self, run_id: str) -> tuple[int, int]:
        up = down = 0
        for v in self.r.hvals(layout.run_key(run_id, "bytes")):
            u, d = v.split(",")
            up, down = up + int(u), down + int(d)
        return up, down

    def add_store_bytes(self, run_id: str, up: int, down: int, worker: str, pipe: Any = None) -> None:
        """Add what one attempt (or a run's start) on ``worker`` stored and fetched, every object
        included (in ``pipe``, when given): for the run, and for that machine — and its data budget."""
        if up or down:
            own = pipe is None
            pipe = self.r.pipeline(transaction=False) if own else pipe
            key = layout.run_key(run_id, "store_bytes")
            for field, value in (("up", up), ("down", down), (f"up@{worker}", up), (f"down@{worker}", down)):
                pipe.hincrby(key, field, value)
            Budget(self.r).add(worker, up + down, pipe)
            if own:
                pipe.execute()

    def store_bytes(self, run_id: str) -> tuple[int, int]:
        h = self.r.hgetall(layout.run_key(run_id, "store_bytes"))
        return int(h.get("up", 0)), int(h.get("down", 0))

    def store_bytes_by_worker(self, run_id: str) -> dict[str, dict[str, int]]:
        """What each machine's tasks moved through the store for the run: {worker: {up, down}}."""
        out: dict[str, dict[str, int]] = {}
        for field, value in self.r.hgetall(layout.run_key(run_id, "store_bytes")).items():
            way, at, worker = field.partition("@")
            if at:
                out.setdefault(worker, {"up": 0, "down": 0})[way] = int(value)
        return out

    def add_data_bytes(self, run_id: str, worker: str, downloaded: int, read: int = 0) -> None:
        """Dataset bytes ``worker`` downloaded for the run (chunks not already in its cache), and
        the bytes of the chunks its tasks read (from its cache or not)."""
        if downloaded:
            self.r.hincrby(layout.run_key(run_id, "data_bytes"), worker, downloaded)
        if read:
            self.r.hincrby(layout.run_key(run_id, "data_read"), worker, read)

    def data_bytes(self, run_id: str, part: str = "data_bytes") -> dict[str, int]:
        """Per worker: bytes downloaded (``data_bytes``) or read by its tasks (``data_read``)."""
        return {w: int(n) for w, n in self.r.hgetall(layout.run_key(run_id, part)).items()}
