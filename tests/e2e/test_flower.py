"""Monitoring a real pool: real Flower (basic auth) and ``celery inspect`` against two real agents.

Everything listens on 127.0.0.1 only; every wait is bounded.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import pytest
from conftest import start_pool

from tensorturn.layout import DEFAULT_QUEUE
from tensorturn.pool.embedded import free_port, stop_process_group

pytestmark = pytest.mark.e2e

AUTH = ("admin", "s3cret")
AGENTS = ("local1@", "local2@")


@pytest.fixture(scope="module")
def flower_pool(tmp_path_factory):
    """Two real agents (local1, local2) on a private redis-server."""
    pool = start_pool(tmp_path_factory.mktemp("flower-pool"), 2)
    yield pool
    pool.stop(grace=1.0)


@pytest.fixture(scope="module")
def flower(flower_pool, tmp_path_factory):
    """Real Flower with basic auth, on a free loopback port; yields its base URL."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("flower") / "flower.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tensorturn.pool.celery_app", "flower", f"--port={port}",
         "--address=127.0.0.1"],  # the basic auth from the environment, as documented
        env=dict(os.environ, TENSORTURN_BROKER_URL=flower_pool.broker_url,
                 FLOWER_BASIC_AUTH=f"{AUTH[0]}:{AUTH[1]}"), stdout=log,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail("flower exited at start:\n" + log_path.read_text()[-3000:])
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("flower did not listen within 60 s:\n" + log_path.read_text()[-3000:])
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process_group(proc, grace=10)  # SIGTERM, then SIGKILL the group
        log.close()


def test_flower_lists_both_agents(flower):
    workers: dict = {}
    with httpx.Client(base_url=flower, auth=AUTH, timeout=15) as client:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # Flower learns of workers from events and inspect
            resp = client.get("/api/workers", params={"refresh": 1})
            assert resp.status_code == 200, resp.text[:500]
            workers = resp.json()
            if all(any(name.startswith(a) for name in workers) for a in AGENTS):
                break
            time.sleep(1)
    for agent in AGENTS:
        assert any(name.startswith(agent) for name in workers), (agent, list(workers))
    # each entry is a live worker's own report, e.g. its pool settings
    for name, info in workers.items():
        if name.startswith(AGENTS):
            assert isinstance(info, dict) and info, (name, info)


def test_flower_reads_the_queues_lengths(flower):
    """Flower's broker page and ``/api/queues/length`` read each queue's length from Redis: it
    picks its broker client by the connection's URL scheme, which names TensorTurn's transport
    ``redis``, as Redis's own would."""
    with httpx.Client(base_url=flower, auth=AUTH, timeout=15) as client:
        resp = client.get("/api/queues/length")
    assert resp.status_code == 200, resp.text[:500]
    lengths = {q["name"]: q["messages"] for q in resp.json()["active_queues"]}
    assert DEFAULT_QUEUE in lengths and all(isinstance(n, int) and n >= 0 for n in lengths.values())


@pytest.mark.parametrize("auth", [None, ("admin", "wrong"), ("someone", "s3cret")],
                         ids=["no-auth", "wrong-password", "wrong-user"])
def test_flower_refuses_without_the_right_credentials(flower, auth):
    with httpx.Client(base_url=flower, timeout=15) as client:
        for path in ("/api/workers", "/"):
            resp = client.get(path, auth=auth)
            assert resp.status_code == 401, (path, resp.status_code)
            if path == "/":  # the UI asks a browser for credentials (the API just says 401)
                assert resp.headers.get("www-authenticate", "").lower().startswith("basic")
            assert "local1@" not in resp.text and "local2@" not in resp.text


def test_flower_ui_with_credentials(flower):
    resp = httpx.get(f"{flower}/", auth=AUTH, timeout=15)
    assert resp.status_code == 200
    assert "flower" in resp.text.lower()


def test_celery_inspect_ping_sees_both_agents(flower_pool):
    proc = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tensorturn.pool.celery_app", "inspect", "ping",
         "--timeout=5"],
        env=dict(os.environ, TENSORTURN_BROKER_URL=flower_pool.broker_url), capture_output=True,
        text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for agent in AGENTS:
        assert agent in proc.stdout, proc.stdout
    assert proc.stdout.count("pong") >= 2
    # the broker password never shows in the output
    password = flower_pool.redis.password
    assert password not in proc.stdout and password not in proc.stderr
