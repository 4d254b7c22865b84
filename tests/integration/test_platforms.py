"""The platform-specific branches (tensorturn.platforms), each with the platform faked: CI runs
on Linux, the agents also on Windows and macOS."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tensorturn import platforms


def test_the_pool_forks_only_on_linux():
    assert platforms.default_pool("linux") == "prefork"
    assert platforms.default_pool("win32") == "threads"
    assert platforms.default_pool("darwin") == "threads"


def test_the_chunk_cache_lives_in_each_systems_user_cache_folder():
    home = Path("/home/ann")
    assert platforms.cache_dir("linux", {}, home) == home / ".cache" / "tensorturn" / "chunks"
    assert platforms.cache_dir("linux", {"XDG_CACHE_HOME": "/tmp/xdg"}, home) == Path("/tmp/xdg/tensorturn/chunks")
    assert platforms.cache_dir("darwin", {}, home) == home / "Library" / "Caches" / "tensorturn" / "chunks"
    assert platforms.cache_dir("win32", {"LOCALAPPDATA": "/c/Users/ann/AppData/Local"}, home) == \
        Path("/c/Users/ann/AppData/Local/tensorturn/cache/chunks")
    assert platforms.cache_dir("win32", {}, home) == home / "AppData" / "Local" / "tensorturn" / "cache" / "chunks"


def test_a_process_group_of_its_own():
    assert platforms.new_group("linux") == {"start_new_session": True}
    assert platforms.new_group("darwin") == {"start_new_session": True}
    assert platforms.new_group("win32") == {"creationflags": 0x200}  # CREATE_NEW_PROCESS_GROUP


def test_killing_a_group_kills_its_children_on_every_platform():
    """POSIX kills the process group; the Windows branch walks the tree with psutil — both
    run here on real processes (a parent that started a child)."""
    import psutil

    for platform in ("linux", "win32"):
        # a parent and its child, each waiting for a signal until killed
        proc = subprocess.Popen([sys.executable, "-c", "import signal, subprocess, sys; "
                                 "subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()']); "
                                 "print('up', flush=True); signal.pause()"],
                                stdout=subprocess.PIPE, text=True, **platforms.new_group("linux"))
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children
        platforms.kill_group(proc, platform)
        proc.wait(timeout=30)
        psutil.wait_procs(children, timeout=30)
        assert not any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE for c in children)


def test_waking_a_group_is_a_no_op_on_windows(monkeypatch):
    sent = []
    monkeypatch.setattr(platforms.os, "killpg", lambda pid, sig: sent.append((pid, sig)), raising=False)
    platforms.wake_group(SimpleNamespace(pid=123), "win32")
    assert sent == []
    platforms.wake_group(SimpleNamespace(pid=123), "linux")
    assert sent == [(123, signal.SIGCONT)]


def test_ctrl_break_stops_an_agent_as_ctrl_c_does():
    handlers = {"SIGINT": "the agent's handler"}
    fake = SimpleNamespace(SIGINT="SIGINT", SIGBREAK="SIGBREAK",
                           getsignal=lambda s: handlers[s], signal=lambda s, h: handlers.__setitem__(s, h))
    assert platforms.stop_on_break(fake) is True
    assert handlers["SIGBREAK"] == "the agent's handler"
    assert platforms.stop_on_break(SimpleNamespace(SIGINT="SIGINT")) is False  # POSIX: no Ctrl-Break


def test_sigterm_is_a_cold_stop_only_where_there_is_sigquit():
    assert platforms.cold_stop(SimpleNamespace(SIGQUIT=3)) == {"REMAP_SIGTERM": "SIGQUIT"}
    assert platforms.cold_stop(SimpleNamespace()) == {}  # Windows: billiard would fail to import


def test_a_process_is_alive_without_signalling_it():
    import os

    assert platforms.pid_alive(os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert not platforms.pid_alive(proc.pid)


@pytest.mark.parametrize("platform", ["win32", "darwin", "linux"])
def test_an_agent_picks_its_pool_by_platform_unless_told(platform, monkeypatch):
    from tensorturn import config
    from tensorturn.errors import SpecError
    from tensorturn.pool import threads

    monkeypatch.setattr(threads.sys, "platform", platform)
    assert threads.pool_of(config.Settings()) == platforms.default_pool(platform)
    assert threads.pool_of(config.Settings(agent_pool="threads")) == "threads"
    with pytest.raises(SpecError, match="TENSORTURN_AGENT_POOL must be one of prefork, threads"):
        threads.pool_of(config.Settings(agent_pool="gevent"))
