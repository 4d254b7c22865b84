"""Outer steps beside the store: a queue that the agent on the store's machine takes them from.

An outer step reads every shard's pseudo-gradient, θ and the outer optimizer's state from the
store and writes θ, the state and the broadcast back — several whole models per round. On a
trainer at home that traffic crosses its uplink while every other machine waits for the round;
on the machine that holds the store (the coordinator) it stays on that machine. So an agent
started with ``--role outer`` (or ``both``) beside the store also consumes ``tt.outer.<queue>``
for each capacity queue it can serve, and says so with every heartbeat; a round queues its
outer step there while one does (:func:`queue_for_outer`).

Nothing may wait there for an agent that is gone: every agent's heartbeat moves the messages of
an outer queue whose agents have all missed three heartbeats (or stopped, or were quarantined:
:func:`withdraw`) back to its capacity queue (:func:`reroute`), where any trainer takes them — a
message that comes back to an outer queue later (a dead outer agent's lease restored, a retry,
an outer step queued there while its agent was alive) is moved on the same way. The times are Redis's
own (``TIME``), so the machines' clocks do not matter.

The advertisements are in Redis, so anyone with its password can write one: the mover takes an
entry only when it names ``tt.outer.<capacity queue>`` (:data:`OUTER_QUEUES`) and is not dated
ahead of Redis's time (one that was would keep a queue "served" for as long as it liked). Any
other entry — one naming a training queue would have made every heartbeat pop
that queue's tasks into a list nobody reads — is removed, and nothing is moved from or to it.
The advertisements and their scripts are :class:`tensorturn.state.adverts.Adverts`; this module
decides when to call them. The queues an agent consumes: :func:`tensorturn.pool.telemetry.agent_queues`.
"""

from __future__ import annotations

import logging
from typing import Any

from tensorturn import config
from tensorturn.layout import ADVERTISED, outer_queue
from tensorturn.pool.capacity import CAPACITY_QUEUES
from tensorturn.state.adverts import Adverts

log = logging.getLogger(__name__)

ROLES = ("train", "outer", "both")
OUTER_QUEUES = frozenset(outer_queue(q) for q in CAPACITY_QUEUES)  # every name an outer queue has

def adverts(client: Any) -> Adverts:
    """The advertisements on broker ``client``, of the outer queues :data:`OUTER_QUEUES` only."""
    return Adverts(client, OUTER_QUEUES)


def check_role(role: str) -> str:
    if role not in ROLES:
        from tensorturn.errors import SpecError

        raise SpecError(f"unknown agent role {role!r}: choose one of {', '.join(ROLES)}")
    return role


def consumed(role: str, capacity_queues: list[str]) -> list[str]:
    """The queues an agent of ``role`` that can serve ``capacity_queues`` consumes (its own queue
    aside): trainers take the capacity queues, outer agents their outer queues, ``both`` all."""
    check_role(role)
    train = capacity_queues if role in ("train", "both") else []
    outer = [outer_queue(q) for q in capacity_queues] if role in ("outer", "both") else []
    return [*train, *outer]


def gone_after_s() -> float:
    return 3 * config.current().heartbeat_s


def advertise(client: Any, agent: str, queues: list[str]) -> None:
    """Say (with Redis's time) that ``agent`` serves the outer queues among ``queues``."""
    outer = [q for q in queues if q in OUTER_QUEUES]
    if outer:
        adverts(client).advertise(agent, outer)


def withdraw(client: Any, agent: str, queues: list[str]) -> None:
    """``agent`` stops serving its outer queues (a clean stop, quarantine): its entries are
    dated as if it had missed its heartbeats, so the next heartbeat of any agent moves their
    messages — those queued already, and those that come back later (a lease restored, a
    retry) — unless another agent serves them."""
    outer = [f"{q}|{agent}" for q in queues if q in OUTER_QUEUES]
    if outer:
        adverts(client).withdraw(outer, gone_after_s() + 1)


def reroute(client: Any) -> int:
    """Move outer steps whose outer queue no live agent serves to their capacity queue; returns
    how many moved (every agent calls this with its heartbeat)."""
    moved, removed = adverts(client).reroute(gone_after_s())
    if removed:
        log.warning("removed %d entr%s of %s that named no outer queue (or a time to come): "
                    "written by hand or by someone with the Redis password; nothing was moved "
                    "for them", removed, "y" if removed == 1 else "ies", ADVERTISED)
    if moved:
        log.warning("moved %d outer step(s) to the trainers' queues: no agent beside the store "
                    "has answered for %.0f s", moved, gone_after_s())
    return moved


def queue_for_outer(client: Any, queue: str) -> str:
    """Where to queue an outer step that fits capacity queue ``queue``: its outer queue while an
    agent beside the store serves it, else ``queue`` itself."""
    if outer_queue(queue) not in OUTER_QUEUES:
        return queue
    try:
        served = adverts(client).served(outer_queue(queue), gone_after_s())
    except Exception as exc:  # noqa: BLE001 - the trainers can always take it
        log.debug("outer queue not checked: %s", exc)
        served = False
    return outer_queue(queue) if served else queue
