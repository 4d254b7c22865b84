"""Embedded runs: the quick start trains on every local agent; stopping one stops its pool and says how to resume."""

import json
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from conftest import clean_env, tt


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_an_embedded_run_stops_its_pool_and_says_how_to_resume(tmp_path, sig):
    store = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tensorturn", "run", "--recipe", "digits-mlp", "--local-workers",
         "1", "--rounds", "50", "--sync-every", "3000", "--store", str(store), "--json"],
        env=clean_env(), cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or not (lines[-1].startswith("run ") and lines[-1].rstrip().endswith(" queued")):
            line = proc.stderr.readline()
            assert line, "".join(lines)
            lines.append(line)
        run_id = lines[-1].split()[1]
        pool = psutil.Process(proc.pid).children(recursive=True)
        assert len(pool) >= 2  # redis-server and the agent (with its pool child)
        manifest = store / "runs" / run_id / "manifest.json"
        deadline = time.monotonic() + 180
        while not manifest.exists():  # until the run is queued
            assert proc.poll() is None and time.monotonic() < deadline, "the run was not queued"
            time.sleep(0.05)
        proc.send_signal(sig)
        assert proc.wait(180) == 130  # a hang guard: a stop past TENSORTURN_STOP_LIMIT_S is cut short
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "stopping took more than" not in err, err  # cut short: its stacks show where it hung
    assert f"tensorturn resume {run_id}" in err and "Traceback" not in err
    assert proc.stdout.read() == ""
    _, alive = psutil.wait_procs(pool, timeout=15)
    assert alive == []  # no redis-server or agent outlives the command
    status = tt("status", run_id, "--store", str(store), "--json", cwd=tmp_path)
    assert status.returncode == 0, status.stderr  # cancelled, not failed: status says so
    doc = json.loads(status.stdout)
    assert doc["state"] == "cancelled" and "interrupting" in doc["cancelled"]["by"]
    assert not [a for a in doc["attempts"] if a["outcome"] == "running"]


def test_the_quick_start_trains_on_every_local_agent(tmp_path):
    """The README's quick start (`--local-workers 3`): every agent answers before the run is
    queued (forked from one warm parent on Linux), so each of the three takes work in this
    short run, and the result says how many trained."""
    store = str(tmp_path / "store")
    done = tt("run", "--mode", "fused", "--recipe", "digits-mlp", "--local-workers", "3",
              "--store", store, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run_id = done.stdout.split()[1].rstrip(":")
    agents = sorted(f"local{i}@{socket.gethostname()}" for i in (1, 2, 3))
    assert f"  trained on 3 agents: {', '.join(agents)}" in done.stdout.splitlines()
    doc = json.loads(tt("status", run_id, "--store", store, "--json", cwd=tmp_path).stdout)
    assert sorted({a["worker"] for a in doc["attempts"]}) == doc["agents"] == agents
    logs = sorted(p.name for p in (tmp_path / ".tensorturn" / "logs" / run_id).iterdir())
    assert logs == ["agent-1.log", "agent-2.log", "agent-3.log", "redis.log", "warm-parent.log"]
