"""What a machine's owner asks of its agent from any machine holding the join file: pause it,
unpause it, change its policy (:mod:`tensorturn.pool.owner` is the agent's side)."""

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
    ``unpause``); a name several agents share is one clear error, as for ``pause``. A broker that
    does not answer names no agent: the run's resume says what it needs."""
    from tensorturn.errors import BrokerError

    try:
        client = check_broker(broker_url)
    except BrokerError:
        return False
    return find_machine(client, name) is not None


def pause(broker_url: str, machine: str, reason: str) -> dict[str, Any]:
    """Pause ``machine``'s agent until :func:`unpause` (it survives the agent's restart)."""
    client = check_broker(broker_url)
    name = resolve_machine(client, machine)
    Owners(client).set(name, "paused", reason or "paused by its owner", trust.pool_key())
    return {"machine": name, "paused": reason or "paused by its owner"}


def unpause(broker_url: str, machine: str) -> dict[str, Any]:
    """End a pause of ``machine``'s (its policy may still hold it: the answer says which)."""
    client = check_broker(broker_url)
    name = resolve_machine(client, machine)
    trust.pool_key()  # only a holder of the key changes what an agent does
    was = Owners(client).clear(name, "paused")
    return {"machine": name, "was_paused": was}


def set_policy(broker_url: str, machine: str, policy_json: str | None) -> dict[str, Any]:
    """Replace ``machine``'s policy (JSON of :class:`tensorturn.pool.owner.Policy`) while it
    runs; None: back to the one it was started with."""
    client = check_broker(broker_url)
    name = resolve_machine(client, machine)
    owners = Owners(client)
    if policy_json is None:
        trust.pool_key()
        owners.clear(name, "policy")
    else:
        owners.set(name, "policy", policy_json, trust.pool_key())
    return {"machine": name, "policy": policy_json}
