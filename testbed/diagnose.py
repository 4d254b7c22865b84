"""What a local pool was doing, as text for a failed test's report: its broker's queues and
unacknowledged messages, the state of its latest runs (claims, attempts not succeeded, incidents),
the agents' current tasks, and the end of each agent's log.

CI keeps neither a pool's folder nor its Redis, so a test that fails there because a run stopped
moving leaves only what this prints.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

LOG_LINES = 40  # per agent log
RUNS = 2  # the latest runs shown


def describe_pool(pool: Any) -> str:
    """``pool`` (a :class:`tensorturn.pool.embedded.LocalPool`) as text; what cannot be read
    (Redis gone, a log missing) is said as such."""
    parts = [_broker(pool.broker_url)]
    for i, (proc, log) in enumerate(zip(pool.agents, pool.logs)):
        state = "running" if proc.poll() is None else f"exited {proc.poll()}"
        parts.append(f"--- agent {i + 1} ({state}), the end of {log.name}:\n" + _tail(log, LOG_LINES))
    return "\n".join(parts)


def _broker(url: str) -> str:
    import redis

    try:
        r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=5)
        lines = ["--- broker"]
        for key in sorted(r.scan_iter(count=1000)):
            kind = r.type(key)
            if kind == "list" and not key.startswith("tt:"):
                lines.append(f"queue {key}: {r.llen(key)} messages")
        lines.append(f"unacked: {r.hlen('unacked')}, in order {r.zcard('unacked_index')}")
        for tag, message in list(r.hgetall("unacked").items())[:10]:
            lines.append(f"  {tag}: {_headline(message)}")
        for run_id in r.zrevrange("tt:runs", 0, RUNS - 1):
            lines += _run(r, run_id)
        from tensorturn.state.roster import list_workers

        for w in list_workers(r):
            lines.append(f"agent {w['name']}: {w['state']}, task {w['task']}, last seen "
                         f"{w['last_seen_s']} s ago, paused {w['paused']}")
        return "\n".join(lines)
    except Exception as exc:  # noqa: BLE001 - a report of what could be read
        return f"--- broker: not readable ({type(exc).__name__}: {exc})"


def _run(r: Any, run_id: str) -> list[str]:
    key = f"tt:run:{run_id}"
    lines = [f"--- run {run_id}: {r.hget(key, 'state')} {r.hget(key, 'error') or ''}".rstrip()]
    lines.append(f"claims: {json.dumps(r.hgetall(key + ':claims'), sort_keys=True)}")
    attempts = sorted(_entries(r.hgetall(key + ":attempts").values()), key=lambda a: a.get("started_at", 0))
    lines.append(f"attempts: {len(attempts)}, of which succeeded "
                 f"{sum(a.get('outcome') == 'succeeded' for a in attempts)}")
    lines += [f"attempt: {json.dumps(a, sort_keys=True)[:300]}" for a in attempts if a.get("outcome") != "succeeded"]
    for part in ("incidents", "warnings"):
        lines += [f"{part[:-1]}: {json.dumps(e, sort_keys=True)[:300]}"
                  for e in _entries(r.lrange(f"{key}:{part}", 0, -1))]
    return lines


def _entries(raw: Iterable[str]) -> Iterable[dict[str, Any]]:
    for text in raw:
        try:
            yield json.loads(text)
        except ValueError:
            yield {"raw": text[:200]}


def _headline(message: str) -> str:
    """A kombu message's task name and label, not its body."""
    try:
        doc = json.loads(message)
        headers = doc[0].get("headers", {}) if isinstance(doc, list) else doc.get("headers", {})
        return f"{headers.get('task')} {headers.get('argsrepr', '')[:120]}"
    except (ValueError, AttributeError, IndexError, KeyError):
        return message[:120]


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as exc:
        return f"(not readable: {exc})"
