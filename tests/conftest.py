"""Shared fixtures: real redis-server processes, real agents, a real S3 HTTP endpoint (moto)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorturn.pool.embedded import LocalPool, RedisServer, stop_process_group
from testbed.netlab import start_moto

ROOT = Path(__file__).resolve().parent.parent
# The test recipes (tests/failing.py, tests/huge.py) import in every process the tests start,
# agents included, as a user's recipe must on every machine of a pool.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")) if p)
# One pool key for the whole session, in this process and every process the tests start
# (a test of what happens without it takes it away). Agents would refuse unsigned work.
TEST_POOL_KEY = "ttk1.dGVzdHMgb25seTogbm90IGEgc2VjcmV0IGtleSEhISE"
os.environ["TENSORTURN_POOL_KEY"] = TEST_POOL_KEY
# The test recipes, allowed on the pools the tests start themselves (a run's own CLI allows the
# recipe it names on its embedded pool; a test of an unallowed recipe names another module).
os.environ["TENSORTURN_ALLOW_RECIPES"] = ",".join(
    f"{m}:*" for m in ("failing", "huge", "crasher", "nan_once", "myrecipe", "flaky_recipe", "badinit", "gated"))


@pytest.fixture(autouse=True)
def _settings_per_test():
    """Settings a test changed in this process (config.use) end with it."""
    from tensorturn import config

    yield
    config.reload()


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a CLI subprocess: no pool or store inherited from the developer's."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TENSORTURN_", "AWS_"))}
    env["TENSORTURN_POOL_KEY"] = TEST_POOL_KEY
    env.update(extra)
    return env


def wait_for(predicate, what: str, timeout: float = 180, pause: float = 0.1):
    """Poll ``predicate`` (state: Redis, a process, an HTTP probe) until it is truthy; the
    deadline only bounds a hang and is generous, for a loaded machine."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(pause)


def tt(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
       timeout: float = 900) -> subprocess.CompletedProcess:
    """Run the ``tensorturn`` CLI as a user would, in a subprocess, with no stdin.

    ``timeout`` only guards against a hang: an embedded multi-round run on a loaded machine can
    take several minutes."""
    return subprocess.run([sys.executable, "-m", "tensorturn", *args], env=env or clean_env(),
                          cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def tt_here(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The ``tensorturn`` CLI in this process (click's test runner), answered as :func:`tt`
    answers: for commands that load torch and start nothing, where a subprocess would pay the
    import again (seconds each). ``env`` replaces the environment while it runs."""
    from click.testing import CliRunner

    from tensorturn import config
    from tensorturn.cli import cli

    env = env or clean_env()  # of this environment, before it is cleared
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    config.reload()
    try:
        result = CliRunner().invoke(cli, list(args), prog_name="tensorturn")
    finally:
        os.environ.clear()
        os.environ.update(saved)
        config.reload()
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["tensorturn", *args], result.exit_code, result.stdout,
                                       result.stderr)


def tt_json(*args: str, **kw) -> dict:
    proc = tt(*args, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """A pool of two real agents (named local1, local2) on a private redis-server."""
    workdir = tmp_path_factory.mktemp("pool")
    store = (workdir / "store").as_uri()
    with LocalPool(2, store, workdir=workdir, loglevel="INFO") as p:
        yield p


@contextlib.contextmanager
def paced_pool(tmp_path: Path, monkeypatch, step_s: float, agents: int = 2):
    """A pool of real agents whose every training step lasts ``step_s`` (TENSORTURN_SIM_STEP_S):
    a task trains as long as the test needs, however loaded the machine is. Yields the pool and
    its store's directory."""
    from tensorturn import config

    monkeypatch.setenv("TENSORTURN_SIM_STEP_S", str(step_s))
    config.reload()
    store = tmp_path / "store"
    with LocalPool(agents, store.as_uri(), workdir=tmp_path / "pool") as pool:
        yield pool, store


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """moto's S3 server on a free loopback port; yields the env a client needs."""
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc, env = start_moto(log)
    yield env
    stop_process_group(proc, grace=5)


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch):
    """A fresh bucket on the moto endpoint; the test process's env points boto3 at it."""
    import boto3

    for k, v in s3_endpoint.items():
        monkeypatch.setenv(k, v)
    name = f"tt-{time.time_ns()}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def queued_messages(client) -> list[bytes]:
    """Every message waiting in a TensorTurn queue (the default one, the memory classes, the
    outer and the agents' own queues)."""
    from tensorturn import layout

    return [m for key in layout.task_queues(client) for m in client.lrange(key, 0, -1)]
