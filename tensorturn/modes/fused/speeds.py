"""Which sync policy a pool of machines of different speeds wants: the planner's rule for mixed
speeds (pure arithmetic on the machines' seconds per inner step; no torch, no broker).

A round of S shards × H steps takes, in units of H steps (H cancels out of every ratio):

- ``--sync rounds``: the makespan of S equal jobs taken one at a time by whichever machine is
  free first (Celery's delivery) — the slowest machine's shard ends every round;
- ``--sync backup``: the same, but each shard ends on the machine that would finish it first (a
  faster machine's backup copy wins; the result is bit for bit the rounds'): never below the
  fastest machine training its share of the shards one after another;
- ``--sync async``: no barrier — S ÷ the pool's summed rate.

The rule prefers backup copies (same weights as rounds) when they alone are predicted to take
≤ :data:`BACKUP_FAST` of the rounds' wall; else async where it is predicted at ≤ :data:`ASYNC_FAST`;
else backup where it still gains (≤ :data:`BACKUP_GAIN`); else None (rounds). The thresholds are
on predicted ratios, calibrated by ``benchmarks/mixed_speeds.py --pools 1:1:4 --shards 3
--sync-every 60`` (digits, 6 rounds; docs/benchmarks/mixed-speeds.md §12c): there backup is
predicted 0.75 and measured 0.86–0.87× (its copies wait for the fastest machine, and each round
still pays its outer step), async predicted 0.50 and measured 0.64–0.74× at a load of 4–7 on two
shared cores, up to 0.87× at 8–9 (a fast machine's per-update work — fetch, apply, evaluate —
is a larger share of its shorter steps).
"""

from __future__ import annotations

import heapq
import math

BACKUP_FAST = 0.6  # backup's predicted wall ÷ rounds' at or below this: backup (≈ 0.7× measured)
ASYNC_FAST = 0.55  # else async's at or below this: async (0.50 predicted → 0.64–0.87× measured at 1:1:4)
BACKUP_GAIN = 0.8  # else backup's at or below this: backup still saves time, at no cost in the result


def rounds_wall(step_s: list[float], shards: int) -> float:
    """One round's wall under ``--sync rounds``, in units of H steps: each shard taken by the
    machine free first (ties: the faster), none moved once taken."""
    free = [(0.0, s, i) for i, s in enumerate(step_s)]
    heapq.heapify(free)
    end = 0.0
    for _ in range(shards):
        at, s, i = heapq.heappop(free)
        end = max(end, at + s)
        heapq.heappush(free, (at + s, s, i))
    return end


def backup_wall(step_s: list[float], shards: int) -> float:
    """One round's wall under ``--sync backup``: each shard ends on the machine that would
    finish it first, given what that machine trained before it in the round."""
    busy = [0.0] * len(step_s)
    for _ in range(shards):
        i = min(range(len(step_s)), key=lambda m: (busy[m] + step_s[m], step_s[m]))
        busy[i] += step_s[i]
    return max(busy)


def async_wall(step_s: list[float], shards: int) -> float:
    """A round's worth of updates (S) under ``--sync async``: S ÷ the summed rate."""
    return shards / sum(1.0 / s for s in step_s)


def choose_for_speeds(step_s: list[float], shards: int | None = None) -> str | None:
    """The ``--sync`` policy for machines whose seconds per inner step are ``step_s`` (one entry
    per machine; ``shards`` per round, default one per machine), or None where their speeds are
    close enough that blocking rounds lose little. ValueError for a step time that is not a
    positive number."""
    if any(not (isinstance(s, (int, float)) and math.isfinite(s) and s > 0) for s in step_s):
        raise ValueError(f"step times must be positive seconds, not {step_s!r}")
    shards = len(step_s) if shards is None else shards
    if len(step_s) < 2 or shards < 1:
        return None
    rounds = rounds_wall(step_s, shards)
    backup = backup_wall(step_s, shards) / rounds
    if backup <= BACKUP_FAST:
        return "backup"
    if async_wall(step_s, shards) / rounds <= ASYNC_FAST:
        return "async"
    if backup <= BACKUP_GAIN:
        return "backup"
    return None
