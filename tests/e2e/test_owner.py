"""The owner comes first: real agents that step aside — by `tensorturn pause`, on battery,
outside their hours, while other processes keep the CPU busy — hand their running task back at no
cost to the run's attempts, take nothing until the policy allows, and come back.

Owners are simulated: a file stands in for the battery sensor (TESTBED_BATTERY_FILE), another
for the share of the CPU other processes use (TESTBED_OTHERS_CPU_FILE; both testbed.emulate),
and the hours are set around the machine's own clock.
"""

from __future__ import annotations

import contextlib
import datetime
import json

import psutil
import pytest
import redis
from conftest import clean_env, run_to_end, start_pool, submit_run, tt, tt_here, wait_for, wait_for_run

from tensorturn import layout, platforms
from tensorturn.pool.owner import OwnerRules
from tensorturn.runs.owners import set_rules
from tensorturn.state.board import RunBoard
from tensorturn.state.roster import list_workers

pytestmark = [pytest.mark.e2e, pytest.mark.long]

# each of the 3 shards trains 3 s (emulated steps), long enough to be paused mid-task (the CPU
# policy takes a few looks); max_attempts 1: an attempt a pause cost would fail the run
SPEC = dict(mode="fused", recipe="digits-mlp", rounds=2, shards=3, sync_every=60, max_attempts=1)
STEP_S = 0.05


@pytest.fixture(scope="module")
def owned(tmp_path_factory):
    """Two agents whose battery sensor is a file (saying ``ac``)."""
    tmp = tmp_path_factory.mktemp("owner")
    battery = tmp / "battery"
    battery.write_text("ac")
    others_cpu = tmp / "others-cpu"  # the share of the CPU other processes use, as the agents read it
    others_cpu.write_text("0")
    pool = start_pool(tmp, 2, step_s=STEP_S, loglevel="INFO",
                      env={"TESTBED_BATTERY_FILE": str(battery), "TENSORTURN_CACHE_DIR": str(tmp / "cache"),
                           "TESTBED_OTHERS_CPU_FILE": str(others_cpu)})
    pool.battery, pool.others_cpu = battery, others_cpu
    yield pool
    pool.stop(grace=1.0)


@pytest.fixture
def pool(owned):
    """The module's pool with both agents at work, their policies as they were started."""
    yield owned
    owned.battery.write_text("ac")
    owned.others_cpu.write_text("0")
    for name in ("local1", "local2"):  # in this process: each command a subprocess took seconds
        tt_here("unpause", name, env=cli_env(owned))
        tt_here("policy", name, "--clear", env=cli_env(owned))
    wait_for(lambda: {w["state"] for w in workers(owned)} <= {"idle", "busy"}, "both agents back at work")


@pytest.fixture(scope="module")
def reference(owned):
    """The undisturbed run of SPEC on the same pool."""
    doc = run_to_end(owned, **SPEC)
    assert doc["state"] == "succeeded" and not doc["incidents"]
    return doc


def cli_env(pool) -> dict[str, str]:
    return clean_env(TENSORTURN_BROKER_URL=pool.broker_url)


def workers(pool) -> list[dict]:
    return list_workers(redis.Redis.from_url(pool.broker_url, decode_responses=True))


def standing(pool, name: str) -> dict:
    return next(w for w in workers(pool) if w["name"].startswith(name + "@"))


def running_shard(pool, run_id: str) -> dict:
    board = RunBoard(redis.Redis.from_url(pool.broker_url, decode_responses=True))
    return wait_for(lambda: next((a for a in board.attempts.all(run_id)
                                  if a["outcome"] == "running" and "/shard-" in a["task"]), None),
                    "a shard to be training")


def handed_back(pool, run_id: str) -> list[dict]:
    board = RunBoard(redis.Redis.from_url(pool.broker_url, decode_responses=True))
    return [a for a in board.attempts.all(run_id) if a["outcome"].startswith("handed back")]


def check_same_run(doc: dict, reference: dict, victim: dict) -> None:
    """The run succeeded with the undisturbed run's model, the handed-back task (``victim``:
    its attempt) was redone by another agent, and it cost no attempt (max_attempts is 1)."""
    assert doc["state"] == "succeeded", doc.get("error")
    assert doc["model_sha256"] == reference["model_sha256"]
    redone = [a for a in doc["attempts"] if a["task"] == victim["task"] and a["outcome"] == "succeeded"]
    assert len(redone) == 1 and redone[0]["worker"] != victim["worker"]
    assert not [a for a in doc["attempts"] if a["outcome"].startswith("failed")]


def held_mid_shard(pool, run_id: str) -> tuple[dict, list[psutil.Process]]:
    """A shard's running attempt, early in its training, with the pool processes of the agent
    training it stopped (SIGSTOP; the agent's own process — its heartbeat, lease and owner
    watch — runs on): the shard stays mid-task, however long the owner's policy takes to read
    (the CPU's takes a few looks) and however loaded the machine. Returns the attempt and the
    stopped processes (:func:`let_go` starts them again)."""
    r = redis.Redis.from_url(pool.broker_url, decode_responses=True)
    board = RunBoard(r)

    def running(victim: dict) -> bool:
        return any(a["task"] == victim["task"] and a["worker"] == victim["worker"] and a["outcome"] == "running"
                   for a in board.attempts.all(run_id))

    while True:
        victim = running_shard(pool, run_id)
        agent = psutil.Process(pool.agents[int(victim["worker"].split("@")[0].removeprefix("local")) - 1].pid)
        held = [p for p in agent.children() if "PoolWorker" in " ".join(p.cmdline())]
        try:
            for p in held:
                p.suspend()
            step = json.loads(r.hget(layout.worker_key(victim["worker"]), "progress") or "{}").get("step", 0)
            if step <= SPEC["sync_every"] // 2 and running(victim):
                return victim, held
        except BaseException:
            let_go(held)
            raise
        let_go(held)  # it ended, or nears its end, before it was held: hold the next one
        wait_for(lambda v=victim: not running(v), "the shard to end")


def let_go(held: list[psutil.Process]) -> None:
    for p in held:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.resume()


def paused_mid_task(pool, reference, pause) -> tuple[str, dict, dict]:
    """Submit SPEC and let ``pause(name)`` make the owner of the agent training a shard come,
    while that shard is held (:func:`held_mid_shard`) until the agent says it is paused. The
    shard is handed back and redone elsewhere, giving the undisturbed run's model at no cost to
    the attempts. Returns the agent's short name, the handed-back attempt and the run."""
    spec = submit_run(pool, **SPEC)
    victim, held = held_mid_shard(pool, spec.run_id)
    name = victim["worker"].split("@")[0]
    try:
        pause(name)
        wait_for(lambda: standing(pool, name)["state"] == "paused", "the agent to step aside")
    finally:
        let_go(held)
    [back] = wait_for(lambda: handed_back(pool, spec.run_id), "the running shard to be handed back")
    assert back["task"] == victim["task"] and back["worker"] == victim["worker"]
    doc = wait_for_run(pool, spec.run_id)
    check_same_run(doc, reference, back)
    return name, back, doc


def test_pause_hands_the_running_task_back_and_resume_brings_the_agent_back(pool, reference):
    def owner_pauses(name: str) -> None:
        out = tt("pause", name, "--reason", "game night", env=cli_env(pool))
        assert out.returncode == 0, out.stderr

    name, back, doc = paused_mid_task(pool, reference, owner_pauses)
    assert back["outcome"] == "handed back: owner: game night"
    paused = standing(pool, name)
    assert paused["state"] == "paused" and paused["paused"] == "owner: game night"
    listed = tt("workers", "--json", env=cli_env(pool))
    assert '"paused": "owner: game night"' in listed.stdout
    # what Flower shows (Celery's inspect): the paused agent runs nothing
    from tensorturn.pool.celery_app import app, configure

    configure(pool.broker_url)
    assert app.control.inspect(destination=[back["worker"]], timeout=2).active() == {back["worker"]: []}
    assert not [a for a in doc["attempts"] if a["worker"] == back["worker"]
                and a["started_at"] > back["finished_at"]]  # it took nothing while paused
    assert tt("unpause", name, env=cli_env(pool)).returncode == 0
    wait_for(lambda: standing(pool, name)["state"] == "idle", "the agent to resume")


def test_on_battery_the_agent_hands_back_and_resumes_on_mains(pool, reference):
    def unplugged(name: str) -> None:
        assert tt("rules", name, "--pause-on-battery", env=cli_env(pool)).returncode == 0
        pool.battery.write_text("battery")

    name, back, _ = paused_mid_task(pool, reference, unplugged)
    assert back["outcome"] == "handed back: on battery"
    assert standing(pool, name)["paused"] == "on battery"
    pool.battery.write_text("ac")
    wait_for(lambda: standing(pool, name)["state"] == "idle", "the agent to resume on mains")


def test_outside_its_hours_the_agent_pauses_and_the_policy_changes_while_it_runs(pool, reference):
    now = datetime.datetime.now()

    def hours(start: datetime.datetime, end: datetime.datetime) -> str:
        return f"{start:%H:%M}-{end:%H:%M}"

    later = hours(now + datetime.timedelta(hours=2), now + datetime.timedelta(hours=3))
    name, _, _ = paused_mid_task(pool, reference, lambda name: tt("rules", name, "--hours", later, env=cli_env(pool)))
    assert standing(pool, name)["state"] == "paused"
    assert standing(pool, name)["paused"] == f"outside hours ({later})"
    around = hours(now - datetime.timedelta(hours=1), now + datetime.timedelta(hours=1))
    assert tt("rules", name, "--hours", around, env=cli_env(pool)).returncode == 0
    wait_for(lambda: standing(pool, name)["state"] == "idle", "the agent to resume within its hours")


def test_a_busy_cpu_pauses_the_agent_until_the_owner_leaves(pool, reference):
    """The owner's game uses 90 % of the CPU, then leaves: the agents' CPU reading says so (a
    testbed stand-in, testbed.emulate: what else runs on the test machine would make a real
    load flap), the rules set over the broker pause the agent mid-task and it resumes once the
    CPU is calm."""
    def owner_plays(name: str) -> None:
        pool.others_cpu.write_text("90")
        set_rules(pool.broker_url, name, OwnerRules(busy_percent=40.0).to_json())

    try:
        name, back, _ = paused_mid_task(pool, reference, owner_plays)
        assert back["outcome"] == "handed back: owner: other processes use over 40% of the CPU"
        assert standing(pool, name)["paused"] == "owner: other processes use over 40% of the CPU"
    finally:
        pool.others_cpu.write_text("0")  # the owner leaves
    wait_for(lambda: standing(pool, name)["state"] == "idle", "the agent to resume once the CPU is calm")


def test_owner_commands_name_a_machine_that_exists(pool):
    out = tt("pause", "nosuch", env=cli_env(pool))
    assert out.returncode != 0 and "no agent named 'nosuch'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    bad = tt("policy", "local1", "--hours", "25:00-08:00", env=cli_env(pool))
    assert bad.returncode != 0 and "hours must be HH:MM-HH:MM" in bad.stderr
    assert tt("policy", "local1", env=cli_env(pool)).returncode == 2


# ---- someone with only the Redis password ---------------------------------------------------------

@pytest.fixture
def lone(pool_factory, tmp_path):
    """One agent of its own pool, keeping what it holds in a folder of this test's."""
    return pool_factory(1, env={"TENSORTURN_CACHE_DIR": str(tmp_path / "cache")})


def owner_hash(pool, name: str) -> tuple[redis.Redis, str]:
    r = redis.Redis.from_url(pool.broker_url, decode_responses=True)
    return r, layout.owner_key(standing(pool, name)["name"])


def consuming(pool, name: str) -> list[str]:
    """The queues agent ``name`` consumes now, as Celery's inspect says."""
    from tensorturn.pool.celery_app import app, configure

    configure(pool.broker_url)
    full = standing(pool, name)["name"]
    replies = wait_for(lambda: app.control.inspect(destination=[full], timeout=2).active_queues(),
                       "the agent to answer inspect")
    return [q["name"] for q in replies[full]]


def after_its_next_look(pool, name: str, state: str) -> dict:
    """Set a signed policy that changes nothing (no CPU is busier than 100 %) and wait until the
    agent's heartbeat says it took that policy, or that it left ``state``: either way it has
    read its owner's marks since. What its heartbeat says then."""
    doc = set_rules(pool.broker_url, name, OwnerRules(busy_percent=100.0).to_json())

    def looked() -> dict | None:
        me = standing(pool, name)
        took = doc.get("seq") is not None and me.get("owner", {}).get("policy") == doc["seq"]
        return me if took or me["state"] != state else None

    return wait_for(looked, "the agent to read its owner's marks")


def test_a_pause_whose_mark_is_deleted_on_the_broker_holds_until_resumed(lone):
    assert tt("pause", "local1", "--reason", "game night", env=cli_env(lone)).returncode == 0
    wait_for(lambda: standing(lone, "local1")["state"] == "paused", "the agent to step aside")
    r, key = owner_hash(lone, "local1")
    assert r.delete(key) == 1  # HDEL of every field: the broker lost the owner's mark
    me = after_its_next_look(lone, "local1", "paused")
    assert me["state"] == "paused" and me["paused"] == "owner: game night"
    assert consuming(lone, "local1") == []  # it takes no work
    assert tt("unpause", "local1", env=cli_env(lone)).returncode == 0
    wait_for(lambda: standing(lone, "local1")["state"] == "idle", "the agent to resume")
    wait_for(lambda: consuming(lone, "local1"), "the agent to consume its queues again")  # (just after it says so)


def test_a_copied_pause_mark_written_back_after_a_restart_pauses_nobody(lone):
    assert tt("pause", "local1", "--reason", "game night", env=cli_env(lone)).returncode == 0
    wait_for(lambda: standing(lone, "local1")["state"] == "paused", "the agent to step aside")
    r, key = owner_hash(lone, "local1")
    copy = r.hgetall(key)
    assert tt("unpause", "local1", env=cli_env(lone)).returncode == 0
    wait_for(lambda: standing(lone, "local1")["state"] == "idle", "the agent to resume")
    before = standing(lone, "local1")["incarnation"]
    platforms.kill_group(lone.agents[0])  # the agent and its pool, at once
    lone.agents[0].wait()
    lone.start_agent(0)
    wait_for(lambda: (me := standing(lone, "local1"))["incarnation"] != before and me["state"] == "idle",
             "the restarted agent at work")
    r.hset(key, mapping=copy)
    me = after_its_next_look(lone, "local1", "idle")
    assert me["state"] == "idle" and not me["paused"]
    wait_for(lambda: consuming(lone, "local1"), "the agent to consume its queues")


# ---- the household's line: caps, measured links, a data cap ---------------------------------------

def test_past_its_data_cap_the_agent_pauses_while_its_task_is_redone_elsewhere(pool, reference):
    """A metered line: the owner sets a data cap the agent has already used up (its start's
    probe alone moved megabytes today). It hands its running shard back, the shard is redone
    on the other agent at no cost to the attempts, and the run's model is the undisturbed one's."""
    def metered(name: str) -> None:
        assert tt("rules", name, "--data-cap-gb", "0.001/day", env=cli_env(pool)).returncode == 0

    name, back, _ = paused_mid_task(pool, reference, metered)
    assert back["outcome"] == "handed back: data cap (0.001 GB/day)"
    me = standing(pool, name)
    assert me["paused"] == "data cap (0.001 GB/day)" and me["verified"]
    assert me["data_cap_bytes"] == 1_000_000 and me["data_cap_period"] == "day"
    assert me["data_used_bytes"] >= 1_000_000


def test_agents_say_their_measured_links_and_their_owners_caps(pool):
    """Each agent measures its link to the store when it starts and its broker's round trip
    every heartbeat, and says so in its signed heartbeat beside its owner's caps; the pool's
    plan reads the effective rates (:func:`tensorturn.state.roster.links`): never above a cap."""
    from tensorturn.state.roster import links

    def measured() -> list[dict] | None:
        ws = workers(pool)
        return ws if all(w["link_up_bps"] and w["link_down_bps"] and w["broker_rtt_s"] for w in ws) else None

    for w in wait_for(measured, "both agents to measure their links"):
        assert w["verified"] and w["link_age_s"] is not None and not w["link_stale"]
        assert w["cap_up_bps"] == 0 and w["data_cap_bytes"] == 0 and w["data_used_bytes"] == 0
    out = tt("rules", "local1", "--max-upload-mbit", "20", "--max-download-mbit", "100", "--data-cap-gb",
             "200/month", env=cli_env(pool))
    assert out.returncode == 0, out.stderr
    assert "upload ≤ 20 Mbit/s, download ≤ 100 Mbit/s, pause past 200 GB/month" in out.stdout
    me = wait_for(lambda: (w := standing(pool, "local1"))["cap_up_bps"] and w, "the caps in its heartbeat")
    assert me["verified"] and me["state"] in ("idle", "busy")  # signed, and at work: under its cap
    assert me["cap_up_bps"] == 2_500_000 and me["cap_down_bps"] == 12_500_000
    assert me["data_cap_bytes"] == 200_000_000_000 and me["data_cap_period"] == "month"
    assert me["data_used_bytes"] > 0  # the start's probe counted
    effective = links(redis.Redis.from_url(pool.broker_url, decode_responses=True))[me["name"]]
    assert effective["up_bps"] == min(me["link_up_bps"], 2_500_000)
    assert effective["down_bps"] == min(me["link_down_bps"], 12_500_000) and effective["rtt_s"] > 0
    listed = tt("workers", env=cli_env(pool))
    assert "/20 down " in listed.stdout and "GB this month" in listed.stdout, listed.stdout


def test_an_agent_started_with_a_cap_keeps_its_own_transfers_to_it(pool_factory, tmp_path):
    """Started with --max-upload-mbit 2 (TENSORTURN_MAX_UPLOAD_MBIT, as the agent's flag sets
    it): its start's probe, bounded to 2 s, measures its capped link — at most the cap and 5 %."""
    capped = pool_factory(1, env={"TENSORTURN_MAX_UPLOAD_MBIT": "2", "TENSORTURN_CACHE_DIR": str(tmp_path / "c")})
    me = wait_for(lambda: (w := standing(capped, "local1"))["link_up_bps"] and w, "its link measured")
    assert me["cap_up_bps"] == 250_000
    assert me["link_up_bps"] <= 250_000 * 1.05, me["link_up_bps"]
