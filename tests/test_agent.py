"""Connecting machines: `tensorturn up`, `agent --join`, live telemetry, honest memory limits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
import redis
from conftest import clean_env, queued_messages, tt, tt_json, wait_for

from tensorturn.local import free_port, stop_process_group
from tensorturn.roster import OFFLINE_AFTER

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


@pytest.mark.e2e
def test_up_and_join_connect_two_agents_with_telemetry(coordinator, tmp_path):
    join, broker = coordinator
    password = broker.split(":")[2].split("@")[0]
    agents = [spawn("agent", "--join-file", join, "--name", name, env=clean_env(), cwd=tmp_path)
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
            listening = [c for p in tree for c in p.net_connections("tcp")
                         if c.status == psutil.CONN_LISTEN]
            assert listening == []
        # the plain Celery tooling sees the agents too
        ping = subprocess.run([sys.executable, "-m", "celery", "-A", "tensorturn.celery_app",
                               "inspect", "ping", "--timeout", "5"], capture_output=True, text=True,
                              env=clean_env(TENSORTURN_BROKER_URL=broker), timeout=60)
        assert ping.returncode == 0 and "w1@" in ping.stdout and "w2@" in ping.stdout
        # a machine drops: it is offline within three heartbeats
        os.killpg(agents[0].pid, signal.SIGKILL)
        wait_for(lambda: workers(broker)["w1"]["state"] == "offline", "w1 offline")
        assert workers(broker)["w2"]["state"] == "idle"
        # secrets stay out of what the agent prints
        os.killpg(agents[1].pid, signal.SIGTERM)
        out, err = agents[1].communicate(timeout=60)
        assert password not in out + err
    finally:
        for proc in agents:
            stop_process_group(proc, grace=5)


@pytest.mark.e2e
def test_workers_show_the_task_in_progress(pool, tmp_path):
    from tensorturn import client

    run = spawn("run", "--broker", pool.broker_url, "--recipe", "digits-mlp", "--rounds", "1",
                "--shards", "1", "--sync-every", "6000", "--store", pool.store_url,
                "--detach", "--json", env=clean_env(), cwd=tmp_path)
    try:
        # watched from the moment the CLI starts, and polled in-process (what `workers --json`
        # prints): on a loaded machine the shard can finish before a CLI process has even exited
        busy = wait_for(lambda: [w for w in client.workers(pool.broker_url)
                                 if w["state"] == "busy" and w["samples_per_s"]], "a busy worker")
    finally:
        out, err = run.communicate(timeout=300)
    assert run.returncode == 0, err[-3000:]
    assert busy[0]["task"] == "r0/shard-0" and busy[0]["samples_per_s"] > 0
    doc = json.loads(out)
    done = tt_json("status", doc["run_id"], "--broker", pool.broker_url, "--watch", "--json")
    assert done["state"] == "succeeded"


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_a_worker_too_small_for_the_model_leaves_its_tasks_to_others(tmp_path, monkeypatch):
    from tensorturn import client
    from tensorturn.local import LocalPool
    from tensorturn.spec import RunSpec

    store = (tmp_path / "store").as_uri()
    with LocalPool(2, store, workdir=tmp_path / "pool") as pool:
        stop_process_group(pool.agents[1])  # restart local2 offering almost no memory
        monkeypatch.setenv("TENSORTURN_DEVICE_MEMORY_GB", "0.0001")
        pool.start_agent(1)
        pool.wait_ready()
        spec = RunSpec.create(mode="fused", recipe="digits-mlp", store_url=store, rounds=2, shards=4,
                       sync_every=20)
        client.submit(spec, pool.broker_url)
        doc = client.wait(pool.broker_url, spec.run_id, timeout_s=300)
    assert doc["state"] == "succeeded"
    assert {a["worker"].split("@")[0] for a in doc["attempts"]} == {"local1"}


def test_a_damaged_join_string_is_one_clear_error(tmp_path):
    (tmp_path / "join").write_text("tt1.not-base64!!\n")
    proc = tt("agent", "--join-file", "join", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: invalid join string: it is damaged or incomplete "
                                   "(copy the whole line `tensorturn up` printed)")
    proc = tt("agent", cwd=tmp_path)
    assert proc.returncode == 2 and "--join" in proc.stderr
    proc = tt("agent", "--join-file", "nowhere", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: cannot read the join file nowhere: No such file or directory"


def test_an_agent_without_the_pool_key_is_one_clear_error(redis_server, tmp_path):
    env = clean_env(TENSORTURN_BROKER_URL=redis_server.url)
    env.pop("TENSORTURN_POOL_KEY")
    proc = tt("agent", env=env, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: no pool key: pass --join-file JOIN")
    assert redis_server.password not in proc.stderr
