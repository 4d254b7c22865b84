"""Celery's remote control, cut down to what monitoring needs and what the pool key signs.

Remote-control commands reach every agent through the broker (a Redis fanout), so anyone with
the Redis password can send them, and Celery's own set does far more than report:
``shutdown`` and ``pool_restart`` stop an agent, ``cancel_consumer``, ``rate_limit`` and
``pool_shrink``/``autoscale`` stop it from working, ``add_consumer`` makes it take tasks its
memory cannot hold, ``time_limit`` kills every task it runs, and ``revoke`` (or ``hello``, which
merges revoked ids) discards a task — a round's shard, and the round waits for it.

So an agent's main process answers only (:func:`guard`, at worker start):

* monitoring — ``ping``, the read-only ``inspect`` commands, and ``enable_events``: exactly what
  ``celery inspect`` and Flower use to list and watch the agents;
* commands signed with the pool key (:func:`send`): ``cancel_consumer`` (a quarantine) and
  ``add_consumer`` (benchmarks), each signed for one agent and one start of it (its heartbeat's
  ``incarnation``, :data:`tensorturn.pool.telemetry.INCARNATION`), so a copy replayed after a restart
  binds nobody; and ``revoke`` (a start request no agent answered in time; naming one task id,
  so a replay changes nothing).

Every other command — Flower's buttons included — is answered with an error, logged, and kept
in ``tt:refused`` with the tasks the agents refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from functools import lru_cache
from typing import Any

from tensorturn import trust
from tensorturn.pool import telemetry
from tensorturn.state.broker import redis_client
from tensorturn.state.refusals import refuse

log = logging.getLogger(__name__)

# ping and inspect's read-only commands (with Celery's aliases), and what Flower sends: its
# inspect list (stats, active_queues, registered, scheduled, active, reserved, revoked, conf)
# and enable_events, every few seconds. Not: hello (it merges revoked ids), memsample/memdump/
# objgraph (debugging: they grow memory, write files), heartbeat, election.
MONITORING = frozenset({
    "ping", "stats", "active", "active_queues", "registered", "scheduled", "reserved",
    "revoked", "conf", "clock", "query_task", "report", "enable_events",
    "dump_active", "dump_tasks", "dump_schedule", "dump_reserved", "dump_revoked", "dump_conf",
})
BOUND = frozenset({"cancel_consumer", "add_consumer"})  # signed for one agent, one start of it
SIGNED = BOUND | {"revoke"}
PURPOSE = "control"

Handler = Callable[..., Any]


def command_doc(command: str, arguments: dict[str, Any], worker: str | None,
                incarnation: str | None) -> dict[str, Any]:
    """What a command's signature covers: its name and every argument, and for a command
    :data:`BOUND` to one agent, that agent and that start of it."""
    doc: dict[str, Any] = {"command": command, "arguments": arguments}
    if command in BOUND:
        doc.update(worker=worker, incarnation=incarnation)
    return doc


def send(app: Any, command: str, arguments: dict[str, Any], worker: str | None = None,
         incarnation: str | None = None, reply: bool = False) -> Any:
    """Send ``command`` signed with the pool key, to ``worker`` only or to every agent. A
    command bound to one agent names its ``incarnation``: by default this process's (a task
    of that agent), else the one its heartbeat shows (``tensorturn workers --json``). With
    ``reply``, the agents' answers."""
    incarnation = telemetry.INCARNATION if incarnation is None else incarnation
    sig = trust.pool_key().sign(PURPOSE, command_doc(command, arguments, worker, incarnation))
    return app.control.broadcast(command, arguments={**arguments, "sig": sig}, reply=reply,
                                 destination=[worker] if worker else None, timeout=2.0)


def guard(panel: MutableMapping[str, Handler]) -> None:
    """Leave in ``panel`` (Celery's registry of remote-control handlers: ``Panel.data``) only
    the monitoring commands as they are; the signed ones check their signature first, and every
    other command is refused. Idempotent."""
    for name, handler in list(panel.items()):
        if name in MONITORING or getattr(handler, "guarded", False):
            continue
        panel[name] = _checked(name, handler) if name in SIGNED else _refused(name)


def _checked(name: str, handler: Handler) -> Handler:
    def checked(state: Any, sig: Any = None, **arguments: Any) -> Any:
        key = trust.find_key()
        doc = command_doc(name, arguments, state.hostname, telemetry.INCARNATION)
        if key is None or not key.verify(PURPOSE, doc, sig):
            return _refuse(state, name, "missing or bad signature: sent by someone without the "
                                        "pool key, or for another agent or an earlier start of it")
        return handler(state, **arguments)

    checked.guarded = True  # type: ignore[attr-defined]
    return checked


def _refused(name: str) -> Handler:
    def refused(state: Any, **_: Any) -> Any:
        return _refuse(state, name, "not allowed: an agent answers only monitoring commands "
                                    "(ping, inspect) and TensorTurn's own, signed ones")

    refused.guarded = True  # type: ignore[attr-defined]
    return refused


@lru_cache(maxsize=1)
def _broker(url: str) -> Any:
    return redis_client(url)


def _refuse(state: Any, name: str, reason: str) -> dict[str, str]:
    """Log and keep the refusal (``tt:refused``); the answer a sender asking for one gets."""
    worker = getattr(state, "hostname", None) or "?"
    log.warning("refused remote control command %r: %s", name, reason)
    try:
        refuse(_broker(state.app.conf.broker_url), worker, f"remote control: {name}", "", reason)
    except Exception as exc:  # noqa: BLE001 - the refusal stands; keeping it is best effort
        log.debug("refusal not recorded: %s", exc)
    return {"error": f"refused by {worker}: {reason}"}
