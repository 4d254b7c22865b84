"""The warm parent: an embedded pool's agents forked from one process that imported what they need.

An agent's start is seconds of imports (torch, torch's dynamo, the recipes' data libraries) on one
core. Started as N processes, N agents pay them N times on the machine's cores, and on a
2-core machine the others came up after the quick start's run had ended (every attempt on
``local1``). The warm parent pays them once, then forks the agents, which start in a fraction
of a second each: all of them answer before the run is queued (:class:`~.embedded.LocalPool`).

Only where forking a process that loaded torch is safe (Linux: :func:`tensorturn.platforms.forks_warm`);
elsewhere each agent is a process of its own, as before.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import psutil

from tensorturn import platforms
from tensorturn.errors import TensorTurnError

# what an agent imports between its command and its first task, beyond torch and the recipes:
# Celery's command line (with its plugins: Flower's app), its worker, its pool and remote control
# — 0.7 s of a forked agent's 1.1 s start when the parent had not imported them (cProfile)
WORKER_MODULES = ("celery.bin.celery", "celery.apps.worker", "celery.worker.worker",
                  "celery.worker.consumer", "celery.worker.components", "celery.concurrency.prefork",
                  "celery.concurrency.asynpool", "celery.events.state", "celery.app.control",
                  "kombu.pidbox", "tensorturn.pool.celery_app", "tensorturn.pool.transport")


def warm_up() -> None:
    """Import what every agent imports before it takes work: torch and the recipes
    (:func:`tensorturn.recipes.warm_up`), Celery's worker and the app (:data:`WORKER_MODULES`);
    find where the process title lives (setproctitle).
    Before that, what billiard reads when first imported (:func:`tensorturn.platforms.cold_stop`).
    Then freeze what is loaded out of the garbage collector's sight: each agent's pool runs a
    full collection before it forks (0.2 s over every object torch made), and the forks share
    the pages the collector would otherwise write to."""
    for variable, value in platforms.cold_stop().items():
        os.environ.setdefault(variable, value)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # as run_agent: no CUDA before a fork
    from tensorturn.recipes import warm_up as import_recipes

    import_recipes()
    for module in WORKER_MODULES:
        importlib.import_module(module)
    # setproctitle finds the title's memory on first use, beside the environment's: an agent
    # replaces its environment (tensorturn.cli.run_in) before Celery titles it, and then its
    # title stayed the parent's command line — found now, each agent and its pool processes
    # show in `ps` as Celery names them
    import setproctitle

    setproctitle.getproctitle()
    gc.freeze()


# how long a forked agent that ended waits, at most, for the warm parent to collect its exit
REAP_S = 0.5


def fork_agents(requests: int, run: Callable[[dict[str, Any]], int], pids: IO[str]) -> int:
    """Fork one agent per spec (``{"log": path, ...}``) of each line read from the file
    descriptor ``requests`` (a JSON list of specs a line: the pool's agents, then each it starts
    again), as each line arrives, until ``requests`` closes; then wait for every agent. Each
    agent is a session of its own (the pool stops it as a process group), its stdout and stderr
    appended to its log, ``run(spec)`` its life and exit status. Each child's pid is written to
    ``pids`` as a JSON line as soon as it is forked; one that ends meanwhile is reaped within
    :data:`REAP_S`. 0, or 1 when one ended with an error."""
    children: set[int] = set()
    worst, read, more = 0, b"", b"open"
    while more:
        if select.select([requests], [], [], REAP_S)[0]:
            more = os.read(requests, 65536)
            *lines, read = (read + more).split(b"\n")
            if not more:  # closed: an unterminated last line counts too
                lines.append(read)
            for line in filter(bytes.strip, lines):
                for spec in json.loads(line):
                    pid = _fork(spec, run)
                    children.add(pid)
                    pids.write(json.dumps({"pid": pid}) + "\n")
                    pids.flush()
        worst = max(worst, _reap(children, block=False))
    return max(worst, _reap(children, block=True))


def _fork(spec: dict[str, Any], run: Callable[[dict[str, Any]], int]) -> int:
    """Fork the agent ``spec`` describes (:func:`fork_agents`); its pid."""
    pid = os.fork()
    if pid:
        return pid
    code = 1  # the agent: never returns into the parent's code
    try:
        os.setsid()
        log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((null, 0), (log, 1), (log, 2)):
            os.dup2(fd, target)
        os.close(log)
        os.close(null)
        code = run(spec)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - shown in the agent's log, then the child ends
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _reap(children: set[int], block: bool) -> int:
    """Collect the exit of each of ``children`` that has ended (``block``: of all of them,
    waiting), taking it out of the set; 1 when one ended with an error, else 0."""
    worst = 0
    while children:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:  # none left
            children.clear()
            break
        if pid == 0:
            break
        if pid in children:
            children.discard(pid)
            worst = worst or int(os.waitstatus_to_exitcode(status) != 0)
    return worst


class ForkedAgent:
    """An agent the warm parent forked, as :class:`subprocess.Popen` shows a process to the pool
    that started it (``pid``, ``poll``, ``wait``, ``terminate``, ``kill``). It is the parent's
    child, not ours, so it is watched through a pidfd (its exit, and no other process that
    later gets its pid); its exit status is the parent's to collect: ``returncode`` is -1 once
    it ended."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None
        self.args = ["agent", str(pid)]
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # ended before it was watched
            self._fd, self.returncode = None, -1

    def poll(self) -> int | None:
        if self.returncode is None and self._fd is not None:
            if select.select([self._fd], [], [], 0)[0]:
                self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and self._fd is not None:
            if not select.select([self._fd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._ended()
        return self.returncode if self.returncode is not None else -1

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _ended(self) -> None:
        self.returncode = -1
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)  # type: ignore[arg-type]


def start_parent(environ: dict[str, str], log: Path) -> subprocess.Popen:
    """Start the warm parent (``tensorturn local-agents``, a session of its own, logging to
    ``log``): it imports at once and forks the agents :func:`hand_over` gives it."""
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, "-P", "-m", "tensorturn", "local-agents"],
                                env=environ, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=out, **platforms.new_group())


def hand_over(parent: subprocess.Popen, specs: list[dict[str, Any]], log: Path,
              timeout: float) -> Iterator[ForkedAgent]:
    """Give the warm parent agents to fork (``specs``, secrets included: a pipe, never argv) —
    the pool's, or later one it starts again — and yield each as it is forked (so a pool
    interrupted meanwhile stops those it has); TensorTurnError, with the end of its log, when
    it ends first or takes longer than ``timeout``. The pipe stays open for the next agents
    (:func:`stop_parent` closes it)."""
    assert parent.stdin is not None and parent.stdout is not None
    try:
        parent.stdin.write(json.dumps(specs).encode() + b"\n")
        parent.stdin.flush()
    except BrokenPipeError:
        pass  # it ended: said below
    # read from the pipe itself: a buffered readline would take every line that has arrived
    # (on a loaded machine, all the pids at once) and the next select would wait for none
    pipe, read = parent.stdout.fileno(), b""
    deadline = time.monotonic() + timeout
    for _ in specs:
        while b"\n" not in read:
            ready = select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))[0]
            more = os.read(pipe, 4096) if ready else b""
            if not more:
                stop_parent(parent)
                tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                raise TensorTurnError("the local agents' warm parent "
                                      + ("ended" if ready else f"did not fork them within {timeout:.0f}s")
                                      + (": " + " | ".join(tail) if tail else ""))
            read += more
        line, read = read.split(b"\n", 1)
        yield ForkedAgent(json.loads(line)["pid"])


def stop_parent(parent: subprocess.Popen) -> None:
    """Kill the warm parent and the agents it forked (each a session of its own, which the
    parent's group does not reach): those the pool has not been told of must not outlive it."""
    try:
        forked = [child.pid for child in psutil.Process(parent.pid).children()]
    except psutil.Error:
        forked = []
    for pid in forked:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    platforms.kill_group(parent)
    parent.wait()
    for pipe in (parent.stdin, parent.stdout):
        try:
            if pipe is not None:
                pipe.close()
        except BrokenPipeError:  # what was left to write goes with it
            pass
