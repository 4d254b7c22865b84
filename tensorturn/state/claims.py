"""Who does what once in a run: one-time dispatches (``tt:run:<id>:claims``), which shard each
slot of a round trains (``slots-r<r>``, ``owners``), and which shards of a round are stored
(``stored-r<r>``: the last one takes the outer step, and backup copies stop).

What a waiting task is told is :mod:`tensorturn.state.announcements`; which shards of an
overlapped round are still uploading is :mod:`tensorturn.state.uploads`.

Every claim name comes from :mod:`tensorturn.layout` (``dispatch_claim``, ``backup_claim``, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from tensorturn import layout
from tensorturn.state.clock import broker_now

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
    """A run's one-time claims, shard assignments and stored marks."""

    def __init__(self, client: Any):
        self.r = client

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
        its second-to-last shard stored to θ_r announced
        (:meth:`~tensorturn.state.announcements.Announcements.announce_global`), by the
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

    def forget_stored(self, run_id: str, rounds: range, pipe: Any = None) -> None:
        """No shard of ``rounds`` counted stored (a resume: its tasks mark what is stored again,
        so a shard lost from the store is not counted); in ``pipe`` when given."""
        keys = [layout.stored_key(run_id, r) for r in rounds]
        if keys:
            (pipe or self.r).delete(*keys)

    def is_stored(self, run_id: str, r: int, k: int) -> bool:
        return bool(self.r.hexists(layout.stored_key(run_id, r), str(k)))

    def stored(self, run_id: str, r: int) -> set[int]:
        """The shards of round ``r`` stored so far."""
        return {int(k) for k in self.r.hkeys(layout.stored_key(run_id, r))}



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
