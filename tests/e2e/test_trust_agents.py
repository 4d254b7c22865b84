"""Real agents and embedded pools: forged messages refused unread, and no secret on any command line
in the documented flows."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from conftest import TEST_POOL_KEY, clean_env, tt, wait_for

from tensorturn import layout, runs, trust
from tensorturn.spec import RunSpec
from tensorturn.state.broker import redis_client
from tensorturn.trust import PoolKey

FUSED = dict(mode="fused", recipe="digits-mlp", rounds=1, shards=2, sync_every=5)

OTHER_KEY = PoolKey.generate()


def refusals(r) -> list[dict]:
    return [json.loads(x) for x in r.lrange(layout.REFUSED, 0, -1)]


def start_reply(r, run_id: str) -> dict:
    answer = r.blpop([layout.run_key(run_id, "started")], timeout=240)
    assert answer is not None, "no answer from start_run"
    return json.loads(answer[1])


def test_real_agents_refuse_forged_messages_unread(tmp_path, pool_factory, marker):
    from tensorturn.pool.celery_app import app

    pool = pool_factory(1)
    r = redis_client(pool.broker_url)
    key = trust.pool_key()
    # a shard of a run that does not exist, unsigned: someone with the Redis password only
    app.send_task("tensorturn.fused.train_shard", args=["someone", 0, 0])
    # a run naming another store and a module of theirs, signed with a key not the pool's
    evil = RunSpec.create(store_url=(tmp_path / "theirs").as_uri(),
                          **{**FUSED, "recipe": "evil_recipe:Evil"}).to_json()
    app.send_task("tensorturn.start_run", args=[evil], kwargs={"sig": OTHER_KEY.sign("submit", evil)})
    assert "missing or bad signature" in runs.start_answer(r, evil["run_id"])["error"]
    # signed with the pool key (its holder's mistake, or a stolen key): still only this
    # agent's store, and only recipes this agent allows
    elsewhere = RunSpec.create(store_url=(tmp_path / "theirs").as_uri(), **FUSED).to_json()
    app.send_task("tensorturn.start_run", args=[elsewhere], kwargs={"sig": key.sign("submit", elsewhere)})
    assert "this pool's agents use the store" in start_reply(r, elsewhere["run_id"])["error"]
    unallowed = RunSpec.create(store_url=pool.store_url, **{**FUSED, "recipe": "evil_recipe:Evil"}).to_json()
    app.send_task("tensorturn.start_run", args=[unallowed], kwargs={"sig": key.sign("submit", unallowed)})
    assert "is not allowed on this machine" in start_reply(r, unallowed["run_id"])["error"]
    # the unsigned shard was refused too (the agent takes messages in order, one at a time)
    assert [x["task"] for x in refusals(r)] == ["tensorturn.start_run", "tensorturn.fused.train_shard"]
    shown = tt("workers", "--broker", pool.broker_url)
    assert shown.returncode == 0
    assert "2 task message(s) refused by the agents" in shown.stderr
    assert not marker.exists()
    assert not (tmp_path / "theirs").exists()


def cmdlines() -> dict[int, str]:
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                    errors="replace")
            except OSError:
                continue
    return out


def test_no_secret_on_any_command_line_in_the_documented_flows(tmp_path):
    """`up`, an agent joining with --join-file and one with --join - (stdin), a run submitted
    with --join-file, a token, `serve`: no process shows the Redis password, the pool key or the
    join string in its command line. An agent given --join on argv hides it once started."""
    import subprocess
    import sys

    import httpx

    from tensorturn.pool.embedded import free_port, stop_process_group

    env = clean_env()
    env.pop("TENSORTURN_POOL_KEY")  # the documented flow: the key comes from `up`'s join file
    env["TENSORTURN_SHUTDOWN_GRACE_S"] = "1"  # the agents' stop at the end: 1 s, not 5
    coord = tmp_path / "coord"

    def spawn(*args: str, stdin=subprocess.DEVNULL) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "tensorturn", *args], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=stdin, start_new_session=True)

    up = spawn("up", "--port", str(free_port()), "--bind", "127.0.0.1", "--dir", str(coord),
               "--store", str(tmp_path / "store"))
    procs = [up]
    try:
        assert up.stdout.readline().strip() == "tensorturn agent --join-file join --name NAME"
        join = (coord / "join").read_text().strip()
        broker = (coord / "broker-url").read_text().strip()
        password = broker.split("default:", 1)[1].split("@")[0]
        pool_key = json.loads(__import__("base64").urlsafe_b64decode(
            join[4:] + "=" * (-len(join[4:]) % 4)))["key"]
        secrets = [password, pool_key, join]
        procs.append(spawn("agent", "--join-file", str(coord / "join"), "--name", "filed"))
        piped = spawn("agent", "--join", "-", "--name", "piped", stdin=subprocess.PIPE)
        piped.stdin.write(join + "\n")
        piped.stdin.close()
        procs.append(piped)
        careless = spawn("agent", "--join", join, "--name", "careless")  # what not to do
        procs.append(careless)
        # the run and the token are submitted while the agents start (the run waits for them)
        clients = [spawn("run", "--join-file", str(coord / "join"), "--recipe", "digits-mlp",
                         "--rounds", "1", "--shards", "2", "--sync-every", "5", "--json"),
                   spawn("token", "create", "--join-file", str(coord / "join"), "--json")]
        r = redis_client(broker)
        def agents_up() -> bool:  # all three agents heartbeat (one that exited is an error)
            assert all(p.poll() is None for p in procs), [p.stderr.read() for p in procs if p.poll() is not None]
            return len(list(r.scan_iter("tt:worker:*"))) >= 3

        try:
            wait_for(agents_up, "three agents", timeout=240)
            (run_out, run_err), (_, token_err) = (c.communicate(timeout=600) for c in clients)
        finally:
            for c in clients:
                stop_process_group(c, grace=10)
        assert clients[0].returncode == 0, run_err[-2000:]
        run_id = json.loads(run_out)["run_id"]
        assert clients[1].returncode == 0, token_err
        port = free_port()
        serve = spawn("serve", run_id, "--join-file", str(coord / "join"), "--port", str(port))
        procs.append(serve)
        def ready() -> bool:
            assert serve.poll() is None, serve.stderr.read()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(ready, "the API", timeout=240)
        shown = cmdlines()
        leaks = {pid: line for pid, line in shown.items() for s in secrets if s in line}
        assert leaks == {}
        for p in (up, *procs[1:]):
            assert p.poll() is None
    finally:
        for p in procs[1:]:  # the agents and the API stop side by side (each waits out its
            if p.poll() is None:  # shutdown grace), then the coordinator they talk to
                p.terminate()
        for p in reversed(procs):
            stop_process_group(p, grace=10, term=p is up)
        for p in procs:
            out, err = p.stdout.read(), p.stderr.read()
            assert password not in out + err and pool_key not in out + err


def test_the_embedded_pool_puts_no_secret_on_a_command_line(tmp_path, pool_factory):
    pool = pool_factory(1)
    secrets = [pool.redis.password, TEST_POOL_KEY]
    shown = cmdlines()
    assert any("redis-server" in line and (str(pool.redis.port) in line or str(tmp_path) in line)
               for line in shown.values())  # the pool's Redis is among the processes read
    assert {pid: line for pid, line in shown.items() for s in secrets if s in line} == {}
    assert stat.S_IMODE((tmp_path / "pool" / "redis" / "redis.conf").stat().st_mode) == 0o600
