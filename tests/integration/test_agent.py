"""Connecting machines: `tensorturn up`, `agent --join`, live telemetry, honest memory limits."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import redis
from conftest import clean_env, tt

from tensorturn.pool.embedded import free_port, stop_process_group


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


def test_up_on_a_port_another_redis_holds_is_one_line_and_starts_nothing(redis_server, tmp_path):
    """The machine's own Redis on `up`'s port (6379 by default): one line naming the port, no
    banner, no join file written, and the one an earlier `up` wrote left as it was."""
    coord = tmp_path / "coord"
    coord.mkdir()
    (coord / "join").write_text("tt1.earlier\n")
    # every interface (`up`'s default) against a Redis on loopback, as with the machine's own
    proc = tt("up", "--port", str(redis_server.port), "--dir", str(coord), "--store",
              str(tmp_path / "store"), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"error: port {redis_server.port} is already in use by another Redis: stop it, or start "
        f"the coordinator on another port with --port PORT"]
    assert (coord / "join").read_text() == "tt1.earlier\n"
    assert not (coord / "broker-url").exists()
    assert redis.Redis.from_url(redis_server.url).ping()  # the other Redis is untouched


def test_up_on_a_port_another_program_holds_is_one_line_and_starts_nothing(tmp_path):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        proc = tt("up", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path / "coord"),
                  "--store", str(tmp_path / "store"), cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"error: port {port} is already in use by another program: stop it, or start the "
        f"coordinator on another port with --port PORT"]
    assert not (tmp_path / "coord" / "join").exists()
    assert not (tmp_path / "coord" / "broker-url").exists()


def test_workers_have_a_header_and_say_when_a_machine_stopped(redis_server):
    """The roster from heartbeats as the agents write them: a clean stop (``stopped_at``, what
    the Heartbeat bootstep writes on stop), a silent one, and one silent for longer than
    TENSORTURN_AGENT_TTL_S (a day), which is forgotten."""
    from tensorturn.layout import worker_key
    from tensorturn.state.roster import list_workers

    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    now = time.time()
    inventory = json.dumps({"device": "cpu", "device_name": "Test CPU", "cpu_count": 2,
                            "device_memory_gb": 4.0, "role": "train"})
    beats = {"stopped@h": {"last_seen": now - 3 * 3600 - 5, "stopped_at": now - 3 * 3600},
             "silent@h": {"last_seen": now - 2 * 3600},
             "gone@h": {"last_seen": now - 2 * 86400}}
    for name, fields in beats.items():
        r.hset(worker_key(name), mapping={"name": name, "inventory": inventory, **fields})
    w = {x["name"]: x for x in list_workers(r, now=now, heartbeat_s=3.0)}
    assert {x["state"] for x in w.values()} == {"offline"}
    assert w["stopped@h"]["stopped"] and w["stopped@h"]["stopped_s"] == 3 * 3600
    assert not w["silent@h"]["stopped"] and w["silent@h"]["last_seen_s"] == 2 * 3600
    shown = tt("workers", "--broker", redis_server.url)
    assert shown.returncode == 0, shown.stderr
    header, *rows = shown.stdout.splitlines()
    assert header.split() == ["NAME", "STATE", "DEV", "DEVICE", "CPUS", "MEMORY", "DONE", "DETAIL"]
    row = {line.split()[0]: line for line in rows}
    assert row["stopped@h"].endswith("  stopped 3h ago (clean stop)")
    assert row["silent@h"].endswith("  last seen 2h ago (no clean stop)")
    assert "gone@h" not in row  # silent for two days: forgotten
    assert all(line.split()[1:4] == ["offline", "cpu", "Test"] for line in rows)


def test_an_agent_describes_its_gpu_without_starting_cuda(tmp_path, monkeypatch):
    """An agent's main process forks the processes that run its tasks, and a process forked
    after CUDA started cannot use the GPU (every task failed so on an H200): the inventory and
    the live figures ask the driver's ``nvidia-smi``, never torch.cuda. Here a fake one answers
    on a machine without a GPU."""
    import torch

    from tensorturn import config
    from tensorturn.pool import telemetry

    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\ncase \"$1\" in\n"
                    "  --query-gpu=name,memory.total,count) echo 'Fake GPU 24G, 24576, 2' ;;\n"
                    "  *) echo '1536, 37' ;;\nesac\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("TENSORTURN_DEVICE", "cuda")
    config.reload()
    telemetry.inventory.cache_clear()
    try:
        inv = telemetry.inventory()
        described = (inv["device"], inv["device_name"], inv["vram_gb"], inv["gpu_count"])
        assert described == ("cuda", "Fake GPU 24G", 24.0, 2)
        assert inv["device_memory_gb"] == 24.0
        live = telemetry.live_figures()
        assert (live["gpu_memory_used_gb"], live["gpu_util_percent"]) == (1.5, 37.0)
        assert not torch.cuda.is_initialized()
    finally:
        telemetry.inventory.cache_clear()


def start_up(tmp_path, port: int) -> subprocess.Popen:
    """`tensorturn up` in ``tmp_path`` with TENSORTURN_JOIN_FILE exported as the README says."""
    return subprocess.Popen(
        [sys.executable, "-m", "tensorturn", "up", "--port", str(port), "--bind", "127.0.0.1",
         "--store", str(tmp_path / "store")],
        env=clean_env(TENSORTURN_JOIN_FILE=".tensorturn/join"), cwd=tmp_path, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
        start_new_session=True)


def test_up_works_with_the_join_file_exported_before_and_after_it_exists(tmp_path):
    port = free_port()
    for start in ("first", "again"):  # no join file yet; then the one the first `up` wrote
        proc = start_up(tmp_path, port)
        try:
            line = proc.stdout.readline()  # the banner's command for each machine
            assert line.strip() == "tensorturn agent --join-file join --name NAME", (
                start, proc.stderr.read() if proc.poll() is not None else "")
            assert (tmp_path / ".tensorturn" / "join").read_text().startswith("tt1.")
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 0
        finally:
            stop_process_group(proc, grace=5)
