"""The pool's machines as the broker knows them, from the agents' heartbeats.

No Celery and no torch here: ``tensorturn workers`` and the CLI's checks read it in a blink.
"""

from __future__ import annotations

import json
import time
from typing import Any

from . import config
from .layout import WORKER_PATTERN

OFFLINE_AFTER = 3  # heartbeats


def list_workers(client, now: float | None = None,
                 heartbeat_s: float | None = None) -> list[dict[str, Any]]:
    """Every agent that ever sent a heartbeat to this broker, with its state: ``idle``, ``busy``,
    ``offline`` (stopped, or silent for three heartbeats) or ``quarantined`` (taken out of
    rotation). ``stopped_s`` is the time since a clean stop, None for a machine that did not
    stop cleanly (its ``last_seen_s`` says when it was last heard of)."""
    now = time.time() if now is None else now
    heartbeat_s = config.current().heartbeat_s if heartbeat_s is None else heartbeat_s
    out = []
    for key in sorted(client.scan_iter(WORKER_PATTERN)):
        h = client.hgetall(key)
        if "inventory" not in h:
            continue
        inv, live = json.loads(h["inventory"]), json.loads(h.get("live", "{}"))
        progress = json.loads(h["progress"]) if h.get("progress") else {}
        last_seen = now - float(h.get("last_seen", 0))
        # the first heartbeat of a restarted agent clears its stop; an agent from before
        # `stopped_at` marked a clean stop with last_seen 0 (its stop time is unknown)
        stopped = "stopped_at" in h or float(h.get("last_seen", 0)) == 0
        stopped_s = now - float(h["stopped_at"]) if "stopped_at" in h else None
        if stopped or last_seen > OFFLINE_AFTER * heartbeat_s:
            state = "offline"
        elif h.get("quarantined"):
            state = "quarantined"
        else:
            state = "busy" if h.get("task") else "idle"
        out.append({
            "name": h["name"], "state": state, "last_seen_s": round(last_seen, 1),
            "stopped": stopped, "stopped_s": None if stopped_s is None else round(stopped_s, 1),
            "task": h.get("task") if state == "busy" else None,
            "samples_per_s": progress.get("samples_per_s") if state == "busy" else None,
            "tasks_done": int(h.get("tasks_done", 0)),
            "quarantined": h.get("quarantined"),
            **inv, **live,
        })
    return out
