"""A started agent shows no part of a nasty password."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import clean_env, wait_for

from tensorturn.pool.embedded import RedisServer, stop_process_group
from tensorturn.state.broker import redis_client


def pieces(secret: str) -> list[str]:
    """The parts of ``secret`` between its punctuation: none may show after masking."""
    return [p for p in re.split(r"[^A-Za-z0-9]+", secret) if p]



def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def group_cmdlines(pgid: int) -> dict[int, str]:
    """Every process of the process group ``pgid`` (an agent and its pool children)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    out[int(entry.name)] = cmdline(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def test_a_started_agent_shows_no_part_of_a_nasty_password(tmp_path):
    """A Redis password holding `@` and `:`, given on the agent's command line (what not to do):
    once the agent is up, neither its command line, its pool child's, nor anything it printed
    shows any part of it. (Celery refuses ``?password=`` in a broker URL, so that form never
    gets this far; its masking is checked above.)"""
    password = "Sx1@Tail9:Uu2"
    server = RedisServer(tmp_path / "redis", password=password).start()
    url = f"redis://default:{password}@127.0.0.1:{server.port}/0"
    agent = subprocess.Popen([sys.executable, "-m", "tensorturn", "agent", "--broker", url, "--store",
                              str(tmp_path / "store"), "--name", "careless"],
                             env=clean_env(TENSORTURN_SHUTDOWN_GRACE_S="1"),  # its stop: 1 s, not 5
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             text=True, start_new_session=True)
    try:
        r = redis_client(url)

        def ready() -> bool:  # the agent heartbeats and has forked its pool child (exiting is an error)
            assert agent.poll() is None, agent.stdout.read()
            return bool(list(r.scan_iter("tt:worker:careless@*"))) and len(group_cmdlines(agent.pid)) >= 2

        wait_for(ready, "the agent and its pool child", timeout=240)
        lines = group_cmdlines(agent.pid)
        assert f"--broker redis://default:***@127.0.0.1:{server.port}/0" in lines[agent.pid]
        assert {pid: line for pid, line in lines.items() if any(s in line for s in pieces(password))} == {}
    finally:
        stop_process_group(agent, grace=10)
        server.stop()
    out = agent.stdout.read()
    assert not [s for s in pieces(password) if s in out], out[-3000:]
