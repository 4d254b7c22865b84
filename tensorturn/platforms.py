"""What differs between Linux, macOS and Windows, in one place, each branch small and taking the
platform as an argument (tests fake it: CI runs on Linux).

* the agent's pool: prefork on Linux; threads on Windows (no fork) and macOS (a process forked
  after torch loaded Apple's frameworks is unsafe) — :mod:`tensorturn.pool.threads`;
* where a machine caches dataset chunks: each system's user cache folder;
* starting a process as a group of its own, and killing or waking that group (the embedded
  pool's agents: POSIX process groups and signals; on Windows a new process group and psutil);
* Ctrl-Break, Windows' other stop key, stops an agent as Ctrl-C does.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import psutil

CREATE_NEW_PROCESS_GROUP = 0x00000200  # subprocess's, which exists only on Windows


class Process(Protocol):
    """A process as the embedded pool handles it: a :class:`subprocess.Popen`, or an agent
    another process forked (:class:`tensorturn.pool.warm.ForkedAgent`)."""

    pid: int

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def is_windows(platform: str = sys.platform) -> bool:
    return platform == "win32"


def default_pool(platform: str = sys.platform) -> str:
    """The pool an agent uses unless told: prefork where forking a process that loaded torch
    is safe (Linux), threads elsewhere (Windows cannot fork; macOS must not, with MPS)."""
    return "prefork" if platform.startswith("linux") else "threads"


def cache_dir(platform: str = sys.platform, environ: Mapping[str, str] | None = None,
              home: Path | None = None) -> Path:
    """This user's folder for TensorTurn's chunk cache: ``%LOCALAPPDATA%\\tensorturn\\cache`` on
    Windows, ``~/Library/Caches/tensorturn`` on macOS, ``$XDG_CACHE_HOME/tensorturn`` (or
    ``~/.cache/tensorturn``) elsewhere; chunks go in its ``chunks`` folder."""
    environ = os.environ if environ is None else environ
    home = Path.home() if home is None else home
    if is_windows(platform):
        base = Path(environ["LOCALAPPDATA"]) if environ.get("LOCALAPPDATA") else home / "AppData" / "Local"
        return base / "tensorturn" / "cache" / "chunks"
    if platform == "darwin":
        return home / "Library" / "Caches" / "tensorturn" / "chunks"
    base = Path(environ["XDG_CACHE_HOME"]) if environ.get("XDG_CACHE_HOME") else home / ".cache"
    return base / "tensorturn" / "chunks"


def new_group(platform: str = sys.platform) -> dict[str, Any]:
    """``subprocess.Popen`` arguments that start a process as a group of its own (its children
    are stopped with it, and a Ctrl-C at this terminal does not reach it)."""
    if is_windows(platform):
        return {"creationflags": CREATE_NEW_PROCESS_GROUP}
    return {"start_new_session": True}


def kill_group(proc: Process, platform: str = sys.platform) -> None:
    """Kill ``proc`` and every process it started, at once."""
    if is_windows(platform):
        try:
            tree = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            tree = []
        for p in [*tree, proc]:
            try:
                p.kill()
            except (psutil.Error, OSError):
                pass
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def wake_group(proc: Process, platform: str = sys.platform) -> None:
    """Continue a stopped process group (SIGCONT: a stopped agent cannot shut down). Windows
    has no stopped processes of this kind: nothing to do."""
    if is_windows(platform):
        return
    try:
        os.killpg(proc.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (``os.kill(pid, 0)`` would send Ctrl-C on Windows)."""
    return psutil.pid_exists(pid)


def cold_stop(signals: Any = signal) -> dict[str, str]:
    """The environment that makes SIGTERM Celery's *cold* shutdown (its running task back in the
    queue after a short grace, rather than waited for): billiard reads ``REMAP_SIGTERM`` when
    first imported, and fails to import where the signal it names does not exist (Windows has
    no SIGQUIT: there Ctrl-C and Ctrl-Break are the stops, and they are cold already)."""
    return {"REMAP_SIGTERM": "SIGQUIT"} if hasattr(signals, "SIGQUIT") else {}


def stop_on_break(signals: Any = signal) -> bool:
    """Where there is Ctrl-Break (Windows' SIGBREAK), make it do what Ctrl-C does now (the
    agent's handler: its running task goes back to the queue). Whether there was one."""
    if not hasattr(signals, "SIGBREAK"):
        return False
    signals.signal(signals.SIGBREAK, signals.getsignal(signals.SIGINT))
    return True


def forks_warm(platform: str = sys.platform) -> bool:
    """Whether an embedded pool forks its agents from one parent that imported torch (where
    forking a process that loaded torch is safe: Linux, as for the agent's pool)."""
    return default_pool(platform) == "prefork"
