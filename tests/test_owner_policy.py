"""The owner-first policy's parts, without agents: hours, reasons, the readings' parsing, the
CPU watch's hysteresis, and the signed marks on a real redis-server."""

from __future__ import annotations

import datetime
from types import SimpleNamespace

import pytest
import redis

from tensorturn import trust
from tensorturn.errors import SpecError
from tensorturn.pool import owner
from tensorturn.pool.owner import (
    CpuWatch,
    MarkMemory,
    Policy,
    Readings,
    parse_compute_apps,
    parse_hours,
    why_paused,
    within_hours,
)
from tensorturn.state.owners import Owners


def at(hh: int, mm: int = 0) -> datetime.time:
    return datetime.time(hh, mm)


def test_hours_are_ranges_that_may_pass_midnight():
    assert within_hours("22:00-08:00", at(23, 30)) and within_hours("22:00-08:00", at(7, 59))
    assert not within_hours("22:00-08:00", at(8)) and not within_hours("22:00-08:00", at(12))
    assert within_hours("09:00-17:00", at(9)) and not within_hours("09:00-17:00", at(17))
    assert within_hours("01:00-02:00, 12:00-13:30", at(13, 15))
    for bad in ("25:00-08:00", "22:00", "9-17", "08:00-08:00", ""):
        with pytest.raises(SpecError):
            parse_hours(bad)
    with pytest.raises(SpecError):
        Policy(busy_percent=120)


def test_why_paused_says_what_holds_first():
    quiet = Readings(local_time=at(23))
    assert why_paused(Policy(), quiet) is None
    assert why_paused(Policy(hours="09:00-17:00"), quiet) == "outside hours (09:00-17:00)"
    assert why_paused(Policy(on_battery=True), Readings(local_time=at(23), on_battery=True)) == "on battery"
    assert why_paused(Policy(on_battery=True), Readings(local_time=at(23), on_battery=None)) is None
    busy = Readings(local_time=at(23), others_busy=True, others_percent=87.4)
    assert why_paused(Policy(busy_percent=30), busy) == "owner: other processes use over 30% of the CPU"
    assert why_paused(Policy(), busy) is None  # no threshold: the CPU is not watched
    gpu = Readings(local_time=at(23), gpu_others=[(4242, 2150.0)])
    assert why_paused(Policy(gpu_shared=True), gpu) == "owner: another process uses the GPU (pid 4242, 2.1 GB)"


def test_a_policy_goes_through_json_and_reads_the_settings():
    rule = Policy(hours="22:00-08:00", on_battery=True, busy_percent=30, gpu_shared=True)
    assert Policy.from_json(rule.to_json()) == rule
    assert rule.describe() == ("hours 22:00-08:00, pause on battery, pause while others use > 30% CPU, "
                               "pause while another process uses the GPU")
    from tensorturn import config

    settings = config.Settings.from_env({"TENSORTURN_HOURS": "22:00-08:00", "TENSORTURN_PAUSE_ON_BATTERY": "1",
                                         "TENSORTURN_PAUSE_BUSY_PERCENT": "30", "TENSORTURN_PAUSE_GPU_SHARED": "1"})
    assert Policy.from_settings(settings) == rule
    assert Policy.from_settings(config.Settings()) == Policy()


def test_nvidia_smi_compute_apps_less_this_agents_own():
    text = "1234, 2048\n999, 512\n77, [N/A]\nnot a line\n"
    assert parse_compute_apps(text, own={999}) == [(1234, 2048.0), (77, 0.0)]
    assert parse_compute_apps("", own=set()) == []


def test_the_battery_reading_of_a_fake_sensor(tmp_path):
    fake = tmp_path / "battery"
    fake.write_text("battery\n")
    assert owner.on_battery(str(fake)) is True
    fake.write_text("ac")
    assert owner.on_battery(str(fake)) is False
    assert owner.on_battery(str(tmp_path / "missing")) is None


def test_the_cpu_watch_pauses_after_busy_looks_and_resumes_after_calm_ones(monkeypatch):
    """Others' share is the machine's busy time less this agent's processes', per core-second;
    it must hold over the threshold BUSY_LOOKS looks to pause and under it CALM_LOOKS to resume."""
    machine = {"busy": 0.0, "mine": 0.0, "now": 0.0}
    monkeypatch.setattr(owner.psutil, "cpu_count", lambda: 2)

    class Times(tuple):
        pass

    def cpu_times():  # psutil's namedtuple: summed, less idle and iowait
        t = Times((machine["busy"], 1000.0))
        t.idle, t.iowait = 1000.0, 0.0
        return t

    monkeypatch.setattr(owner.psutil, "cpu_times", cpu_times)
    me = SimpleNamespace(pid=1, cpu_times=lambda: SimpleNamespace(user=machine["mine"], system=0.0))
    watch = CpuWatch(processes=lambda: [me], clock=lambda: machine["now"])

    def second(others: float, mine: float = 0.5) -> bool:
        """One second passes: others use ``others`` cores, this agent ``mine``."""
        machine["now"] += 1
        machine["busy"] += others + mine
        machine["mine"] += mine
        return watch.look(40)

    assert watch.look(40) is False and watch.percent is None  # the first look has nothing to compare
    assert second(1.6) is False and watch.percent == pytest.approx(80)
    assert second(1.6) is True                      # BUSY_LOOKS in a row over 40 %
    assert second(0.2) is True and watch.percent == pytest.approx(10)
    assert [second(0.2) for _ in range(owner.CALM_LOOKS - 2)] == [True] * (owner.CALM_LOOKS - 2)
    assert second(0.2) is False                     # CALM_LOOKS in a row under it
    assert second(1.9, mine=0.0) is False and second(0.1) is False  # one busy look is not enough


def test_owner_marks_count_only_when_signed_with_the_pool_key(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    owners, key = Owners(client), trust.pool_key()
    owners.set("pc@home", "paused", "game night", key)
    [(at, value)] = owners.read("pc@home", key).values()
    assert value == "game night" and at > 0
    assert owners.read("pc@home", None) == {}  # nothing verifies without a key
    client.hset("tt:owner:pc@home", "paused", "forged")  # the Redis password is not the pool key
    assert owners.read("pc@home", key) == {}
    assert owners.clear("pc@home", "paused") and not owners.clear("pc@home", "paused")
    at = "1.0"
    client.hset("tt:owner:laptop@home", mapping={"policy": "{}", "policy_at": at, "policy_sig": key.sign(
        "owner", {"worker": "pc@home", "field": "policy", "value": "{}", "at": at})})  # another machine's
    assert owners.read("laptop@home", key) == {}



def test_unpause_ends_a_pause_and_resume_machine_still_does_with_a_note(redis_server):
    """`unpause` is the machine's verb (`resume` is a run's); the old `resume MACHINE` works on,
    and says the new name in one line on stderr."""
    from conftest import clean_env, tt

    from tensorturn.pool.telemetry import Heartbeat

    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    hb = Heartbeat.__new__(Heartbeat)  # a signed heartbeat, without a worker around it
    hb.client, hb.node, hb.tref, hb.outer = client, "pc@home", None, []
    hb.beat(first=True)
    env, owners = clean_env(TENSORTURN_BROKER_URL=redis_server.url), Owners(client)

    def paused() -> bool:
        return bool(owners.read("pc@home", trust.pool_key()))

    out = tt("pause", "pc", "--reason", "game night", env=env)
    assert out.returncode == 0 and "`tensorturn unpause pc` ends it" in out.stdout and paused()
    out = tt("unpause", "pc", env=env)
    assert (out.returncode, out.stdout, out.stderr) == (
        0, "pc@home resumes within a few seconds, unless its policy holds it\n", "")
    assert not paused()

    assert tt("pause", "pc", env=env).returncode == 0 and paused()
    out = tt("resume", "pc", env=env)
    assert out.returncode == 0 and not paused()
    assert out.stderr == "note: `tensorturn resume MACHINE` is now `tensorturn unpause pc`\n"
    assert tt("unpause", "nobody", env=env).stderr.startswith("error: no agent named 'nobody'")

def test_a_removed_mark_written_back_is_not_taken_again():
    """Someone with the Redis password copies a signed pause, waits for `resume`, and writes it
    back: the agent saw it removed, and takes only newer ones."""
    memory = MarkMemory()
    assert memory.fresh({"paused": (10.0, "game night")}) == {"paused": "game night"}
    assert memory.fresh({}) == {}                                    # resumed
    assert memory.fresh({"paused": (10.0, "game night")}) == {}      # the copy, written back
    assert memory.fresh({"paused": (12.0, "late game")}) == {"paused": "late game"}  # a new pause
    assert memory.fresh({"paused": (12.0, "late game"), "policy": (5.0, "{}")}) == \
        {"paused": "late game", "policy": "{}"}


def test_an_agent_with_bad_hours_or_pool_stops_at_once_in_one_line():
    """Before it connects or imports torch: one line, exit 2, nothing started."""
    from conftest import clean_env, tt

    for flags, says in ((["--hours", "25:00-08:00"], "hours must be HH:MM-HH:MM"),
                        ([], "TENSORTURN_AGENT_POOL must be one of prefork, threads")):
        env = clean_env(TENSORTURN_AGENT_POOL="gevent") if not flags else None
        out = tt("agent", "--broker", "redis://127.0.0.1:1/0", *flags, env=env)
        assert out.returncode == 2 and says in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1
