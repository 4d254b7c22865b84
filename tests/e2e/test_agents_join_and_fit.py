"""Real agents joining a pool: `up` and `join` with telemetry, the task each shows, and a model too
large for one machine left to the others (or refused when it fits none)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import redis
from conftest import clean_env, queued_messages, run_to_end, tt, tt_json, wait_for

from tensorturn.pool.embedded import free_port, stop_process_group
from tensorturn.state.roster import OFFLINE_AFTER

pytestmark = pytest.mark.long  # minutes of agents: scheduled first (conftest)


HEARTBEAT_S = 3.0  # the default heartbeat (TENSORTURN_HEARTBEAT_S)


def spawn(*args: str, env: dict, cwd) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tensorturn", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True)


@pytest.fixture
def coordinator(tmp_path):
    """`tensorturn up` on a free loopback port; yields (join file, broker URL)."""
    proc = spawn("up", "--port", str(free_port()), "--bind", "127.0.0.1", "--dir",
                 str(tmp_path / "coord"), "--store", str(tmp_path / "store"),
                 env=clean_env(), cwd=tmp_path)
    line = proc.stdout.readline()  # the command to run on each machine, with the join file
    assert line.strip() == "tensorturn agent --join-file join --name NAME", proc.stderr.read()
    join_file = tmp_path / "coord" / "join"
    assert join_file.stat().st_mode & 0o777 == 0o600
    broker = (tmp_path / "coord" / "broker-url").read_text().strip()
    yield str(join_file), broker
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert proc.wait(20) == 0
    stop_process_group(proc, grace=5)


def workers(broker: str) -> dict[str, dict]:
    return {w["name"].split("@")[0]: w
            for w in tt_json("workers", "--broker", broker, "--json")}


def test_up_and_join_connect_two_agents_with_telemetry(coordinator, tmp_path):
    join, broker = coordinator
    password = broker.split(":")[2].split("@")[0]
    # a clean stop waits out the shutdown grace even when idle: 1 s, not the default 5
    agents = [spawn("agent", "--join-file", join, "--name", name,
                    env=clean_env(TENSORTURN_SHUTDOWN_GRACE_S="1"), cwd=tmp_path)
              for name in ("w1", "w2")]
    try:
        seen = wait_for(lambda: (w := workers(broker)) and len(w) == 2 and w, "two workers")
        for name in ("w1", "w2"):
            w = seen[name]
            assert w["state"] == "idle" and w["device"] == "cpu"
            assert w["cpu_count"] == os.cpu_count() and w["memory_total_gb"] > 0
            assert w["last_seen_s"] < OFFLINE_AFTER * HEARTBEAT_S
            for field in ("hostname", "os", "cpu_model", "device_name", "cpu_percent",
                          "memory_used_gb", "task", "samples_per_s", "tasks_done"):
                assert field in w
        # outbound only: no agent process listens on any TCP port
        for proc in agents:
            tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
            # psutil 6 renamed connections() to net_connections(); the index may serve either
            listening = [c for p in tree for c in getattr(p, "net_connections", p.connections)("tcp")
                         if c.status == psutil.CONN_LISTEN]
            assert listening == []
        # the plain Celery tooling sees the agents too
        ping = subprocess.run([sys.executable, "-m", "celery", "-A", "tensorturn.pool.celery_app",
                               "inspect", "ping", "--timeout", "5"], capture_output=True, text=True,
                              env=clean_env(TENSORTURN_BROKER_URL=broker), timeout=60)
        assert ping.returncode == 0 and "w1@" in ping.stdout and "w2@" in ping.stdout
        # a machine drops: it is offline within three heartbeats
        os.killpg(agents[0].pid, signal.SIGKILL)
        wait_for(lambda: workers(broker)["w1"]["state"] == "offline", "w1 offline")
        assert workers(broker)["w2"]["state"] == "idle"
        # secrets stay out of what the agent prints
        stopping = time.time()
        os.killpg(agents[1].pid, signal.SIGTERM)
        out, err = agents[1].communicate(timeout=60)
        assert password not in out + err
        # a clean stop is offline at once and says when; a killed machine says when it was seen
        w = workers(broker)
        assert w["w2"]["state"] == "offline" and w["w2"]["stopped"]
        assert 0 <= w["w2"]["stopped_s"] <= time.time() - stopping
        assert not w["w1"]["stopped"] and w["w1"]["stopped_s"] is None
        shown = tt("workers", "--broker", broker)
        assert shown.returncode == 0, shown.stderr
        header, *rows = shown.stdout.splitlines()
        assert header.split()[:3] == ["NAME", "STATE", "DEV"]
        row = {r.split("@")[0]: r for r in rows}
        assert re.search(r"  stopped \d+[smhd] ago \(clean stop\)$", row["w2"]), row["w2"]
        assert re.search(r"  last seen \d+[sm] ago \(no clean stop\)$", row["w1"]), row["w1"]
    finally:
        for proc in agents:
            stop_process_group(proc, grace=5)


def test_workers_show_the_task_in_progress(pool, tmp_path):
    from tensorturn import runs

    run = spawn("run", "--broker", pool.broker_url, "--recipe", "digits-mlp", "--rounds", "1",
                "--shards", "1", "--sync-every", "6000", "--store", pool.store_url,
                "--detach", "--json", env=clean_env(), cwd=tmp_path)
    try:
        # watched from the moment the CLI starts, and polled in-process (what `workers --json`
        # prints): on a loaded machine the shard can finish before a CLI process has even exited
        busy = wait_for(lambda: [w for w in runs.workers(pool.broker_url)
                                 if w["state"] == "busy" and w["samples_per_s"]], "a busy worker")
    finally:
        out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    assert busy[0]["task"] == "r0/shard-0" and busy[0]["samples_per_s"] > 0
    doc = json.loads(out)
    done = tt_json("status", doc["run_id"], "--broker", pool.broker_url, "--watch", "--json")
    assert done["state"] == "succeeded"


def test_a_model_that_fits_no_worker_is_refused_before_queueing(pool, tmp_path):
    # tests/huge.py: importable by the agents too (conftest puts tests/ on their PYTHONPATH)
    proc = tt("run", "--broker", pool.broker_url, "--recipe", "huge:Huge", "--store", pool.store_url)
    assert proc.returncode == 2, proc.stderr
    assert "the model needs about" in proc.stderr and "largest connected worker" in proc.stderr
    assert "local" in proc.stderr and "Traceback" not in proc.stderr
    r = redis.Redis.from_url(pool.broker_url)
    assert r.zcard("tt:runs") == 0 or b"huge:Huge" not in b"".join(
        r.hget(f"tt:run:{i.decode()}", "spec") or b"" for i in r.zrange("tt:runs", 0, -1))
    assert queued_messages(r) == []


def test_a_worker_too_small_for_the_model_leaves_its_tasks_to_others(pool_factory, monkeypatch):
    pool = pool_factory(1)
    monkeypatch.setenv("TENSORTURN_DEVICE_MEMORY_GB", "0.0001")  # local2 offers almost no memory
    pool.start_agent(1)
    pool.wait_ready()
    doc = run_to_end(pool, mode="fused", recipe="digits-mlp", rounds=2, shards=4, sync_every=20)
    assert doc["state"] == "succeeded"
    assert {a["worker"].split("@")[0] for a in doc["attempts"]} == {"local1"}


def test_an_agent_log_gives_no_advice_for_options_it_does_not_have(pool):
    """Celery advises a worker started as root to use its `--uid` option, which `tensorturn
    agent` has not: an agent's log says instead, in one line, that it runs as root."""
    for log in pool.logs:
        text = log.read_text(errors="replace")
        assert "--uid" not in text and "SecurityWarning" not in text
        assert ("this agent runs as root" in text) == (os.geteuid() == 0)
