"""An agent's data budget: the bytes it moved to and from the store, per day, week and month.

A metered home line has an allowance per period (``--data-cap-gb 200/month``). Every byte an
agent's tasks move through the store is already recorded once per attempt, with the attempt's
end (:meth:`tensorturn.state.traffic.Traffic.add_store_bytes`); the same pipeline adds it to the
agent's counter of the day, the ISO week and the month it is in, on the agent's own calendar
(the household's period, not the broker's), so a cap set later counts what was moved before it
too. So the count moves by whole attempts: a cap is overshot by at most one task's transfers.
Each counter expires a little after its period ends.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tensorturn import layout
from tensorturn.errors import SpecError

GB = 1_000_000_000  # an allowance's gigabyte is the provider's: 10^9 bytes
PERIODS = {"day": 2 * 86400, "week": 8 * 86400, "month": 32 * 86400}  # period → its counter's life, s
_CAP = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:GB)?\s*/\s*(day|week|month)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class DataCap:
    """At most ``gb`` gigabytes (10^9 bytes) per ``period`` (day, week or month)."""

    gb: float
    period: str

    @property
    def bytes(self) -> int:
        return int(self.gb * GB)

    def __str__(self) -> str:
        return f"{self.gb:g} GB/{self.period}"


def parse_cap(text: str) -> DataCap:
    """``200/month``, ``50/week``, ``0.5/day`` (GB per period); SpecError in one line otherwise."""
    m = _CAP.match(text or "")
    if not m or float(m[1]) <= 0:
        raise SpecError(f"a data cap is GB per day, week or month, more than 0, e.g. 200/month (got {text!r})")
    return DataCap(float(m[1]), m[2].lower())


def period_of(period: str, when: datetime | None = None) -> str:
    """The name of the ``period`` (day, week, month) that local time ``when`` (now) is in:
    ``2026-12-07``, ``2026-W49`` (ISO weeks start on Monday), ``2026-12``."""
    when = when or datetime.now()
    if period == "day":
        return f"{when:%Y-%m-%d}"
    if period == "week":
        year, week, _ = when.isocalendar()
        return f"{year}-W{week:02d}"
    if period == "month":
        return f"{when:%Y-%m}"
    raise SpecError(f"unknown period {period!r}: day, week or month")


class Budget:
    """Every agent's counters of bytes moved per period."""

    def __init__(self, client: Any):
        self.r = client

    def add(self, worker: str, nbytes: int, pipe: Any = None, when: datetime | None = None) -> None:
        """Count ``nbytes`` that ``worker`` moved now (in ``pipe``, when given) in each period."""
        if nbytes <= 0:
            return
        own = pipe is None
        pipe = self.r.pipeline(transaction=False) if own else pipe
        when = when or datetime.now()
        for period, life in PERIODS.items():
            key = layout.data_key(worker, period_of(period, when))
            pipe.incrby(key, int(nbytes))
            pipe.expire(key, life)
        if own:
            pipe.execute()

    def used(self, worker: str, period: str, when: datetime | None = None) -> int:
        """The bytes ``worker`` moved in the ``period`` it is in now."""
        raw = self.r.get(layout.data_key(worker, period_of(period, when)))
        try:
            return int(raw or 0)
        except ValueError:
            return 0
