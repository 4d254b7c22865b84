"""The testbed's emulations reach agents that a warm parent forked (testbed.emulate)."""

from __future__ import annotations

import pytest
import redis
from conftest import start_pool, wait_for

from tensorturn.state.roster import list_workers
from testbed import emulate


def test_agents_forked_by_a_warm_parent_read_the_battery_file(tmp_path):
    """A quick pool forks its agents from one warm parent (Linux): the emulations it installed
    as it started reach each agent, which reads its own environment's battery file — here
    saying ``battery``, so each pauses, as its policy asks."""
    from tensorturn import platforms

    if not platforms.forks_warm():
        pytest.skip("agents are forked warm only where that is safe (Linux)")
    battery = tmp_path / "battery"
    battery.write_text("battery")
    pool = start_pool(tmp_path, 2, quick=True,
                      env={emulate.BATTERY_FILE: str(battery), "TENSORTURN_PAUSE_ON_BATTERY": "1"})
    try:
        assert pool.parent is not None  # forked, not started one by one
        client = redis.Redis.from_url(pool.broker_url, decode_responses=True)
        wait_for(lambda: sorted(w["paused"] for w in list_workers(client)) == ["on battery"] * 2,
                 "both forked agents paused on battery")
    finally:
        pool.stop(grace=1.0)
