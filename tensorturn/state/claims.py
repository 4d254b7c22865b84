"""Who does what once in a run: one-time dispatches (``tt:run:<id>:claims``), which shard each
slot of a round trains (``slots-r<r>``, ``owners``), and which shards of a round are stored
(``stored-r<r>``: the last one queues the outer step, and backup copies stop).

Every claim name comes from :mod:`tensorturn.layout` (``dispatch_claim``, ``backup_claim``, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import redis

from tensorturn import layout
from tensorturn.state.broker import lease_client
from tensorturn.state.clock import broker_now

BLOCKING_SLACK_S = 5  # a blocking wait's connection gives up this long after the wait
ANNOUNCED_KEEP_S = 24 * 3600  # how long a round's "θ stored" announcement is kept (waiters come within a lease)

# A round's slot → the shard it trains (see Claims.claim_shard). KEYS: the round's slots, the run's
# owners; ARGV: slot, worker, shards, then the shards whose data this worker holds. Preference: a
# shard it trained before (lowest first), else one nobody has whose data it holds, else one nobody
# has, else — work stealing — the last one of the owner with the most left, one whose data it holds
# first. Tiers are B apart, B above any score within a tier.
_CLAIM_SHARD = """
local got = redis.call('hget', KEYS[1], ARGV[1])
if got then
  redis.call('hset', KEYS[2], got, ARGV[2])
  return tonumber(got)
end
local n = tonumber(ARGV[3])
local taken = {}
for _, v in ipairs(redis.call('hvals', KEYS[1])) do taken[tonumber(v)] = true end
local owner = {}
local flat = redis.call('hgetall', KEYS[2])
for i = 1, #flat, 2 do owner[tonumber(flat[i])] = flat[i + 1] end
local held = {}
for i = 4, #ARGV do held[tonumber(ARGV[i])] = true end
local left = {}
for k = 0, n - 1 do
  local o = owner[k]
  if not taken[k] and o then left[o] = (left[o] or 0) + 1 end
end
local best, score, B = -1, -1, 2 * n * n + 1
for k = 0, n - 1 do
  if not taken[k] then
    local o, s = owner[k], 0
    if o == ARGV[2] then s = 4 * B - k
    elseif not o and held[k] then s = 3 * B - k
    elseif not o then s = 2 * B - k
    else
      s = n * left[o] + k
      if held[k] then s = s + B end
    end
    if s > score then best, score = k, s end
  end
end
if best < 0 then return -1 end
redis.call('hset', KEYS[1], ARGV[1], best)
redis.call('hset', KEYS[2], best, ARGV[2])
return best
"""


class Claims:
    """A run's one-time claims and shard assignments."""

    def __init__(self, client: Any):
        self.r = client
        self.blocking: Any = None  # for blocking waits: a client whose calls give up (lease_client)

    def claim(self, run_id: str, what: str) -> bool:
        """True the first time ``what`` is claimed for this run (guards one-time dispatches)."""
        return bool(self.r.hsetnx(layout.run_key(run_id, "claims"), what, broker_now(self.r)))

    def claim_for(self, run_id: str, what: str, holder: str) -> bool:
        """True the first time ``what`` is claimed for this run, and again for the same
        ``holder`` (a task delivered again after its machine was lost, which must finish what its
        first delivery claimed); one round trip."""
        key = layout.run_key(run_id, "claims")
        pipe = self.r.pipeline(transaction=False)
        pipe.hsetnx(key, what, holder)
        pipe.hget(key, what)
        return pipe.execute()[1] == holder

    def release(self, run_id: str, what: str) -> None:
        self.r.hdel(layout.run_key(run_id, "claims"), what)

    def clear(self, run_id: str, pipe: Any) -> None:
        """Every claim given back (a resume dispatches again what is missing), in ``pipe``."""
        pipe.delete(layout.run_key(run_id, "claims"))

    def once(self, run_id: str, what: str, dispatch: Callable[[], Any]) -> bool:
        """Run ``dispatch`` if this is the first claim of ``what``; a dispatch that fails gives
        the claim back, so the retry that follows can queue it (nothing is lost between)."""
        if not self.claim(run_id, what):
            return False
        try:
            dispatch()
        except BaseException:
            self.release(run_id, what)
            raise
        return True

    def claim_shard(self, run_id: str, r: int, slot: int, worker: str, shards: int,
                    held: Iterable[int] = ()) -> int:
        """The shard that slot ``slot`` of round ``r`` trains, decided by the first worker to run
        the slot and fixed from then on (a redelivered or duplicate slot trains the same shard).
        A worker takes the shards it trained before first — their chunks are in its cache — then
        shards nobody had, then steals from the worker with the most shards left; among new or
        stolen shards, those whose data it ``held`` (in its cache: an earlier run's, or one it
        stole before) first. Which machine trains a shard never
        changes the result, only what it downloads."""
        k = int(self.r.eval(_CLAIM_SHARD, 2, layout.slots_key(run_id, r),
                            layout.run_key(run_id, "owners"), slot, worker, shards, *held))
        if k < 0:
            raise RuntimeError(f"round {r} of run {run_id} has no shard left for slot {slot}")
        return k

    def shard_owners(self, run_id: str) -> dict[int, str]:
        """Which worker last trained each shard."""
        return {int(k): w for k, w in self.r.hgetall(layout.run_key(run_id, "owners")).items()}

    def bound_shards(self, run_id: str, r: int) -> set[int]:
        """The shards of round ``r`` a slot is bound to: their tasks began (one may have died since)."""
        return {int(v) for v in self.r.hvals(layout.slots_key(run_id, r))}

    def unclaimed_shards(self, run_id: str, r: int, shards: int) -> list[int]:
        taken = self.bound_shards(run_id, r)
        return [k for k in range(shards) if k not in taken]

    # -- shards stored: the round's last queues its outer step; backup copies stop --
    def note_stored(self, run_id: str, r: int, k: int, worker: str, shards: int = 0) -> tuple[int, float | None]:
        """Shard ``k`` of round ``r`` is stored: how many of the round's shards are (a shard
        marked again — a redelivery — counts once), and how long round r−1 took to end — from
        its second-to-last shard stored to θ_r announced (:meth:`announce_global`), by the
        broker's clock — if known; one command. ``shards``: the round's count, so that its
        second-to-last shard notes the time."""
        count, end_ms = self.r.eval(_NOTE_STORED, 2, layout.stored_key(run_id, r), layout.run_key(run_id, "ends"),
                                    str(k), worker, r, shards)
        return int(count), (None if int(end_ms) < 0 else int(end_ms) / 1000)

    def claim_step(self, run_id: str, r: int, what: str, holder: str) -> tuple[bool, set[int]]:
        """Claim ``what`` (round r's outer step) for ``holder`` (as :meth:`claim_for`): whether
        ``holder`` holds it, and which of round ``r``'s shards are marked stored (one round
        trip)."""
        held, *stored = self.r.eval(_CLAIM_STEP, 2, layout.stored_key(run_id, r), layout.run_key(run_id, "claims"),
                                    what, holder)
        return bool(held), {int(k) for k in stored}

    def release_if_held(self, run_id: str, what: str, holder: str) -> None:
        """Give ``what`` back if ``holder`` holds it."""
        self.r.eval(_RELEASE_IF_HELD, 1, layout.run_key(run_id, "claims"), what, holder)

    def release_unless_complete(self, run_id: str, r: int, shards: int, what: str, holder: str) -> bool:
        """Give ``what`` back if ``holder`` holds it and round ``r`` is not complete (fewer than
        ``shards`` stored); whether it was given back (one command, so that the round's last
        shard stored either finds it free or is stepped by its holder)."""
        return bool(self.r.eval(_RELEASE_UNLESS_COMPLETE, 2, layout.stored_key(run_id, r),
                                layout.run_key(run_id, "claims"), shards, what, holder))

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
        timed (:meth:`note_stored`). One command."""
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

    def forget_stored(self, run_id: str, rounds: range) -> None:
        """No shard of ``rounds`` counted stored (a resume: its tasks mark what is stored again,
        so a shard lost from the store is not counted)."""
        keys = [layout.stored_key(run_id, r) for r in rounds]
        keys += [layout.global_stored_key(run_id, r) for r in rounds]  # announcements of weights it steps again
        keys += [layout.standby_key(run_id, r) for r in rounds]
        if keys:
            self.r.delete(*keys)

    def is_stored(self, run_id: str, r: int, k: int) -> bool:
        return bool(self.r.hexists(layout.stored_key(run_id, r), str(k)))

    def stored(self, run_id: str, r: int) -> set[int]:
        """The shards of round ``r`` stored so far."""
        return {int(k) for k in self.r.hkeys(layout.stored_key(run_id, r))}

    # -- --sync overlap: shards handed over while they upload --
    def hand_over(self, run_id: str, r: int, k: int, token: str, lease_s: float) -> None:
        """Shard ``k`` of round ``r`` ended its task and uploads in the background: its upload's
        lease (held by ``token``, ``lease_s`` seconds unless refreshed) first, then the handed set."""
        pipe = self.r.pipeline()
        pipe.set(layout.upload_key(run_id, r, k), token, px=int(lease_s * 1000))
        pipe.sadd(layout.handed_key(run_id, r), str(k))
        pipe.execute()

    def refresh_upload(self, run_id: str, r: int, k: int, token: str, lease_s: float) -> bool:
        """Extend the lease while ``token`` holds it; False when it lapsed or another holds it."""
        return bool(self.r.eval(_REFRESH_IF_HELD, 1, layout.upload_key(run_id, r, k), token,
                                int(lease_s * 1000)))

    def upload_ended(self, run_id: str, r: int, k: int, token: str) -> None:
        """The upload ended (stored, or failed): its lease goes, unless another upload holds it."""
        self.r.eval(_DELETE_IF_HELD, 1, layout.upload_key(run_id, r, k), token)

    def uploading(self, run_id: str, r: int, k: int) -> bool:
        return bool(self.r.exists(layout.upload_key(run_id, r, k)))

    def handed(self, run_id: str, r: int) -> set[int]:
        """Round ``r``'s shards whose task ended: stored, or uploading (or its upload lost)."""
        return {int(k) for k in self.r.smembers(layout.handed_key(run_id, r))}

    def take_back(self, run_id: str, r: int, k: int) -> bool:
        """Shard ``k`` of round ``r`` is to be trained again (its upload was lost): True for the
        one caller that took it back."""
        return bool(self.r.srem(layout.handed_key(run_id, r), str(k)))

    def forget_uploads(self, run_id: str, rounds: range, shards: int) -> None:
        """No shard of ``rounds`` handed over or uploading (a resume: their tasks run again)."""
        keys = [layout.handed_key(run_id, r) for r in rounds]
        keys += [layout.upload_key(run_id, r, k) for r in rounds for k in range(shards)]
        if keys:
            self.r.delete(*keys)


_NOTE_STORED = """
redis.replicate_commands()  -- TIME then writes: Redis 3.2–4 need it, later ones do it anyway
redis.call('hsetnx', KEYS[1], ARGV[1], ARGV[2])
local n = redis.call('hlen', KEYS[1])
local r = tonumber(ARGV[3])
if n + 1 == tonumber(ARGV[4]) then
  local t = redis.call('time')
  redis.call('hsetnx', KEYS[2], 'near' .. r, tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end
return {n, tonumber(redis.call('hget', KEYS[2], 'end' .. (r - 1)) or -1)}
"""
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
_CLAIM_STEP = """
redis.call('hsetnx', KEYS[2], ARGV[1], ARGV[2])
local out = {redis.call('hget', KEYS[2], ARGV[1]) == ARGV[2] and 1 or 0}
for _, k in ipairs(redis.call('hkeys', KEYS[1])) do out[#out + 1] = k end
return out
"""
_RELEASE_UNLESS_COMPLETE = """
if redis.call('hlen', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
if redis.call('hget', KEYS[2], ARGV[2]) == ARGV[3] then return redis.call('hdel', KEYS[2], ARGV[2]) end
return 0
"""
_RELEASE_IF_HELD = """
if redis.call('hget', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('hdel', KEYS[1], ARGV[1]) end
return 0
"""
_REFRESH_IF_HELD = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return 0
"""
_DELETE_IF_HELD = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end
return 0
"""
