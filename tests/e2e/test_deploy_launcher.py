"""The agent launcher script starts a real agent."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT

from tensorturn.pool.embedded import stop_process_group

LAUNCHER = ROOT / "workers" / "tensorturn-agent.sh"


def test_launcher_starts_a_real_agent(redis_server, tmp_path):
    """With a broker URL, the launcher execs a real agent under the given name, which joins the pool."""
    from celery import Celery

    env = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.defpath}", "HOME": str(tmp_path),
           "TENSORTURN_BROKER_URL": redis_server.url, "TENSORTURN_STORE_URL": (tmp_path / "store").as_uri(),
           "TENSORTURN_POOL_KEY": os.environ["TENSORTURN_POOL_KEY"],
           "TENSORTURN_SHUTDOWN_GRACE_S": "1"}  # its warm shutdown: 1 s, not 5
    log = open(tmp_path / "agent.log", "wb")
    proc = subprocess.Popen([str(LAUNCHER), "launcher-test"], env=env, cwd=tmp_path, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    probe = Celery("probe", broker=redis_server.url)  # not the project's app: no global state changes
    try:
        names: list[str] = []
        deadline = time.monotonic() + 180  # an agent's start (torch, Celery) is slow under load
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "agent.log").read_text()[-2000:]
            names = [n for reply in probe.control.ping(timeout=1) or [] for n in reply]
            if names:
                break
        assert [n.split("@")[0] for n in names] == ["launcher-test"], \
            f"{names}\n{(tmp_path / 'agent.log').read_text()[-2000:]}"
    finally:
        probe.close()
        stop_process_group(proc, grace=30)
        log.close()
    assert proc.returncode == 0, "warm shutdown on SIGTERM: " + (tmp_path / "agent.log").read_text()[-2000:]
