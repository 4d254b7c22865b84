"""What a waiting task is told in a fused run: round r's shards are all stored (the slot standing by
to take its outer step goes on), and θ_r is stored (the slots of round r waiting for it go on).

Each is one list in Redis a waiter pops with a blocking call (``standby-r<r>``,
``global-stored-r<r>``), on a connection of its own that gives up a few seconds after the wait: a
link dropped mid-wait is not waited on for hours, and a broker that does not answer counts as no
announcement (the waiter looks in the store instead).
"""

from __future__ import annotations

from typing import Any

import redis

from tensorturn import layout
from tensorturn.state.broker import lease_client

BLOCKING_SLACK_S = 5  # a blocking wait's connection gives up this long after the wait
ANNOUNCED_KEEP_S = 24 * 3600  # how long a round's "θ stored" announcement is kept (waiters come within a lease)


class Announcements:
    """A fused run's announcements: a round complete, its weights stored."""

    def __init__(self, client: Any):
        self.r = client
        self.blocking: Any = None  # for blocking waits: a client whose calls give up (lease_client)

    def announce_complete(self, run_id: str, r: int) -> None:
        """Round r's shards are all stored: the slot standing by to take its outer step goes on
        (one command; a run's keys are given an expiry once it finishes)."""
        self.r.rpush(layout.standby_key(run_id, r), "complete")

    def await_complete(self, run_id: str, r: int, timeout_s: int) -> bool:
        """Wait up to ``timeout_s`` (whole seconds) for :meth:`announce_complete`; whether it
        came (taken: one slot stands by). A broker that does not answer counts as no
        announcement."""
        if self.blocking is None:
            self.blocking = lease_client(self.r, timeout_s + BLOCKING_SLACK_S)
        try:
            return self.blocking.brpop([layout.standby_key(run_id, r)], timeout_s) is not None
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    def announce_global(self, run_id: str, r: int) -> None:
        """θ_r is stored: the slots of round r waiting for it go on; and round r−1's end is
        timed (:meth:`tensorturn.state.claims.Claims.note_stored`). One command."""
        self.r.eval(_ANNOUNCE_GLOBAL, 2, layout.global_stored_key(run_id, r), layout.run_key(run_id, "ends"),
                    r, ANNOUNCED_KEEP_S)

    def await_global(self, run_id: str, r: int, timeout_s: int) -> bool:
        """Wait up to ``timeout_s`` (whole seconds) for θ_r's announcement; whether it came. A
        blocking pop that pushes what it popped back onto the same list: every waiter sees the
        one announcement, and one that comes later sees it at once. On a connection of its own
        that gives up a few seconds after the wait (a link dropped mid-wait is not waited on for
        hours); a broker that does not answer counts as no announcement."""
        key = layout.global_stored_key(run_id, r)
        if self.blocking is None:
            self.blocking = lease_client(self.r, timeout_s + BLOCKING_SLACK_S)
        try:
            return self.blocking.brpoplpush(key, key, timeout_s) is not None
        except (redis.ConnectionError, redis.TimeoutError):
            return False

    def forget(self, run_id: str, rounds: range, pipe: Any = None) -> None:
        """No announcement of ``rounds`` (a resume steps their weights again); in ``pipe`` when given."""
        keys = [layout.global_stored_key(run_id, r) for r in rounds]
        keys += [layout.standby_key(run_id, r) for r in rounds]
        if keys:
            (pipe or self.r).delete(*keys)


_ANNOUNCE_GLOBAL = """
redis.replicate_commands()
redis.call('rpush', KEYS[1], 'stored')
redis.call('expire', KEYS[1], ARGV[2])
local near = redis.call('hget', KEYS[2], 'near' .. (tonumber(ARGV[1]) - 1))
if near then
  local t = redis.call('time')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('hsetnx', KEYS[2], 'end' .. (tonumber(ARGV[1]) - 1), now - tonumber(near))
end
return 1
"""
