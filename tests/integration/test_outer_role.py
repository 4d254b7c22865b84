"""Outer steps beside the store (``agent --role outer``): a round's outer step goes to the agent
that serves the outer queue; when that agent is gone, the trainers take it, and the model is
the same either way."""

from __future__ import annotations

import redis

from tensorturn import layout
from tensorturn.pool import routing


def test_the_mover_sends_waiting_outer_steps_to_the_trainers_once_no_agent_serves_them(redis_server):
    """Messages move unchanged, in one script, only while no live agent serves their queue; an
    agent that withdrew (a clean stop, quarantine) counts as gone at once, and its queue keeps
    being watched: a message that comes back to it later moves too."""
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    outer = routing.outer_queue("tt.fits.512MB")
    r.zadd(layout.ADVERTISED, {"not-a-member": 0})  # a malformed entry is skipped
    routing.advertise(r, "a@h", [outer, "celery"])
    r.lpush(outer, "m1")
    assert routing.reroute(r) == 0 and r.lrange(outer, 0, -1) == ["m1"]
    assert routing.queue_for_outer(r, "tt.fits.512MB") == outer
    assert routing.queue_for_outer(r, "celery") == "celery"  # nobody serves tt.outer.celery

    routing.withdraw(r, "a@h", [outer])
    assert routing.queue_for_outer(r, "tt.fits.512MB") == "tt.fits.512MB"
    r.lpush("tt.fits.512MB", "older")
    r.lpush(outer, "m2")
    assert routing.reroute(r) == 2
    assert r.llen(outer) == 0
    assert r.lrange("tt.fits.512MB", 0, -1) == ["older", "m1", "m2"]  # moved ones are taken first (right)
    r.lpush(outer, "m3")  # e.g. a lease restored to the outer queue later
    assert routing.reroute(r) == 1 and r.rpop("tt.fits.512MB") == "m3"


def test_roles_decide_the_queues_an_agent_consumes():
    assert routing.consumed("train", ["celery", "tt.fits.64MB"]) == ["celery", "tt.fits.64MB"]
    assert routing.consumed("outer", ["celery"]) == ["tt.outer.celery"]
    assert routing.consumed("both", ["celery"]) == ["celery", "tt.outer.celery"]


def test_an_unknown_role_is_one_clear_line(tmp_path):
    from conftest import clean_env, tt

    out = tt("agent", "--broker", "redis://127.0.0.1:1/0", "--store", str(tmp_path),
             env=clean_env(TENSORTURN_ROLE="trainer"))
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        "error: unknown agent role 'trainer': choose one of train, outer, both"]


