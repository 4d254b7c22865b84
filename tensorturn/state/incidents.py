"""What went wrong or was odd in a run, for ``status``: incidents (requeued, duplicate or late
attempts, updates rejected, machines quarantined, ...; ``tt:run:<id>:incidents``) and warnings
about how it was set up (``warnings``). Both are lists, their texts masked."""

from __future__ import annotations

import json
from typing import Any

from tensorturn import layout
from tensorturn.config import mask_text
from tensorturn.state.clock import broker_now


class Incidents:
    """A run's incidents and warnings, oldest first."""

    def __init__(self, client: Any):
        self.r = client

    def add(self, run_id: str, kind: str, task: str, worker: str | None, detail: str,
            pipe: Any = None) -> None:
        (pipe or self.r).rpush(layout.run_key(run_id, "incidents"), json.dumps({
            "kind": kind, "task": task, "worker": worker, "at": broker_now(self.r),
            "detail": mask_text(detail)}))

    def all(self, run_id: str) -> list[dict[str, Any]]:
        return [json.loads(x) for x in self.r.lrange(layout.run_key(run_id, "incidents"), 0, -1)]

    def restore(self, run_id: str, entries: list[dict[str, Any]], pipe: Any) -> None:
        """Put back a manifest's incidents as they were (a resume), in ``pipe``."""
        for entry in entries:
            pipe.rpush(layout.run_key(run_id, "incidents"), json.dumps(entry))

    def warn(self, run_id: str, text: str) -> None:
        """A warning about how the run was set up (not a fault): `run` prints it at the start."""
        self.r.rpush(layout.run_key(run_id, "warnings"), mask_text(text))

    def warnings(self, run_id: str) -> list[str]:
        return list(self.r.lrange(layout.run_key(run_id, "warnings"), 0, -1))
