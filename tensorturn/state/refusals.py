"""The record of what agents refused (``tt:refused``): task messages and remote-control commands
without a valid pool-key signature, replayed start requests — kept on the broker, where
``tensorturn workers`` and an operator watching for an attack read them.

It sits below both the attempt protocol and the agent's remote-control guard, which record
refusals the same way.
"""

from __future__ import annotations

import json
from typing import Any

from tensorturn import layout
from tensorturn.state.clock import broker_now

KEPT = 100  # the last hundred are enough to see an attack


def refuse(r: Any, worker: str, task_name: str | None, run_id: Any, reason: str) -> None:
    """Keep one refusal on the broker ``r``: the last :data:`KEPT` in a list, and a count of
    them all that a flood of refusals cannot hide."""
    entry = {"at": broker_now(r), "worker": worker, "task": task_name, "run_id": str(run_id)[:80],
             "reason": reason}
    pipe = r.pipeline()
    pipe.lpush(layout.REFUSED, json.dumps(entry))
    pipe.ltrim(layout.REFUSED, 0, KEPT - 1)
    pipe.incr(layout.REFUSED_TOTAL)
    pipe.execute()


def refusals(r: Any) -> tuple[int, list[dict[str, Any]]]:
    """How many messages agents refused since the broker started, and the last :data:`KEPT` of
    them, newest first. An entry that is not an agent's (anyone with the password can write
    there) is skipped; the count is never below the entries listed."""
    pipe = r.pipeline(transaction=False)
    pipe.get(layout.REFUSED_TOTAL)
    pipe.lrange(layout.REFUSED, 0, -1)
    total, raw = pipe.execute()
    last = []
    for text in raw:
        try:
            entry = json.loads(text)
        except ValueError:
            continue
        if isinstance(entry, dict):
            last.append(entry)
    return max(int(total) if str(total or "").isdigit() else 0, len(last)), last
