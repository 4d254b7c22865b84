"""The testbed's emulations reach agents that a warm parent forked (testbed.emulate)."""

from __future__ import annotations

import psutil
import pytest
import redis
from conftest import start_pool, wait_for

from tensorturn.state.roster import list_workers
from testbed import emulate


def test_agents_forked_by_a_warm_parent_read_the_battery_file(tmp_path):
    """A quick pool forks its agents from one warm parent (Linux): the emulations it installed
    as it started reach each agent, which reads its own environment's battery file — here
    saying ``battery``, so each pauses, as its policy asks. An agent killed and started again
    is forked by the same parent, as a new start of the agent."""
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
        # each titled in `ps` as Celery names an agent's processes (test_owner finds them so)
        for i, agent in enumerate(pool.agents):
            titles = [" ".join(p.cmdline()) for p in (psutil.Process(agent.pid), *psutil.Process(agent.pid).children())]
            assert titles[0].startswith(f"[celeryd: local{i + 1}@") and "PoolWorker" in titles[1], titles
        # each a start of its own (what a signed mark or command is bound to), not the parent's
        assert len({w["incarnation"] for w in list_workers(client)}) == 2
        # an agent the pool starts again is forked by the same parent, a new start, and reads
        # its file too
        def local2() -> dict:
            return next(w for w in list_workers(client) if w["name"].startswith("local2@"))

        killed, before = pool.agents[1], local2()["incarnation"]
        platforms.kill_group(killed)
        killed.wait()
        again = pool.start_agent(1)
        assert psutil.Process(again.pid).ppid() == pool.parent.pid
        pool.wait_ready()
        wait_for(lambda: local2()["incarnation"] != before and local2()["paused"] == "on battery",
                 "the agent forked again paused on battery")
    finally:
        pool.stop(grace=1.0)
