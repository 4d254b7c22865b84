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
a chord body queued there when its round began) is moved on the same way. The times are Redis's
own (``TIME``), so the machines' clocks do not matter.

The advertisements are in Redis, so anyone with its password can write one: the mover takes an
entry only when it names ``tt.outer.<capacity queue>`` (:data:`OUTER_QUEUES`) and is not dated
ahead of Redis's time (one that was would keep a queue "served" for as long as it liked). Any
other entry — one naming a training queue would have made every heartbeat pop
that queue's tasks into a list nobody reads — is removed, and nothing is moved from or to it.
"""

from __future__ import annotations

import logging
from typing import Any

from tensorturn import config
from tensorturn.layout import PREFIX
from tensorturn.pool.capacity import CAPACITY_QUEUES

log = logging.getLogger(__name__)

ROLES = ("train", "outer", "both")
OUTER_PREFIX = "tt.outer."
ADVERTISED = f"{PREFIX}outer-queues"  # sorted set: "<outer queue>|<agent>" → when that agent last beat
OUTER_QUEUES = frozenset(OUTER_PREFIX + q for q in CAPACITY_QUEUES)  # every name an outer queue has

# KEYS[1] = ADVERTISED; ARGV[1] = the agent, ARGV[2..] = its outer queues: stamped with Redis's time
_ADVERTISE = """
local now = redis.call('TIME')[1]
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], now, ARGV[i] .. '|' .. ARGV[1]) end
return now
"""

# KEYS[1] = ADVERTISED; ARGV[1] = seconds, ARGV[2..] = entries: dated that long before Redis's time
_WITHDRAW = """
local when = tonumber(redis.call('TIME')[1]) - tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', when, ARGV[i]) end
return when
"""

# The outer queues some agent serves, by Redis's time: a table queue → true. ARGV[1] = seconds
# after which an agent that has not beaten counts as gone. Only entries naming one of
# OUTER_QUEUES (``valid``, written into the script) and not dated more than that into the future
# count; the others are listed in ``invalid``, never used.
_FRESH = ("local valid = {" + ", ".join(f"['{q}'] = true" for q in sorted(OUTER_QUEUES)) + "}\n"
          + """
local now = tonumber(redis.call('TIME')[1])
local gone = tonumber(ARGV[1])
local fresh, all, invalid = {}, {}, {}
local entries = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #entries, 2 do
  local queue = string.match(entries[i], '^([^|]+)|')
  local age = now - tonumber(entries[i + 1])
  if queue and valid[queue] and age >= -gone then
    all[queue] = true
    if age <= gone then fresh[queue] = true end
  else
    invalid[#invalid + 1] = entries[i]
  end
end
""")

# KEYS[1] = ADVERTISED; ARGV[1] as above, ARGV[2] = OUTER_PREFIX. Moves every message of an outer
# queue that no live agent serves to the front of its capacity queue (kombu pushes left and
# pops right), unchanged; removes the invalid entries; returns {moved, removed}. A valid entry is
# never removed while its queue may still receive messages (a late chord body, a retry, a
# restored lease): only a day after its agent's last beat, its queue empty.
_REROUTE = _FRESH + """
local moved = 0
for queue, _ in pairs(all) do
  if not fresh[queue] then
    local target = string.sub(queue, #ARGV[2] + 1)
    while true do
      local message = redis.call('RPOP', queue)
      if not message then break end
      redis.call('RPUSH', target, message)
      moved = moved + 1
    end
  end
end
for _, entry in ipairs(invalid) do redis.call('ZREM', KEYS[1], entry) end
for i = 1, #entries, 2 do
  local queue = string.match(entries[i], '^([^|]+)|')
  if queue and valid[queue] and now - tonumber(entries[i + 1]) > 86400
      and redis.call('LLEN', queue) == 0 then
    redis.call('ZREM', KEYS[1], entries[i])
  end
end
return {moved, #invalid}
"""

# KEYS[1] = ADVERTISED; ARGV[1] as above, ARGV[2] = an outer queue: 1 while a live agent serves it
_SERVED = _FRESH + """
return fresh[ARGV[2]] and 1 or 0
"""


_scripts: dict[str, Any] = {}


def _run(client: Any, script: str, *args: Any) -> Any:
    """Run one of the scripts above on KEYS[1] = ADVERTISED by its sha (EVALSHA: every agent
    runs one each heartbeat, and on a home link its text would be most of the beat's bytes)."""
    if script not in _scripts:
        _scripts[script] = client.register_script(script)
    return _scripts[script](keys=[ADVERTISED], args=list(args), client=client)


def outer_queue(queue: str) -> str:
    """The outer queue of capacity queue ``queue``: where outer steps of that size wait for an
    agent beside the store."""
    return OUTER_PREFIX + queue


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


def agent_queues(role: str | None = None) -> list[str]:
    """The queues this machine's agent consumes (its own queue aside), by its role (default:
    the configured one) and the device memory it offers."""
    from tensorturn.pool.capacity import queues_for
    from tensorturn.pool.telemetry import inventory

    return consumed(role or config.current().role, queues_for(inventory()["device_memory_gb"]))


def gone_after_s() -> float:
    return 3 * config.current().heartbeat_s


def advertise(client: Any, agent: str, queues: list[str]) -> None:
    """Say (with Redis's time) that ``agent`` serves the outer queues among ``queues``."""
    outer = [q for q in queues if q in OUTER_QUEUES]
    if outer:
        _run(client, _ADVERTISE, agent, *outer)


def withdraw(client: Any, agent: str, queues: list[str]) -> None:
    """``agent`` stops serving its outer queues (a clean stop, quarantine): its entries are
    dated as if it had missed its heartbeats, so the next heartbeat of any agent moves their
    messages — those queued already, and those that come back later (a lease restored, a
    retry) — unless another agent serves them."""
    outer = [f"{q}|{agent}" for q in queues if q in OUTER_QUEUES]
    if outer:
        _run(client, _WITHDRAW, gone_after_s() + 1, *outer)


def reroute(client: Any) -> int:
    """Move outer steps whose outer queue no live agent serves to their capacity queue; returns
    how many moved (every agent calls this with its heartbeat)."""
    moved, removed = (int(n) for n in _run(client, _REROUTE, gone_after_s(), OUTER_PREFIX))
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
        served = bool(_run(client, _SERVED, gone_after_s(), outer_queue(queue)))
    except Exception as exc:  # noqa: BLE001 - the trainers can always take it
        log.debug("outer queue not checked: %s", exc)
        served = False
    return outer_queue(queue) if served else queue
