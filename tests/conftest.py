"""Shared fixtures and helpers, once for every test module: the CLI as a user runs it, real
redis-server processes, pools of real agents and runs on them (``pool_factory``, ``pool``,
``run_to_end``), a real S3 HTTP endpoint (moto), the attempt protocol in this process
(``world``) and the inference API (``Server``). No test module imports another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tensorturn import platforms
from tensorturn.pool.embedded import LocalPool, RedisServer, stop_process_group
from testbed import emulate
from testbed.s3 import start_moto

ROOT = Path(__file__).resolve().parent.parent
# The test recipes (failing.py, huge.py, ...: recipe modules, not tests) live in one folder. They
# import in every process the tests start, agents included, as a user's recipe must on every
# machine of a pool, and in this one (a test reads a recipe's source or builds one directly).
RECIPES = ROOT / "tests" / "recipes"
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(RECIPES), os.environ.get("PYTHONPATH", "")) if p)
if str(RECIPES) not in sys.path:
    sys.path.insert(0, str(RECIPES))
# ... and so do the testbed's emulations (a step's time, a battery sensor: testbed.emulate)
emulate.reach_children()
# One pool key for the whole session, in this process and every process the tests start
# (a test of what happens without it takes it away). Agents would refuse unsigned work.
TEST_POOL_KEY = "ttk1.dGVzdHMgb25seTogbm90IGEgc2VjcmV0IGtleSEhISE"
os.environ["TENSORTURN_POOL_KEY"] = TEST_POOL_KEY
# The test recipes, allowed on the pools the tests start themselves (a run's own CLI allows the
# recipe it names on its embedded pool; a test of an unallowed recipe names another module).
os.environ["TENSORTURN_ALLOW_RECIPES"] = ",".join(
    f"{m}:*" for m in ("failing", "huge", "crasher", "nan_once", "myrecipe", "flaky_recipe", "badinit", "gated"))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items):
    """Every test under ``tests/e2e/`` is marked ``e2e`` (real agent processes: the fast lane,
    ``-m "not e2e"``, leaves them out). Modules in the order pytest-xdist hands them out
    (``--no-loadscope-reorder``): those marked ``long`` first, then the others by their number of
    tests, most first — longest work first, so that short modules fill the end instead of one
    long module finishing alone. A stable sort: each module's tests keep their order."""
    def module(item) -> str:
        return item.nodeid.split("::", 1)[0]

    for item in items:
        if "e2e" in Path(str(item.path)).relative_to(ROOT / "tests").parts[:-1]:
            item.add_marker(pytest.mark.e2e)
    long = {module(item) for item in items if item.get_closest_marker("long")}
    sizes: dict[str, int] = {}
    for item in items:
        sizes[module(item)] = sizes.get(module(item), 0) + 1
    items.sort(key=lambda item: (module(item) not in long, -sizes[module(item)], module(item)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report shows what every pool still running was doing: its broker's queues
    and its runs' claims and unfinished attempts, and the end of each agent's log — CI keeps
    neither the pools' folders nor their Redis."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and _live_pools:
        from testbed.diagnose import describe_pool

        for i, pool in enumerate(_live_pools):
            report.sections.append((f"pool {i} at failure", describe_pool(pool)))


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


def tt_many(*commands: tuple[str, ...], envs: list[dict[str, str] | None] | None = None,
            cwd: Path | None = None, timeout: float = 900) -> list[subprocess.CompletedProcess]:
    """Several ``tensorturn`` commands at once, each as :func:`tt` runs it (``envs[i]`` its
    environment): for commands that each wait or load torch, so both cores work."""
    from concurrent.futures import ThreadPoolExecutor

    envs = envs or [None] * len(commands)
    with ThreadPoolExecutor(len(commands)) as threads:
        return list(threads.map(lambda args, env: tt(*args, env=env, cwd=cwd, timeout=timeout),
                                commands, envs))


def tt_json_many(*commands: tuple[str, ...], **kw) -> list[dict]:
    """:func:`tt_json` of several commands at once (:func:`tt_many`): independent runs, each on
    an embedded pool of its own, train side by side."""
    procs = tt_many(*commands, **kw)
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(proc.stdout) for proc in procs]


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


def tt_here_json(*args: str, **kw) -> dict:
    """:func:`tt_json`, in this process (:func:`tt_here`)."""
    proc = tt_here(*args, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


# ---- pools of real agents, and runs on them -----------------------------------------------------

# The pools this test process has started and not stopped: a failed test shows their state.
_live_pools: list[AgentPool] = []


class AgentPool(LocalPool):
    """A :class:`LocalPool` whose agents start with ``env`` on top of this process's environment
    (a pace, a memory size, a gate file): a pool can be set up once for several tests, and this
    process's own settings stay as they are."""

    def __init__(self, workers: int, store_url: str, env: dict[str, str] | None = None, **options):
        super().__init__(workers, store_url, **options)
        self.env = dict(env or {})

    def __enter__(self) -> AgentPool:
        super().__enter__()
        _live_pools.append(self)
        return self

    def stop(self, grace: float = 30.0) -> None:
        if self in _live_pools:
            _live_pools.remove(self)
        super().stop(grace)

    def agent_environ(self, i: int) -> dict[str, str]:
        return {**super().agent_environ(i), **self.env}


def start_pool(workdir: Path, agents: int = 2, store_url: str | None = None,
               step_s: float | None = None, env: dict[str, str] | None = None,
               **options) -> AgentPool:
    """A started pool of ``agents`` real agents (named local1, local2, ...) on a private
    redis-server in ``workdir/pool``, storing to ``store_url`` (default: the folder
    ``workdir/store``). With ``step_s`` every training step of its agents lasts that long
    (testbed.emulate's TESTBED_SIM_STEP_S): a task trains as long as the test needs, however
    loaded the machine is. ``options`` go to :class:`LocalPool` (``roles``, ``loglevel``, ``appendonly``). The caller
    stops it (:meth:`LocalPool.stop`).

    Where the platform allows (Linux: :func:`tensorturn.platforms.forks_warm`) its agents are
    forked from one warm parent, as ``tensorturn run``'s are (:meth:`LocalPool.start_forked`):
    the same ``tensorturn agent`` command, each a session of its own (``os.killpg`` on its pid
    reaches it and its pool), all answering before this returns — and the imports paid once, not
    once an agent (seconds of a core each). Elsewhere each agent is a process of its own."""
    env = dict(env or {})
    if step_s is not None:
        env[emulate.SIM_STEP_S] = str(step_s)
    # not `quick` where agents cannot fork warm: it would return once the first agent answers
    options.setdefault("quick", platforms.forks_warm())
    pool = AgentPool(agents, store_url or (workdir / "store").as_uri(), env=env,
                     workdir=workdir / "pool", **options)
    return pool.__enter__()  # which stops what it started if it fails


@pytest.fixture
def pool_factory(tmp_path):
    """Start pools for this test: ``pool_factory(agents=2, store_url=None, step_s=None, env=None,
    **options)``, as :func:`start_pool` in ``tmp_path`` (a second pool in ``tmp_path/2``). Every
    pool stops when the test ends, its agents killed after a second: whatever they still run
    goes with the pool's Redis, so a warm shutdown would hand nothing back."""
    pools: list[AgentPool] = []

    def start(agents: int = 2, store_url: str | None = None, **options) -> AgentPool:
        workdir = tmp_path / str(len(pools) + 1) if pools else tmp_path
        pools.append(start_pool(workdir, agents, store_url, **options))
        return pools[-1]

    yield start
    for started in reversed(pools):
        started.stop(grace=1.0)


@pytest.fixture(scope="module")
def pool(tmp_path_factory, request):
    """A pool of two real agents (named local1, local2) on a private redis-server, shared by the
    module's tests (one that stops an agent starts it again). A module's ``POOL_ENV`` (say, a
    shorter task lease where its tests kill agents) is in its agents' environment."""
    shared = start_pool(tmp_path_factory.mktemp("pool"), 2, loglevel="INFO",
                        env=getattr(request.module, "POOL_ENV", None))
    yield shared
    shared.stop(grace=1.0)


def submit_run(pool: LocalPool, spec=None, **fields):
    """Queue ``spec``, or a run spec made of ``fields`` (``mode``, ``recipe``, ``rounds``, ...;
    on the pool's store unless ``store_url`` says otherwise), on ``pool``; the spec."""
    from tensorturn import runs
    from tensorturn.spec import RunSpec

    if spec is None:
        spec = RunSpec.create(**{"store_url": pool.store_url, **fields})
    runs.submit(spec, pool.broker_url)
    return spec


def wait_for_run(pool: LocalPool, run_id: str, timeout_s: float = 600) -> dict:
    """Until run ``run_id`` on ``pool`` has ended: its description (as ``status --json``). The
    deadline only bounds a hang."""
    from tensorturn import runs

    return runs.wait(pool.broker_url, run_id, timeout_s=timeout_s)


def run_to_end(pool: LocalPool, spec=None, timeout_s: float = 600, **fields) -> dict:
    """Submit a run to ``pool`` (as :func:`submit_run`) and wait until it ends: its description."""
    return wait_for_run(pool, submit_run(pool, spec, **fields).run_id, timeout_s)


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
    from tensorturn.state.queues import queued_messages as queued

    return queued(client)


# ---- the attempt protocol in this process -------------------------------------------------------

class World:
    """A redis-server and a folder, no agent: tests run the tasks in this process (Celery's
    ``apply``) in the order each case needs; what the tasks queue waits in Redis, unconsumed."""

    def __init__(self, broker: str, tmp: Path):
        from tensorturn.state.board import RunBoard
        from tensorturn.state.broker import redis_client

        self.broker, self.tmp = broker, tmp
        self.board = RunBoard(redis_client(broker))

    def submit(self, name: str = "store", **options):
        """Queue a run spec made of ``options``, storing to the folder ``name``; the spec."""
        from tensorturn import runs
        from tensorturn.spec import RunSpec

        spec = RunSpec.create(store_url=(self.tmp / name).as_uri(), **options)
        runs.submit(spec, self.broker)
        return spec


@pytest.fixture
def world(redis_server, tmp_path, monkeypatch):
    """The in-process world: this process's Celery app on a private redis-server; no θ held
    from another test."""
    from tensorturn.modes.fused import tasks  # noqa: F401 - every fused task registered with this app
    from tensorturn.modes.fused.weights import cache
    from tensorturn.pool.celery_app import configure

    monkeypatch.delenv("TT_FAIL_IN", raising=False)
    configure(redis_server.url)
    cache.clear()
    yield World(redis_server.url, tmp_path)
    cache.clear()


def as_agent_of(spec) -> None:
    """This process plays an agent whose own store is the run's (agents use their own)."""
    from tensorturn import config

    config.use(config.current().with_(store_url=spec.store_url))


def run_shard(spec, r: int, k: int) -> None:
    """Shard ``k`` of fused round ``r``, trained in this process (as an agent of the run)."""
    from tensorturn.modes.fused import driver
    from tensorturn.tasks.attempt import signed

    as_agent_of(spec)
    driver.train_shard.apply(args=(spec.run_id, r, k), kwargs=signed(spec.run_id, f"r{r}/shard-{k}")).get()


def run_outer(spec, r: int, evaluate: bool = True) -> None:
    """The outer step of fused round ``r``, then (``evaluate``; not the last round's: its outer
    step evaluates) the round's evaluation it queues, in this process."""
    from tensorturn.modes.fused import driver
    from tensorturn.tasks.attempt import signed

    as_agent_of(spec)
    driver.outer_step.apply(args=([], spec.run_id, r), kwargs=signed(spec.run_id, f"r{r}/outer")).get()
    if evaluate and r + 1 < spec.options.rounds:
        run_eval(spec, r)


def run_eval(spec, r: int) -> None:
    """The evaluation of fused round ``r``'s weights (queued by its outer step), in this process."""
    from tensorturn.modes.fused import driver
    from tensorturn.tasks.attempt import signed

    as_agent_of(spec)
    driver.evaluate.apply(args=(spec.run_id, r), kwargs=signed(spec.run_id, f"r{r}/eval")).get()


def run_rounds(spec, start: int = 0) -> None:
    """A fused run's rounds from ``start``, every shard then the outer step, in this process."""
    for r in range(start, spec.options.rounds):
        for k in range(spec.options.shards):
            run_shard(spec, r, k)
        run_outer(spec, r)


# ---- the inference API ----------------------------------------------------------------------------

class Server:
    """``tensorturn serve RUN_ID`` in a process of its own on a free loopback port, ready (its
    health probe answers); :meth:`stop` ends it and returns what it printed."""

    def __init__(self, store: str, run_id: str, *extra: str, env: dict[str, str] | None = None):
        import httpx

        from tensorturn.pool.embedded import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorturn", "serve", run_id, "--store", store, "--host",
             "127.0.0.1", "--port", str(self.port), *extra],
            env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, self.proc.stdout.read()
            time.sleep(0.1)
        stop_process_group(self.proc, grace=10)
        raise AssertionError("the API did not come up")

    def stop(self) -> str:
        stop_process_group(self.proc, grace=10)
        return self.proc.stdout.read()


def bearer(token: str) -> dict[str, str]:
    """The header that carries an API token."""
    return {"Authorization": f"Bearer {token}"}


# ---- what several modules check the same way --------------------------------------------------

def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def assert_clean_error(proc, exit_code: int | None = None) -> str:
    """A non-zero exit with exactly one ``error:`` line and no traceback; returns that line."""
    assert proc.returncode != 0, proc.stdout + proc.stderr
    if exit_code is not None:
        assert proc.returncode == exit_code, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stdout, proc.stdout
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert proc.stdout == "", proc.stdout
    return lines[0]


def push_pictures(tmp_path, store: str, per_class: int = 40) -> None:
    """Red-ish and blue-ish 12x12 pictures in two class folders, pushed as dataset 'colors'."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for name, channel in (("red", 0), ("blue", 2)):
        (tmp_path / "pics" / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 120, size=(12, 12, 3), dtype=np.uint8)
            pixels[..., channel] += 120
            Image.fromarray(pixels).save(tmp_path / "pics" / name / f"{i}.png")
    tt_json("data", "push", str(tmp_path / "pics"), "--name", "colors", "--store", store, "--json")


@pytest.fixture
def marker(tmp_path, monkeypatch):
    """Where tests/recipes/evil_recipe.py leaves its mark if anything ever imports it."""
    path = tmp_path / "evil-imported"
    monkeypatch.setenv("TT_EVIL_MARKER", str(path))
    return path
