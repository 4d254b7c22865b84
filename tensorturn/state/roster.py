"""The pool's machines as the broker knows them, from the agents' heartbeats.

No Celery and no torch here: ``tensorturn workers`` and the CLI's checks read it in a blink.

A heartbeat is in Redis, so anyone with its password could write one — claiming 4 TB of device
memory, say, to get a model past the memory check that no real machine can hold. So an agent
signs what it says with the pool key (:func:`heartbeat_doc`: its name, inventory, queues, the
time of the beat and its incarnation, a random id of this start of the agent); a machine whose
heartbeat does not verify is listed ``unverified`` and never counted as a machine that can take
work. A quarantine mark is signed for the agent's incarnation too (:func:`quarantine_doc`), so
an unsigned one — or one copied from before the agent restarted — takes nobody out of rotation.
Without the pool key (``workers`` with only a broker URL) nothing can be verified: the roster
says what the heartbeats claim, ``verified`` None.
"""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

from tensorturn import config, trust
from tensorturn.layout import WORKER_PATTERN, worker_key
from tensorturn.state.clock import broker_now

OFFLINE_AFTER = 3  # heartbeats
# what an agent says of its link to the store and the broker, and of its owner's caps (signed:
# a run's plan is made from them): see :func:`links`
LINK_FIELDS = ("link_up_bps", "link_down_bps", "link_measured_at", "broker_rtt_s", "cap_up_bps",
               "cap_down_bps", "data_cap_bytes", "data_cap_period", "data_used_bytes")
SIGNED = ("name", "inventory", "queues", "last_seen", "incarnation", "paused", "owner",
          *LINK_FIELDS)  # a heartbeat's signed fields
STALE_AFTER_S = 600.0  # a link measured longer ago than this is said to be stale
SIGNATURE = "signature"
QUARANTINE_SIGNATURE = "quarantined_sig"


class WorkerState(StrEnum):
    """A machine's state in the roster (``tensorturn workers``' ``state``)."""

    IDLE = "idle"
    BUSY = "busy"
    OFFLINE = "offline"            # stopped, or silent for three heartbeats
    QUARANTINED = "quarantined"    # taken out of rotation
    PAUSED = "paused"              # its owner needs the machine (pool.owner): it comes back by itself
    UNVERIFIED = "unverified"      # its heartbeat is not signed with the pool key


TAKES_TASKS = (WorkerState.IDLE, WorkerState.BUSY)  # verified, online, not quarantined, not paused


def heartbeat_doc(fields: dict[str, Any]) -> dict[str, Any]:
    """What a heartbeat's signature covers: its :data:`SIGNED` fields, as stored (strings)."""
    return {f: fields.get(f) for f in SIGNED}


def quarantine_doc(worker: str, reason: Any, incarnation: Any) -> dict[str, Any]:
    """What a quarantine mark's signature covers: it holds for this start of the agent only."""
    return {"worker": worker, "reason": reason, "incarnation": incarnation}


def verified(key: trust.PoolKey, redis_key: str, h: dict[str, Any]) -> bool:
    """Whether hash ``h`` (at ``redis_key``) is a heartbeat signed with ``key``, by the agent
    it names."""
    return (redis_key == worker_key(str(h.get("name"))) and all(isinstance(h.get(f), str) for f in SIGNED)
            and key.verify("inventory", heartbeat_doc(h), h.get(SIGNATURE)))


def link_figures(h: dict[str, Any], now: float) -> dict[str, Any]:
    """What heartbeat ``h`` says of the machine's links, as ``workers --json`` shows it: the
    measured rates (bytes/s; None: not measured), how old the measurement is (``link_age_s``)
    and whether it is ``stale`` (older than :data:`STALE_AFTER_S`), the broker's round trip,
    the owner's caps (bytes/s; 0: none) and data budget (``data_cap`` "200/month" or None,
    ``data_used_bytes`` in its period)."""
    at = _number(h.get("link_measured_at"))
    up, down = _number(h.get("link_up_bps")), _number(h.get("link_down_bps"))
    cap_bytes = int(_number(h.get("data_cap_bytes")))
    return {
        "link_up_bps": up or None, "link_down_bps": down or None,
        "link_age_s": round(now - at, 1) if at else None,
        "link_stale": bool(at) and now - at > STALE_AFTER_S,
        "broker_rtt_s": _number(h.get("broker_rtt_s")) or None,
        "cap_up_bps": _number(h.get("cap_up_bps")), "cap_down_bps": _number(h.get("cap_down_bps")),
        "data_cap_bytes": cap_bytes, "data_cap_period": str(h.get("data_cap_period") or "") if cap_bytes else "",
        "data_used_bytes": int(_number(h.get("data_used_bytes"))) if cap_bytes else 0,
    }


def links(client, now: float | None = None, key: trust.PoolKey | None = None) -> dict[str, dict[str, Any]]:
    """The effective links of the machines that take tasks, by name, for a run's plan: ``up_bps``
    and ``down_bps`` are min(measured, cap) where both are known, the cap alone where nothing
    was measured, None where neither is; ``stale`` where the measurement is older than
    :data:`STALE_AFTER_S` (its figure still given, said to be old); ``rtt_s`` the broker's round
    trip (None: not measured). Only verified heartbeats count (:func:`list_workers`)."""
    now = broker_now(client) if now is None else now
    out = {}
    for w in list_workers(client, now=now, key=key):
        if w["state"] not in TAKES_TASKS:
            continue
        figures = {}
        for way in ("up", "down"):
            measured, cap = w[f"link_{way}_bps"], w[f"cap_{way}_bps"]
            figures[f"{way}_bps"] = (min(measured, cap) if measured and cap else measured or cap or None)
        out[w["name"]] = {**figures, "stale": w["link_stale"], "rtt_s": w["broker_rtt_s"],
                          "measured": w["link_up_bps"] is not None or w["link_down_bps"] is not None}
    return out


def quarantine_verified(key: trust.PoolKey, h: dict[str, Any], incarnation: Any) -> bool:
    """Whether ``h``'s quarantine mark is signed with ``key`` for this start of the agent."""
    return key.verify("quarantine", quarantine_doc(str(h.get("name")), h.get("quarantined"), incarnation),
                      h.get(QUARANTINE_SIGNATURE))


def heartbeats(client) -> dict[str, dict[str, Any]]:
    """Every ``tt:worker:*`` hash, by name: a SCAN of 1,000 keys a round trip (Redis's default,
    10, took 212 round trips at 2,213 keys), then one pipeline for the hashes. Every hash is
    read, signed or not — a forged one is listed ``unverified``, never hidden. Sorted by name."""
    head = worker_key("")
    names = sorted(key[len(head):] for key in client.scan_iter(WORKER_PATTERN, count=1000))
    pipe = client.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(worker_key(name))
    return {name: h for name, h in zip(names, pipe.execute()) if h}


def list_workers(client, now: float | None = None, heartbeat_s: float | None = None,
                 key: trust.PoolKey | None = None) -> list[dict[str, Any]]:
    """Every agent that ever sent a heartbeat to this broker, with its state: ``idle``, ``busy``,
    ``offline`` (stopped, or silent for three heartbeats), ``quarantined`` (taken out of
    rotation), ``paused`` (its owner needs it: ``paused`` says why) or ``unverified`` (its
    heartbeat is not signed with the pool key ``key``, by default this machine's: it takes no
    part in any decision). ``stopped_s`` is the time since
    a clean stop, None for a machine that did not stop cleanly (its ``last_seen_s`` says when
    it was last heard of)."""
    now = broker_now(client) if now is None else now  # the heartbeats' clock
    heartbeat_s = config.current().heartbeat_s if heartbeat_s is None else heartbeat_s
    key = key or trust.find_key()
    out = []
    for name, h in heartbeats(client).items():  # by name
        redis_key = worker_key(name)
        if "inventory" not in h:
            continue
        signed = None if key is None else verified(key, redis_key, h)
        quarantined = h.get("quarantined") if key is None or (
            signed and quarantine_verified(key, h, h["incarnation"])) else None
        last_seen = now - _number(h.get("last_seen"))
        # the first heartbeat of a restarted agent clears its stop; an agent from before
        # `stopped_at` marked a clean stop with last_seen 0 (its stop time is unknown)
        stopped = "stopped_at" in h or _number(h.get("last_seen")) == 0
        stopped_s = now - _number(h["stopped_at"]) if "stopped_at" in h else None
        if stopped or last_seen > OFFLINE_AFTER * heartbeat_s:
            state = WorkerState.OFFLINE
        elif signed is False:
            state = WorkerState.UNVERIFIED
        elif quarantined:
            state = WorkerState.QUARANTINED
        elif h.get("paused"):
            state = WorkerState.PAUSED
        else:
            state = WorkerState.BUSY if h.get("task") else WorkerState.IDLE
        progress = _object(h.get("progress"))
        out.append({
            **_inventory(h.get("inventory")), **_object(h.get("live")),
            "name": str(h.get("name") or redis_key), "state": state, "verified": signed,
            "last_seen_s": round(last_seen, 1),
            "stopped": stopped, "stopped_s": None if stopped_s is None else round(stopped_s, 1),
            "task": h.get("task") if state == WorkerState.BUSY else None,
            "samples_per_s": progress.get("samples_per_s") if state == WorkerState.BUSY else None,
            "tasks_done": int(_number(h.get("tasks_done"))),
            "quarantined": quarantined, "paused": h.get("paused") if state == WorkerState.PAUSED else None,
            "incarnation": h.get("incarnation"),
            "owner": {k: v for k, v in _object(h.get("owner")).items() if isinstance(v, int)},
            "queues": [q for q in _list(h.get("queues")) if isinstance(q, str)],
            **link_figures(h, now),
        })
    return out


# What an unverified heartbeat says is read as claims: anything that is not what an agent
# writes is replaced, so that a forged hash cannot break `workers`, `status` or a submit.

def _object(text: Any) -> dict[str, Any]:
    value = _json(text)
    return value if isinstance(value, dict) else {}


def _list(text: Any) -> list[Any]:
    value = _json(text)
    return value if isinstance(value, list) else []


def _json(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None


def json_value(text: Any) -> Any:
    """``text`` read as JSON; None where it is not."""
    return _json(text)


def number(value: Any) -> float:
    """``value`` as a finite number; 0 where it is not one."""
    return _number(value)


def _number(value: Any) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0
    return number if number == number and abs(number) != float("inf") else 0.0


def _inventory(text: Any) -> dict[str, Any]:
    inv = _object(text)
    return {**inv, "device": str(inv.get("device", "?")), "device_name": str(inv.get("device_name", "?")),
            "cpu_count": inv.get("cpu_count"), "device_memory_gb": _number(inv.get("device_memory_gb")),
            "role": str(inv.get("role", "train"))}
