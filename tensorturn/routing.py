"""Outer steps beside the store: a queue that the agent on the store's machine takes them from.

An outer step reads every shard's pseudo-gradient, θ and the outer optimizer's state from the
store and writes θ, the state and the broadcast back — several whole models per round. On a
trainer at home that traffic crosses its uplink while every other machine waits for the round;
on the machine that holds the store (the coordinator) it stays on that machine. So an agent
started with ``--role outer`` (or ``both``) beside the store also consumes ``tt.outer.<queue>``
for each capacity queue it can serve, and says so with every heartbeat; a round queues its
outer step there while one does (:func:`queue_for_outer`).

Nothing may wait there for an agent that is gone: every agent's heartbeat moves the messages of
an outer queue whose agents have all missed three heartbeats back to its capacity queue
(:func:`reroute`), where any trainer takes them — a message a dead outer agent held comes back
to its outer queue when its lease expires, and is moved on the same way. The times are Redis's
own (``TIME``), so the machines' clocks do not matter.
"""

from __future__ import annotations

import logging
from typing import Any

from . import config
from .layout import PREFIX

log = logging.getLogger(__name__)

ROLES = ("train", "outer", "both")
OUTER_PREFIX = "tt.outer."
ADVERTISED = f"{PREFIX}outer-queues"  # sorted set: "<outer queue>|<agent>" → when that agent last beat

# KEYS[1] = ADVERTISED; ARGV[1] = the agent, ARGV[2..] = its outer queues: stamped with Redis's time
_ADVERTISE = """
local now = redis.call('TIME')[1]
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], now, ARGV[i] .. '|' .. ARGV[1]) end
return now
"""

# The outer queues some agent serves, by Redis's time: a table queue → true. ARGV[1] = seconds
# after which an agent that has not beaten counts as gone.
_FRESH = """
local now = tonumber(redis.call('TIME')[1])
local fresh, all = {}, {}
local entries = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
for i = 1, #entries, 2 do
  local queue = string.match(entries[i], '^(.*)|')
  all[queue] = true
  if now - tonumber(entries[i + 1]) <= tonumber(ARGV[1]) then fresh[queue] = true end
end
"""

# KEYS[1] = ADVERTISED; ARGV[1] as above, ARGV[2] = OUTER_PREFIX. Moves every message of an outer
# queue that no live agent serves to the front of its capacity queue (kombu pushes left and
# pops right), unchanged; returns how many.
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
return moved
"""

# KEYS[1] = ADVERTISED; ARGV[1] as above, ARGV[2] = an outer queue: 1 while a live agent serves it
_SERVED = _FRESH + """
return fresh[ARGV[2]] and 1 or 0
"""


def outer_queue(queue: str) -> str:
    """The outer queue of capacity queue ``queue``: where outer steps of that size wait for an
    agent beside the store."""
    return OUTER_PREFIX + queue


def check_role(role: str) -> str:
    if role not in ROLES:
        from .errors import SpecError

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
    outer = [q for q in queues if q.startswith(OUTER_PREFIX)]
    if outer:
        client.eval(_ADVERTISE, 1, ADVERTISED, agent, *outer)


def withdraw(client: Any, agent: str, queues: list[str]) -> None:
    """``agent`` stops serving its outer queues (a clean stop): their messages move on at the
    next heartbeat of any agent, unless another agent serves them."""
    outer = [f"{q}|{agent}" for q in queues if q.startswith(OUTER_PREFIX)]
    if outer:
        client.zrem(ADVERTISED, *outer)


def reroute(client: Any) -> int:
    """Move outer steps whose outer queue no live agent serves to their capacity queue; returns
    how many moved (every agent calls this with its heartbeat)."""
    moved = int(client.eval(_REROUTE, 1, ADVERTISED, gone_after_s(), OUTER_PREFIX))
    if moved:
        log.warning("moved %d outer step(s) to the trainers' queues: no agent beside the store "
                    "has answered for %.0f s", moved, gone_after_s())
    return moved


def queue_for_outer(client: Any, queue: str) -> str:
    """Where to queue an outer step that fits capacity queue ``queue``: its outer queue while an
    agent beside the store serves it, else ``queue`` itself."""
    try:
        served = bool(client.eval(_SERVED, 1, ADVERTISED, gone_after_s(), outer_queue(queue)))
    except Exception as exc:  # noqa: BLE001 - the trainers can always take it
        log.debug("outer queue not checked: %s", exc)
        served = False
    return outer_queue(queue) if served else queue
