"""What a machine's owner asks of its agent from any machine holding the join file: pause it,
resume it, change its policy (:mod:`tensorturn.pool.owner` is the agent's side)."""

from __future__ import annotations

from typing import Any

from tensorturn import trust
from tensorturn.errors import SpecError
from tensorturn.state.broker import check_broker
from tensorturn.state.owners import Owners
from tensorturn.state.roster import list_workers


def resolve_machine(client: Any, machine: str) -> str:
    """The agent ``machine`` names: its full name (``gaming-pc@host``) or the part before ``@``
    when only one agent has it. SpecError, listing the agents, for anything else."""
    names = [w["name"] for w in list_workers(client)]
    if machine in names:
        return machine
    matches = [n for n in names if n.split("@", 1)[0] == machine]
    if len(matches) == 1:
        return matches[0]
    known = ", ".join(names) or "none has connected to this broker"
    if matches:
        raise SpecError(f"{machine!r} names several agents ({', '.join(matches)}): give the full NAME@host")
    raise SpecError(f"no agent named {machine!r} (agents: {known})")


def names_an_agent(broker_url: str, name: str) -> bool:
    """Whether ``name`` is an agent of the pool (``resume`` takes a run or a machine); a name
    several agents share is one clear error, as for ``pause``. A broker that does not answer
    names no agent: the run's resume says what it needs."""
    from tensorturn.errors import BrokerError

    try:
        client = check_broker(broker_url)
    except BrokerError:
        return False
    names = [w["name"] for w in list_workers(client)]
    if name in names:
        return True
    if sum(n.split("@", 1)[0] == name for n in names) > 1:
        resolve_machine(client, name)  # raises, naming them
    return any(n.split("@", 1)[0] == name for n in names)


def pause(broker_url: str, machine: str, reason: str) -> dict[str, Any]:
    """Pause ``machine``'s agent until :func:`resume` (it survives the agent's restart)."""
    client = check_broker(broker_url)
    name = resolve_machine(client, machine)
    Owners(client).set(name, "paused", reason or "paused by its owner", trust.pool_key())
    return {"machine": name, "paused": reason or "paused by its owner"}


def resume(broker_url: str, machine: str) -> dict[str, Any]:
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
