"""The owner's rules and their parts, without agents: hours, reasons, the readings' parsing, the
CPU watch's hysteresis, and the signed marks on a real redis-server."""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import psutil
import pytest
import redis
from conftest import wait_for

from tensorturn import trust
from tensorturn.errors import SpecError
from tensorturn.pool import owner
from tensorturn.pool.owner import (
    CpuWatch,
    MarkMemory,
    OwnerRules,
    Readings,
    parse_compute_apps,
    parse_hours,
    why_paused,
    within_hours,
)
from tensorturn.state.owners import Mark, Owners


def at(hh: int, mm: int = 0) -> datetime.time:
    return datetime.time(hh, mm)


def test_the_rules_command_keeps_its_older_name_policy_hidden():
    from tensorturn.cli import cli

    rules, policy = cli.get_command(None, "rules"), cli.get_command(None, "policy")  # type: ignore[arg-type]
    assert rules is not None and policy is not None and policy.callback is rules.callback
    assert not rules.hidden and policy.hidden
    assert [p.name for p in policy.params] == [p.name for p in rules.params]


def test_hours_are_ranges_that_may_pass_midnight():
    assert within_hours("22:00-08:00", at(23, 30)) and within_hours("22:00-08:00", at(7, 59))
    assert not within_hours("22:00-08:00", at(8)) and not within_hours("22:00-08:00", at(12))
    assert within_hours("09:00-17:00", at(9)) and not within_hours("09:00-17:00", at(17))
    assert within_hours("01:00-02:00, 12:00-13:30", at(13, 15))
    for bad in ("25:00-08:00", "22:00", "9-17", "08:00-08:00", ""):
        with pytest.raises(SpecError):
            parse_hours(bad)
    with pytest.raises(SpecError):
        OwnerRules(busy_percent=120)


def test_why_paused_says_what_holds_first():
    quiet = Readings(local_time=at(23))
    assert why_paused(OwnerRules(), quiet) is None
    assert why_paused(OwnerRules(hours="09:00-17:00"), quiet) == "outside hours (09:00-17:00)"
    assert why_paused(OwnerRules(on_battery=True), Readings(local_time=at(23), on_battery=True)) == "on battery"
    assert why_paused(OwnerRules(on_battery=True), Readings(local_time=at(23), on_battery=None)) is None
    busy = Readings(local_time=at(23), others_busy=True, others_percent=87.4)
    assert why_paused(OwnerRules(busy_percent=30), busy) == "owner: other processes use over 30% of the CPU"
    assert why_paused(OwnerRules(), busy) is None  # no threshold: the CPU is not watched
    gpu = Readings(local_time=at(23), gpu_others=[(4242, 2150.0)])
    assert why_paused(OwnerRules(gpu_shared=True), gpu) == "owner: another process uses the GPU (pid 4242, 2.1 GB)"


def test_a_policy_goes_through_json_and_reads_the_settings():
    rule = OwnerRules(hours="22:00-08:00", on_battery=True, busy_percent=30, gpu_shared=True)
    assert OwnerRules.from_json(rule.to_json()) == rule
    assert rule.describe() == ("hours 22:00-08:00, pause on battery, pause while others use > 30% CPU, "
                               "pause while another process uses the GPU")
    from tensorturn import config

    settings = config.Settings.from_env({"TENSORTURN_HOURS": "22:00-08:00", "TENSORTURN_PAUSE_ON_BATTERY": "1",
                                         "TENSORTURN_PAUSE_BUSY_PERCENT": "30", "TENSORTURN_PAUSE_GPU_SHARED": "1"})
    assert OwnerRules.from_settings(settings) == rule
    assert OwnerRules.from_settings(config.Settings()) == OwnerRules()


def test_nvidia_smi_compute_apps_less_this_agents_own():
    text = "1234, 2048\n999, 512\n77, [N/A]\nnot a line\n"
    assert parse_compute_apps(text, own={999}) == [(1234, 2048.0), (77, 0.0)]
    assert parse_compute_apps("", own=set()) == []


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
    first = owners.set("pc@home", "inc1", "paused", "game night", key)
    [mark] = owners.read("pc@home", key).values()
    assert mark == first and mark.value == "game night" and mark.incarnation == "inc1" and mark.seq > 0
    assert owners.read("pc@home", None) == {}  # nothing verifies without a key
    resumed = owners.set("pc@home", "inc1", "paused", None, key)  # resume: a mark saying nothing
    assert resumed.seq > first.seq and owners.read("pc@home", key)["paused"].value is None
    for forged in ("forged", "{}", json.dumps({**json.loads(first.to_json()), "value": "other"})):
        client.hset("tt:owner:pc@home", "paused", forged)  # the Redis password is not the pool key
        assert owners.read("pc@home", key) == {}
    client.hset("tt:owner:laptop@home", "paused", first.to_json())  # another machine's
    assert owners.read("laptop@home", key) == {}
    # numbered upwards of the last mark that verifies and of what the agent's heartbeat says it holds,
    # never of what an unsigned mark claims (a forged number could not hold the owner's word back,
    # but it is not believed either)
    client.hset("tt:owner:pc@home", "paused", json.dumps({**json.loads(first.to_json()), "seq": 10 ** 18}))
    assert owners.set("pc@home", "inc1", "paused", None, key).seq < 10 ** 18
    held = owners.set("pc@home", "inc1", "paused", None, key, held=10 ** 17)  # the broker lost a newer one
    assert held.seq == 10 ** 17 + 1 and owners.set("pc@home", "inc1", "paused", None, key).seq == 10 ** 17 + 2



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
    stopped = threading.Event()

    def beat_on() -> None:  # as a live agent does, however slow each command is on a loaded machine
        while not stopped.wait(0.5):
            hb.beat()

    beating = threading.Thread(target=beat_on, daemon=True)
    beating.start()

    def paused() -> bool:
        mark = owners.read("pc@home", trust.pool_key()).get("paused")
        return mark is not None and mark.value is not None

    out = tt("pause", "pc", "--reason", "game night", env=env)
    assert out.returncode == 0 and "`tensorturn unpause pc` ends it" in out.stdout and paused()
    out = tt("unpause", "pc", env=env)
    assert (out.returncode, out.stdout, out.stderr) == (
        0, "pc@home resumes within a few seconds, unless its rules hold it\n", "")
    assert not paused()

    assert tt("pause", "pc", env=env).returncode == 0 and paused()
    out = tt("resume", "pc", env=env)
    assert out.returncode == 0 and not paused()
    assert out.stderr == "note: `tensorturn resume MACHINE` is now `tensorturn unpause pc`\n"
    assert tt("unpause", "nobody", env=env).stderr.startswith("error: no agent named 'nobody'")
    stopped.set()
    beating.join()


def mark(field: str, value: str | None, seq: int, incarnation: str = "now", worker: str = "pc@home") -> Mark:
    return Mark(worker, field, value, incarnation, seq).signed(trust.pool_key())


def test_the_agent_takes_only_newer_marks_for_this_start_and_keeps_them(tmp_path):
    """Someone with the Redis password deletes a mark, or writes back a signed one they copied
    before: the agent holds the newest it took, for this start of it."""
    memory = MarkMemory("pc@home", "now", trust.pool_key(), tmp_path / "pc.json")
    assert memory.take({"paused": mark("paused", "game night", 10)})
    assert memory.values() == {"paused": "game night"}
    assert not memory.take({}) and memory.values() == {"paused": "game night"}  # deleted on the broker
    assert memory.take({"paused": mark("paused", None, 11)}) and memory.values() == {}  # resumed
    assert not memory.take({"paused": mark("paused", "game night", 10)})  # the copy, written back
    assert not memory.take({"paused": mark("paused", "game night", 12, incarnation="before")})  # another start's
    assert memory.take({"paused": mark("paused", "late game", 12), "policy": mark("policy", "{}", 5)})
    assert memory.values() == {"paused": "late game", "policy": "{}"} and memory.seqs() == {"paused": 12, "policy": 5}


def test_a_restarted_agent_keeps_its_owners_last_word_from_its_disk(tmp_path):
    path = tmp_path / "owner" / "pc.json"
    before = MarkMemory("pc@home", "before", trust.pool_key(), path)
    before.take({"paused": mark("paused", "game night", 10, "before")})
    before.take({"paused": mark("paused", None, 11, "before")})
    after = MarkMemory("pc@home", "now", trust.pool_key(), path)
    assert after.values() == {} and after.seqs() == {"paused": 11}
    assert not after.take({"paused": mark("paused", "game night", 10, "before")})  # an old copy
    assert after.take({"paused": mark("paused", "signed as it restarted", 12, "before")})
    again = MarkMemory("pc@home", "later", trust.pool_key(), path)  # the pause outlives a restart
    assert again.values() == {"paused": "signed as it restarted"}
    assert not again.take({"paused": mark("paused", "older", 9, "now")})
    # a file it cannot read, or marks another key signed, or another agent's: nothing from before
    path.write_text(json.dumps({"incarnation": "x", "marks": [mark("paused", "p", 1, worker="other@h").to_json(),
                                                               "not a mark"]}))
    assert MarkMemory("pc@home", "next", trust.pool_key(), path).held == {}
    assert not MarkMemory("pc@home", "x", trust.pool_key(), tmp_path / "none.json").load()
    assert not (tmp_path / "none.json").exists()  # an agent that took no mark keeps no file
    path.write_text("{")
    fresh = MarkMemory("pc@home", "next", trust.pool_key(), path)
    assert fresh.held == {} and not fresh.take({"paused": mark("paused", "p", 99, "x")})


def test_the_owners_memory_is_per_agent_and_pool(tmp_path):
    settings = owner.config.Settings(cache_dir=str(tmp_path / "chunks" / "local1"))
    here = owner.memory_path(settings, "local1@h", "redis://:pw@127.0.0.1:6379/0")
    assert here.parent == tmp_path / "chunks" / "owner" and "pw" not in str(here)
    assert here != owner.memory_path(settings, "local1@h", "redis://127.0.0.1:6380/0")
    assert owner.memory_path(settings, "../x/y", "redis://h/0").parent == here.parent


def test_an_agent_with_bad_hours_or_pool_stops_at_once_in_one_line():
    """Before it connects or imports torch: one line, exit 2, nothing started."""
    from conftest import clean_env, tt

    for flags, says in ((["--hours", "25:00-08:00"], "hours must be HH:MM-HH:MM"),
                        ([], "TENSORTURN_AGENT_POOL must be one of prefork, threads")):
        env = clean_env(TENSORTURN_AGENT_POOL="gevent") if not flags else None
        out = tt("agent", "--broker", "redis://127.0.0.1:1/0", *flags, env=env)
        assert out.returncode == 2 and says in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_the_cpu_watch_reads_the_machine_and_leaves_out_its_own_processes():
    """The real reading (psutil): a process that spins shows in others' share unless it is one
    of the watch's own. Two watches look at the same moments, one counting the spinner as its
    own: they differ by the spinner's share, however busy the rest of the machine is."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        spins = psutil.Process(spinner.pid)
        now = {"t": 0.0}
        others = CpuWatch(processes=lambda: [], clock=lambda: now["t"])
        own = CpuWatch(processes=lambda: [spins], clock=lambda: now["t"])

        def spun() -> float:
            cpu = spins.cpu_times()
            return cpu.user + cpu.system

        def look() -> tuple[float | None, float | None, float, float]:
            now["t"] = time.monotonic()
            return others.sample(), own.sample(), spun(), now["t"]

        _, _, before, started = look()
        wait_for(lambda: spun() - before > 0.3, "the spinner to use some CPU")
        with_it, without_it, after, ended = look()
        share = 100 * (after - before) / ((ended - started) * (psutil.cpu_count() or 1))
        assert with_it is not None and without_it is not None
        assert with_it - without_it == pytest.approx(share, abs=3)
        assert with_it >= share - 3 and share > 0
    finally:
        spinner.kill()
        spinner.wait()
