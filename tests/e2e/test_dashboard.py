"""`tensorturn dashboard`, as a person sees it: a real pool, a run still running with a failed
attempt behind it, and the page in a real headless Chromium (Debian's, driven by selenium and
Debian's chromedriver); its JSON over real HTTP; the token check beyond loopback in-process.

The run trains ``gated:FailsOnce`` (tests/gated.py): its round 1 waits at a gate (shard 0's
task) until the module ends, and shard 1's first attempt fails, so the page is looked at while the run runs,
with one round on its curve and one failure on its timeline, however loaded the machine is.
The browser test saves a screenshot into ``$TT_ARTIFACTS`` (default: its tmp dir)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from conftest import TEST_POOL_KEY, bearer, clean_env, start_pool, tt_here, tt_json, wait_for

from tensorturn.pool.embedded import free_port, stop_process_group
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import check_broker

pytestmark = pytest.mark.e2e

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A pool of two agents, a fused run on it that is running (round 0 recorded, round 1
    waiting at the gate) with one failed attempt, and `tensorturn dashboard` on it:
    (dashboard URL, pool, run id, store folder)."""
    work = tmp_path_factory.mktemp("dashboard")
    gate, store = work / "gate", work / "store"
    # from round 1 on, shard 0 waits: the other agent stays free for round 0's evaluation
    gate.write_text(json.dumps({"shard": 0, "after": "runs/*/global/r0001.safetensors", "store": str(store)}))
    pool = start_pool(work, 2, env={"TT_GATE": str(gate), "TT_FAIL_ONCE": str(work / "failed-once")})
    dash = None
    try:
        run_id = tt_json("run", "--broker", pool.broker_url, "--store", str(store), "--recipe",
                         "gated:FailsOnce", "--rounds", "3", "--shards", "2", "--sync-every", "5",
                         "--detach", "--json")["run_id"]
        board = RunBoard(check_broker(pool.broker_url))
        wait_for(lambda: board.rounds.all(run_id) and any(a["outcome"].startswith("failed")
                                                       for a in board.attempts.all(run_id)),
                 "round 0 recorded and the failed attempt")
        port = free_port()
        dash = subprocess.Popen(
            [sys.executable, "-m", "tensorturn", "dashboard", "--port", str(port), "--refresh", "0.5"],
            env=clean_env(TENSORTURN_BROKER_URL=pool.broker_url, TENSORTURN_STORE_URL=str(store)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
            start_new_session=True)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: answers(dash, url), "the dashboard answers")
        yield url, pool, run_id, store
    finally:
        if dash is not None:
            stop_process_group(dash, grace=5)
        gate.unlink(missing_ok=True)
        pool.stop(grace=1.0)


def answers(dash: subprocess.Popen, url: str) -> bool:
    """Whether the dashboard process ``dash`` answers its health probe at ``url`` (it must not
    have exited)."""
    assert dash.poll() is None, dash.stdout.read()
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


def chromium_driver():
    """Headless Chromium under selenium, or a skip saying why (never under CI: `.ci/run`
    installs Debian's chromium and chromium-driver)."""
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        missing.append("selenium (pip install -e '.[test]')")
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI needs {', '.join(missing)} for the browser test (.ci/run installs them)")
        pytest.skip(f"no headless browser here: {', '.join(missing)} missing "
                    f"(apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1750", "--hide-scrollbars"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def test_the_page_shows_the_machines_the_running_run_its_curve_and_its_failure(live, tmp_path):
    url, pool, run_id, _ = live
    driver = chromium_driver()
    try:
        driver.get(url)
        js = driver.execute_script
        wait_for(lambda: js("return document.querySelectorAll('#machines tr[data-machine]').length") == 2,
                 "both machines listed")
        states = js("return [...document.querySelectorAll('#machines tr[data-machine]')]"
                    ".map(r => r.dataset.machine + ' ' + r.dataset.state)")
        assert sorted(s.split("@")[0] for s in states) == ["local1", "local2"], states
        assert all(s.split()[-1] in ("idle", "busy") for s in states), states
        run_row = f"#runs tr[data-run='{run_id}']"
        wait_for(lambda: js(f"return document.querySelector(\"{run_row}\")?.classList.contains('selected')"),
                 "the running run listed and shown")
        assert "running" in js(f"return document.querySelector(\"{run_row}\").textContent")
        # the curve: round 0's point, drawn by uPlot (its canvas), and the loss in its legend
        wait_for(lambda: int(js("return document.getElementById('curve').dataset.points") or 0) >= 1,
                 "a point on the curve")
        assert js("return document.querySelector('#curve canvas') !== null")
        assert "train loss" in js("return document.getElementById('curve').textContent")
        # the timeline: the failed attempt in red, the others beside it; and the failure listed
        outcomes = js("return [...document.querySelectorAll('#timeline rect.attempt')].map(r => r.dataset.outcome)")
        assert "failed" in outcomes and "succeeded" in outcomes, outcomes
        failures = js("return document.getElementById('failures').textContent")
        assert "r0/shard-1" in failures and "failed once on purpose" in failures, failures
        assert "hunter2" not in driver.page_source
        assert "round" in js("return document.getElementById('run-facts').textContent")
        artifacts = Path(os.environ.get("TT_ARTIFACTS") or tmp_path)
        artifacts.mkdir(parents=True, exist_ok=True)
        shot = artifacts / "dashboard.png"
        assert driver.save_screenshot(str(shot))
        print(f"dashboard screenshot: {shot}")
        assert shot.stat().st_size > 10_000
    finally:
        driver.quit()


def test_no_secret_in_the_page_or_its_json(live):
    url, pool, run_id, store = live
    token = tt_json("token", "create", "--name", "dash", "--store", str(store), "--json")["token"]
    password = urlsplit(pool.broker_url).password
    secrets = [password, TEST_POOL_KEY, TEST_POOL_KEY.split(".", 1)[1], token, "hunter2"]
    pages = {path: httpx.get(url + path, timeout=30) for path in ("/", "/api/pool", f"/api/runs/{run_id}")}
    for path, res in pages.items():
        assert res.status_code == 200, (path, res.text)
        leaked = [s for s in secrets if s and s in res.text]
        assert not leaked, f"{path} shows a secret"
    doc = pages["/api/pool"].json()
    assert doc["broker"].startswith("redis://default:***@127.0.0.1:"), doc["broker"]
    failed = [a for a in pages[f"/api/runs/{run_id}"].json()["attempts"] if a["outcome"].startswith("failed")]
    assert "redis://:***@10.9.8.7:6379/0" in failed[0]["outcome"] + str(failed[0].get("error")), failed


def test_an_unknown_run_is_one_json_line(live):
    url, *_ = live
    res = httpx.get(f"{url}/api/runs/20200101-000000-abcdef", timeout=30)
    assert res.status_code == 404
    assert res.json() == {"error": "no run '20200101-000000-abcdef' on the broker or in the store "
                                   "(see `tensorturn runs`)"}


# ---- in this process: the token check beyond loopback, the listening socket, served models ----

def test_beyond_loopback_the_data_needs_an_api_token(tmp_path):
    import asyncio

    from tensorturn.dashboard.app import DashboardOptions, create_app
    from tensorturn.serve import tokens
    from tensorturn.store.objects import open_store

    url = (tmp_path / "store").as_uri()
    secret, _ = tokens.create(open_store(url), "dash")
    app = create_app(None, url, DashboardOptions(require_token=True, auth_tarpit_s=0))

    async def calls() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dash") as client:
            return {"page": await client.get("/"), "chart": await client.get("/static/uPlot.iife.min.js"),
                    "none": await client.get("/api/pool"),
                    "wrong": await client.get("/api/pool", headers=bearer("not-a-token")),
                    "right": await client.get("/api/pool", headers=bearer(secret))}

    got = asyncio.run(calls())
    assert got["page"].status_code == 200 and "__REFRESH_MS__" not in got["page"].text  # no data in it
    assert got["chart"].status_code == 200
    assert got["none"].status_code == 401 and got["none"].json() == {"error": "missing or invalid bearer token"}
    assert got["wrong"].status_code == 401
    assert got["right"].status_code == 200
    assert got["right"].json()["runs"] == [] and got["right"].json()["problems"][0].startswith("no broker given")


def test_the_page_asks_for_a_token_and_then_shows_the_data(tmp_path):
    """The token form in the browser, on a dashboard that requires one (as one bound beyond
    loopback does), served in this process."""
    import threading

    import uvicorn

    from tensorturn.dashboard.app import DashboardOptions, create_app
    from tensorturn.serve import tokens
    from tensorturn.store.objects import open_store

    url = (tmp_path / "store").as_uri()
    secret, _ = tokens.create(open_store(url), "dash")
    app = create_app(None, url, DashboardOptions(require_token=True, auth_tarpit_s=0, refresh_s=0.3))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    driver = None
    try:
        wait_for(lambda: server.started, "the dashboard listens")
        driver = chromium_driver()
        driver.get(f"http://127.0.0.1:{port}/")
        js = driver.execute_script
        wait_for(lambda: js("return getComputedStyle(document.getElementById('token-form')).display") == "block",
                 "the token form")
        assert "no runs yet" not in js("return document.getElementById('runs').textContent")
        driver.find_element("id", "token").send_keys(secret)
        driver.find_element("css selector", "#token-form button").click()
        wait_for(lambda: "no runs yet" in js("return document.getElementById('runs').textContent"),
                 "the data, with the token")
        assert secret not in driver.page_source
    finally:
        if driver is not None:
            driver.quit()
        server.should_exit = True
        thread.join(timeout=30)


def test_bound_to_loopback_only_loopback_host_names_are_answered_and_nothing_frames_the_page(tmp_path):
    """DNS rebinding: a page of evil.example whose name now points at 127.0.0.1 sends `Host:
    evil.example`; it gets 400, not the pool's JSON. Every answer forbids framing."""
    import asyncio

    from tensorturn.dashboard.app import LOOPBACK_NAMES, DashboardOptions, create_app

    app = create_app(None, (tmp_path / "store").as_uri(), DashboardOptions(allowed_hosts=LOOPBACK_NAMES))

    async def calls() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
            return {host: await client.get(f"http://{host}/api/pool")
                    for host in ("evil.example", "evil.example:8265", "127.0.0.1:8265", "localhost", "[::1]:8265")}

    got = asyncio.run(calls())
    assert got["evil.example"].status_code == got["evil.example:8265"].status_code == 400
    assert "runs" not in got["evil.example"].text
    for host in ("127.0.0.1:8265", "localhost", "[::1]:8265"):
        assert got[host].status_code == 200 and "runs" in got[host].json()
        assert got[host].headers["X-Frame-Options"] == "DENY"
        assert "frame-ancestors 'none'" in got[host].headers["Content-Security-Policy"]


def test_loopback_is_told_from_other_addresses():
    from tensorturn.dashboard.app import is_loopback

    assert all(map(is_loopback, ["127.0.0.1", "localhost", "::1", "[::1]", "127.1.2.3"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "192.168.1.20", "example.org"]))


def test_a_port_in_use_is_one_line_and_exit_2(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = tt_here("dashboard", "--store", str(tmp_path / "store"), "--port", str(port))
    assert proc.returncode == 2  # invalid input: the port given
    assert proc.stderr.strip().splitlines() == [
        f"error: the dashboard cannot listen on 127.0.0.1:{port}: Address already in use (another "
        f"dashboard? pass --port)"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_by_ctrl_c_or_sigterm_is_a_clean_end_exit_0(tmp_path, sig):
    """A service manager's stop (SIGTERM) and Ctrl-C end the dashboard — and `serve`, which runs
    the same way — normally: exit 0, no "Aborted!" (uvicorn raises the signal again once it has
    shut down: exit 1 or 143 before)."""
    port = free_port()
    dash = subprocess.Popen(
        [sys.executable, "-m", "tensorturn", "dashboard", "--store", str(tmp_path / "store"), "--port", str(port)],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: answers(dash, f"http://127.0.0.1:{port}"), "the dashboard answers")
        dash.send_signal(sig)
        assert dash.wait(30) == 0
        assert "Aborted" not in dash.stdout.read()
    finally:
        stop_process_group(dash, grace=5)


def test_served_models_are_the_servers_marks_in_the_store(tmp_path):
    from tensorturn.dashboard.view import served_models
    from tensorturn.state.manifest import serving
    from tensorturn.store.objects import open_store

    url = (tmp_path / "store").as_uri()
    run_id = "20260101-000000-abcdef"
    assert served_models(url, [run_id]) == []
    with serving(open_store(url), run_id, "127.0.0.1:8000"):
        [mark] = served_models(url, [run_id])
    assert mark["run_id"] == run_id and mark["where"] == "127.0.0.1:8000" and mark["age_s"] >= 0
    assert served_models(url, [run_id]) == []


def test_public_masks_every_string_and_drops_fields_named_like_secrets():
    from tensorturn.dashboard.view import public

    doc = public({"error": "cannot reach redis://u:pw1@h:6379/0", "nested": [{"signature": "abc", "ok": 1.0}],
                  "token": "t", "loss": float("nan"), "val_loss": float("inf")})
    assert doc == {"error": "cannot reach redis://u:***@h:6379/0", "nested": [{"ok": 1.0}], "loss": None,
                   "val_loss": None}
