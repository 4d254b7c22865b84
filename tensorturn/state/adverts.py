"""Which agents serve which outer queue, on the broker (``tt:outer-queues``, a sorted set:
``"<outer queue>|<agent>"`` → when that agent last beat, by Redis's own clock), and the moves that
keep an outer queue nobody serves from holding messages: the Lua scripts of
:mod:`tensorturn.pool.routing`, which decides when to call them.

Only an entry that names one of the ``valid`` outer queues and is not dated ahead of Redis's
time counts (anyone with the Redis password can write one); any other is removed, and nothing is
moved from or to it.
"""

from __future__ import annotations

from typing import Any

from tensorturn.layout import ADVERTISED, OUTER_PREFIX

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
# after which an agent that has not beaten counts as gone. Only entries naming one of the valid
# outer queues (``valid``, written into the script) and not dated more than that into the future
# count; the others are listed in ``invalid``, never used.
_FRESH = """
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
"""

# KEYS[1] = ADVERTISED; ARGV[1] as above, ARGV[2] = OUTER_PREFIX. Moves every message of an outer
# queue that no live agent serves to the front of its capacity queue (kombu pushes left and
# pops right), unchanged; removes the invalid entries; returns {moved, removed}. A valid entry is
# never removed while its queue may still receive messages (a late outer step, a retry, a
# restored lease): only a day after its agent's last beat, its queue empty.
_REROUTE = """
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
_SERVED = """
return fresh[ARGV[2]] and 1 or 0
"""

_scripts: dict[str, Any] = {}


class Adverts:
    """The advertisements of the outer queues among ``valid``."""

    def __init__(self, client: Any, valid: frozenset[str]):
        self.r = client
        self.fresh = ("local valid = {" + ", ".join(f"['{q}'] = true" for q in sorted(valid)) + "}\n"
                      + _FRESH)

    def _run(self, script: str, *args: Any) -> Any:
        """Run ``script`` on KEYS[1] = ADVERTISED by its sha (EVALSHA: every agent runs one each
        heartbeat, and on a home link its text would be most of the beat's bytes)."""
        if script not in _scripts:
            _scripts[script] = self.r.register_script(script)
        return _scripts[script](keys=[ADVERTISED], args=list(args), client=self.r)

    def advertise(self, agent: str, queues: list[str]) -> None:
        """Say (with Redis's time) that ``agent`` serves the outer queues ``queues``."""
        self._run(_ADVERTISE, agent, *queues)

    def withdraw(self, entries: list[str], gone_s: float) -> None:
        """Date ``entries`` (``"<queue>|<agent>"``) ``gone_s`` before Redis's time."""
        self._run(_WITHDRAW, gone_s, *entries)

    def reroute(self, gone_s: float) -> tuple[int, int]:
        """Move the messages of the outer queues no agent heard within ``gone_s`` serves to their
        capacity queues; remove the invalid entries. Returns (moved, removed)."""
        moved, removed = (int(n) for n in self._run(self.fresh + _REROUTE, gone_s, OUTER_PREFIX))
        return moved, removed

    def served(self, queue: str, gone_s: float) -> bool:
        """Whether an agent heard within ``gone_s`` serves outer queue ``queue``."""
        return bool(self._run(self.fresh + _SERVED, gone_s, queue))
