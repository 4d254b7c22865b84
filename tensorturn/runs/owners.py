"""What a machine's owner asks of its agent from any machine holding the join file: pause it,
unpause it, change its rules (:mod:`tensorturn.pool.owner` is the agent's side)."""

from __future__ import annotations

from typing import Any

from tensorturn import trust
from tensorturn.errors import SpecError
from tensorturn.state.broker import check_broker
from tensorturn.state.owners import Owners
from tensorturn.state.roster import list_workers


def find_machine(client: Any, machine: str) -> str | None:
    """The agent ``machine`` names: its full name (``gaming-pc@host``) or the part before ``@``
    when only one agent has it; None when none has it; SpecError when several do."""
    names = [w["name"] for w in list_workers(client)]
    if machine in names:
        return machine
    matches = [n for n in names if n.split("@", 1)[0] == machine]
    if len(matches) > 1:
        raise SpecError(f"{machine!r} names several agents ({', '.join(matches)}): give the full NAME@host")
    return matches[0] if matches else None


def resolve_machine(client: Any, machine: str) -> str:
    """:func:`find_machine`, and SpecError, listing the agents, when none has the name."""
    name = find_machine(client, machine)
    if name is None:
        known = ", ".join(w["name"] for w in list_workers(client)) or "none has connected to this broker"
        raise SpecError(f"no agent named {machine!r} (agents: {known})")
    return name


def names_an_agent(broker_url: str, name: str) -> bool:
    """Whether ``name`` is an agent of the pool (``resume`` still takes a machine, as before
    ``unpause``); a name several agents share is one clear error, as for ``pause``. A broker that does not answer
    names no agent: the run's resume says what it needs."""
    from tensorturn.errors import BrokerError

    try:
        client = check_broker(broker_url)
    except BrokerError:
        return False
    return find_machine(client, name) is not None


def target(client: Any, machine: str) -> tuple[str, str, dict[str, int]]:
    """The agent ``machine`` names (:func:`resolve_machine`), the start of it its heartbeat,
    signed with the pool key, shows — an owner's mark is signed for that start only
    (:mod:`tensorturn.state.owners`) — and the numbers of the marks it holds, by field (a new
    mark is numbered above them). SpecError for an agent whose heartbeat does not verify."""
    name = resolve_machine(client, machine)
    key = trust.pool_key()  # only a holder of the key changes what an agent does
    me = next(w for w in list_workers(client, key=key) if w["name"] == name)
    if me["state"] == "offline":
        raise SpecError(f"{name} is offline: its owner's marks are signed for one start of it, so start "
                        f"it, then run this again (a pause it had holds across its restart)")
    if not me["verified"] or not isinstance(me["incarnation"], str):
        raise SpecError(f"{name}'s heartbeat does not verify with this pool key: wait for its next "
                        f"heartbeat (a few seconds), or check that it joined with this join file")
    return name, me["incarnation"], dict(me["owner"])


def pause(broker_url: str, machine: str, reason: str) -> dict[str, Any]:
    """Pause ``machine``'s agent until :func:`unpause` (it survives the agent's restart, and the
    broker's loss of the mark: the agent keeps it)."""
    client = check_broker(broker_url)
    name, incarnation, held = target(client, machine)
    mark = Owners(client).set(name, incarnation, "paused", reason or "paused by its owner", trust.pool_key(),
                              held.get("paused", 0))
    return {"machine": name, "paused": mark.value, "seq": mark.seq}


def unpause(broker_url: str, machine: str) -> dict[str, Any]:
    """End a pause of ``machine``'s (its policy may still hold it: the answer says which)."""
    client = check_broker(broker_url)
    name, incarnation, held = target(client, machine)
    owners, key = Owners(client), trust.pool_key()
    last = owners.read(name, key).get("paused")
    was = last.value is not None if last is not None else _held_pause(client, name)
    mark = owners.set(name, incarnation, "paused", None, key, held.get("paused", 0))
    return {"machine": name, "was_paused": was, "seq": mark.seq}


def _held_pause(client: Any, name: str) -> bool:
    """Whether ``name``'s heartbeat says it is paused and holds a pause mark (the broker lost
    the mark: the agent kept it)."""
    me = next((w for w in list_workers(client) if w["name"] == name), None)
    return bool(me and me["verified"] and me["state"] == "paused" and "paused" in me["owner"])


def set_rules(broker_url: str, machine: str, rules_json: str | None) -> dict[str, Any]:
    """Replace ``machine``'s owner rules (JSON of :class:`tensorturn.pool.owner.OwnerRules`) while
    it runs; None: back to the ones it was started with. They go in the owner's ``policy`` mark,
    and the answer names them ``policy`` (the JSON of ``tensorturn rules --json``)."""
    client = check_broker(broker_url)
    name, incarnation, held = target(client, machine)
    mark = Owners(client).set(name, incarnation, "policy", rules_json, trust.pool_key(), held.get("policy", 0))
    return {"machine": name, "policy": rules_json, "seq": mark.seq}
