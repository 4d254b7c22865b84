"""Chaos: faults injected into a real pool (signals, a Redis restart, an S3 outage, a duplicate).

Each fused run must succeed, give exactly the fault-free run's model (same seed and threads), and
count nothing twice.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import threading
import time

import psutil
import pytest
import redis
from conftest import run_to_end, start_pool, submit_run, wait_for

from tensorturn import layout, runs
from tensorturn.modes.fused.driver import train_slot
from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.tasks.attempt import signed

pytestmark = [pytest.mark.e2e, pytest.mark.long]

# Three shards of about 1.5k steps: long enough to hit mid-shard, short enough for CI.
SPEC = dict(mode="fused", recipe="digits-mlp", rounds=2, shards=3, sync_every=1500)


@pytest.fixture(scope="module")
def chaos_pool(tmp_path_factory):
    """Three agents on a redis-server that keeps an append-only file (it is restarted mid-run).
    Their task leases last 4 s, not 8 (refreshed every second): a dropped or stalled machine's
    shard comes back sooner."""
    pool = start_pool(tmp_path_factory.mktemp("chaos"), 3, loglevel="INFO", appendonly=True,
                      env={"TENSORTURN_VISIBILITY_TIMEOUT_S": "4"})
    yield pool
    pool.stop(grace=1.0)


@pytest.fixture
def pool(chaos_pool):
    """The module's pool with every agent alive and every process running."""
    for i, proc in enumerate(chaos_pool.agents):
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGCONT)
        else:
            chaos_pool.start_agent(i)
    chaos_pool.wait_ready()
    yield chaos_pool


@pytest.fixture(scope="module")
def reference(chaos_pool, tmp_path_factory):
    """The fault-free run of SPEC on the same pool."""
    doc = run_to_end(chaos_pool, **SPEC)
    assert doc["state"] == "succeeded" and not doc["incidents"]
    return doc


def test_a_run_leaves_no_celery_results_or_subscriptions(chaos_pool, reference):
    """TensorTurn never reads a Celery result (a round's barrier is on the run board), so none
    is stored — each cost a task broker commands — and no sender listens for one."""
    r = redis.Redis.from_url(chaos_pool.broker_url)
    assert r.pubsub_channels("celery-task-meta-*") == []
    assert list(r.scan_iter("celery-task*", count=1000)) == []


def submit(pool, tmp_path, **overrides) -> RunSpec:
    return submit_run(pool, **{**SPEC, **overrides})  # on the agents' own store


def board(pool) -> RunBoard:
    return RunBoard(redis.Redis.from_url(pool.broker_url, decode_responses=True))


def running_attempt(pool, run_id: str, round_: int = 0, settle: float = 0.5) -> dict:
    """Wait until a shard of ``round_`` is mid-training; return its attempt. A run that ends
    first is an error that says how it ended."""
    deadline = time.monotonic() + 120
    looks = board(pool)
    while time.monotonic() < deadline:
        for a in looks.attempts.all(run_id):
            if a["task"].startswith(f"r{round_}/") and a["outcome"] == "running":
                time.sleep(settle)
                return a
        if looks.runs.state(run_id) in ("succeeded", "failed", "cancelled"):
            doc = looks.describe(run_id)
            raise AssertionError(f"the run ended {doc['state']} ({doc.get('error')}) before a shard of round "
                                 f"{round_} was seen training: {[(a['task'], a['outcome']) for a in doc['attempts']]}")
        time.sleep(0.05)
    raise AssertionError("no shard started")


def agent_index(attempt: dict) -> int:
    return int(attempt["worker"].split("@")[0].removeprefix("local")) - 1


def finish(pool, spec: RunSpec, reference: dict) -> dict:
    doc = runs.wait(pool.broker_url, spec.run_id, timeout_s=300)
    assert doc["state"] == "succeeded", doc.get("error")
    assert doc["model_sha256"] == reference["model_sha256"]
    assert doc["bytes_up"] == reference["bytes_up"]  # nothing counted twice
    assert [r["samples"] for r in doc["rounds"]] == [r["samples"] for r in reference["rounds"]]
    return doc


def attempts_of(doc: dict, task: str) -> list[dict]:
    return [a for a in doc["attempts"] if a["task"] == task]


def test_killed_pool_child_is_requeued(pool, reference, tmp_path):
    spec = submit(pool, tmp_path)
    victim = running_attempt(pool, spec.run_id)
    agent = psutil.Process(pool.agents[agent_index(victim)].pid)
    children = agent.children(recursive=True)
    assert children, "the agent has no pool child"
    for child in children:
        child.send_signal(signal.SIGKILL)
    doc = finish(pool, spec, reference)
    tries = attempts_of(doc, victim["task"])
    assert len(tries) >= 2 and tries[-1]["outcome"] == "succeeded"
    assert any(i["kind"] == "requeued" and i["task"] == victim["task"] for i in doc["incidents"])


def test_machine_drop_is_requeued_to_another_agent(pool, reference, tmp_path):
    spec = submit(pool, tmp_path)
    victim = running_attempt(pool, spec.run_id)
    os.killpg(pool.agents[agent_index(victim)].pid, signal.SIGKILL)
    killed_at = time.time()
    doc = finish(pool, spec, reference)
    tries = attempts_of(doc, victim["task"])
    assert tries[0]["outcome"].startswith("lost")
    assert tries[-1]["outcome"] == "succeeded" and tries[-1]["worker"] != victim["worker"]
    print(f"requeue latency {tries[1]['started_at'] - killed_at:.1f}s")


def test_partition_heals_and_the_late_result_is_ignored(pool, reference, tmp_path):
    spec = submit(pool, tmp_path)
    victim = running_attempt(pool, spec.run_id)
    group = pool.agents[agent_index(victim)].pid
    os.killpg(group, signal.SIGSTOP)  # partitioned: alive, but silent past its lease
    try:
        deadline = time.monotonic() + 180
        while board(pool).runs.state(spec.run_id) not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, "the run did not finish around the stalled agent"
            time.sleep(0.2)
    finally:
        os.killpg(group, signal.SIGCONT)  # the partition heals; the old attempt finishes late
    deadline = time.monotonic() + 60
    while not attempts_of(board(pool).describe(spec.run_id), victim["task"])[0]["outcome"].startswith("late"):
        assert time.monotonic() < deadline, "the healed attempt never finished"
        time.sleep(0.2)
    doc = finish(pool, spec, reference)
    tries = attempts_of(doc, victim["task"])
    assert len(tries) == 2 and tries[1]["outcome"] == "succeeded"
    assert any(i["kind"] == "late_ignored" for i in doc["incidents"])


def test_a_machine_that_sleeps_mid_task_wakes_and_goes_back_to_work(pool, reference, tmp_path):
    """A laptop closed mid-task (SIGSTOP of its agent's processes) sleeps past its lease and
    past the heartbeats that keep it listed as online; its task is done elsewhere and the run
    finishes. Woken (SIGCONT), its late result is discarded, `workers` lists it again, and it
    trains the next run's tasks without a restart."""
    from tensorturn.state.roster import list_workers

    r = redis.Redis.from_url(pool.broker_url, decode_responses=True)
    spec = submit(pool, tmp_path)
    victim = running_attempt(pool, spec.run_id)
    index = agent_index(victim)
    group = pool.agents[index].pid

    def listed(state: str) -> bool:
        return {w["name"]: w["state"] for w in list_workers(r)}.get(victim["worker"]) == state

    os.killpg(group, signal.SIGSTOP)
    try:
        wait_for(lambda: board(pool).runs.state(spec.run_id) in ("succeeded", "failed") and listed("offline"),
                 "the run to finish around the sleeper, and the sleeper to be listed offline")
    finally:
        os.killpg(group, signal.SIGCONT)  # wakes
    finish(pool, spec, reference)
    wait_for(lambda: attempts_of(board(pool).describe(spec.run_id), victim["task"])[0]["outcome"].startswith("late")
             and not listed("offline"), "the woken agent's attempt to end late and the agent to be listed again",
             timeout=60)
    # the next run's first round queues a slot per agent, each taken by an idle agent's waiting
    # fetch: the woken one's too (an agent put to sleep *idle* would have taken its slot into
    # the sleep with it — the broker hands a message to a fetch already waiting — which is
    # why the others are not put to sleep here)
    again = submit(pool, tmp_path)
    doc = finish(pool, again, reference)
    assert [a for a in doc["attempts"] if a["worker"] == victim["worker"] and a["outcome"] == "succeeded"]


def test_redis_restart_mid_run(pool, reference, tmp_path):
    spec = submit(pool, tmp_path)
    running_attempt(pool, spec.run_id, settle=1.0)
    pool.redis.stop()   # SIGTERM: redis-server writes its AOF and exits
    time.sleep(2)
    pool.redis.start()  # same port, password and data directory
    finish(pool, spec, reference)


def test_duplicate_delivery_is_ignored(pool, reference, tmp_path):
    spec = submit(pool, tmp_path)
    # once round 0's outer step is done (its evaluation and record come behind round 1's shards,
    # too late to be sure the run still goes on), round 0's slot 1 is delivered again: it is
    # bound to the shard it trained, which is done
    looks = board(pool)

    def stepped() -> bool:
        assert looks.runs.state(spec.run_id) not in ("failed", "cancelled"), looks.describe(spec.run_id).get("error")
        return any(a["task"] == "r0/outer" and a["outcome"] == "succeeded" for a in looks.attempts.all(spec.run_id))

    wait_for(stepped, "round 0 stepped")
    train_slot.apply_async(args=(spec.run_id, 0, 1), kwargs=signed(spec.run_id, "r0/slot-1"))
    doc = finish(pool, spec, reference)
    bound = board(pool).r.hget(layout.run_key(spec.run_id, "slots-r0"), "1")
    dup = [i for i in doc["incidents"] if i["kind"] == "duplicate_ignored"]
    assert [i["task"] for i in dup] == [f"r0/shard-{bound}"]


class FlakyProxy:
    """A TCP proxy to the S3 endpoint that can refuse service for a while."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.down = False
        self.refused = 0
        self.changed = threading.Condition()  # guards down, refused and open
        self.open: set[socket.socket] = set()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            conn, _ = self.sock.accept()
            with self.changed:
                if self.down:
                    self.refused += 1
                    self.changed.notify_all()
                    conn.close()
                    continue
                self.open.add(conn)  # under the lock: an outage starting now cuts it too
            upstream = socket.create_connection(self.target)
            with self.changed:
                self.open.add(upstream)
            for a, b in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            with self.changed:
                self.open.difference_update((a, b))
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def go_down(self) -> None:
        """Refuse new connections and cut the open ones: boto3 keeps connections alive, and a
        pooled one would otherwise carry requests straight through the outage."""
        with self.changed:
            self.down = True
            for s in self.open:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def come_up(self) -> None:
        with self.changed:
            self.down = False

    def wait_refused(self, n: int, timeout: float) -> bool:
        """Until ``n`` connections have been refused (False if ``timeout`` passes first)."""
        with self.changed:
            return self.changed.wait_for(lambda: self.refused >= n, timeout)


# More refusals than the two agents' boto3 clients make for one call each (2 attempts apiece):
# so at least one store call failed outright and was retried by the store's own backoff.
OUTAGE_REFUSALS = 5


def test_s3_outage_is_ridden_out(s3_endpoint, s3_bucket, pool_factory, monkeypatch, reference):
    proxy = FlakyProxy(int(s3_endpoint["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    s3pool = pool_factory(2, f"s3://{s3_bucket}/chaos")
    spec = submit_run(s3pool, **SPEC)
    running_attempt(s3pool, spec.run_id, settle=0)  # the run is in progress: a shard trains
    proxy.go_down()
    try:
        # the outage lasts until the agents have run into it, however slow they are
        refused = proxy.wait_refused(OUTAGE_REFUSALS, timeout=240)
    finally:
        proxy.come_up()
    assert refused, f"the run made only {proxy.refused} store connections during the outage"
    doc = runs.wait(s3pool.broker_url, spec.run_id, timeout_s=300)
    print(f"the outage refused {proxy.refused} connections")
    assert doc["state"] == "succeeded", doc.get("error")
    assert doc["model_sha256"] == reference["model_sha256"]


def test_an_s3_outage_longer_than_the_retries_fails_the_run_and_resume_continues(
        s3_endpoint, s3_bucket, pool_factory, monkeypatch, reference):
    """The reported bug: a long outage left the run `running` with no error, forever."""
    proxy = FlakyProxy(int(s3_endpoint["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setenv("TENSORTURN_STORE_RETRIES", "1")   # the agents give up on a call quickly
    monkeypatch.setenv("TENSORTURN_STORE_BACKOFF_S", "0.1")
    store = f"s3://{s3_bucket}/long-outage"
    s3pool = pool_factory(2, store)
    spec = submit_run(s3pool, **SPEC)
    running_attempt(s3pool, spec.run_id, settle=0)
    proxy.go_down()                                     # and it stays down
    try:
        failed = runs.wait(s3pool.broker_url, spec.run_id, timeout_s=600)
    finally:
        proxy.come_up()
    assert failed["state"] == "failed"
    assert "failed 3 attempts; last: store s3://" in failed["error"]
    assert "\n" not in failed["error"]
    assert not [i for i in failed["incidents"] if i["kind"] == "worker_quarantined"]
    _, what = runs.resume(spec.run_id, s3pool.broker_url, store)
    doc = runs.wait(s3pool.broker_url, spec.run_id, timeout_s=600)
    assert what.startswith("resumed at round")
    assert doc["state"] == "succeeded", doc.get("error")
    assert doc["model_sha256"] == reference["model_sha256"]


CRASHER = '''
import os, signal
from tensorturn.recipes.digits import DigitsMLP

class Crasher(DigitsMLP):
    """Every training attempt kills its own worker process (as an out-of-memory kill would)."""
    def loss(self, model, x, y):
        os.kill(os.getpid(), signal.SIGKILL)
'''


def test_a_task_that_always_kills_its_worker_does_not_loop(tmp_path, pool_factory, monkeypatch):
    (tmp_path / "crasher.py").write_text(CRASHER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    p = pool_factory(1)
    doc = run_to_end(p, mode="fused", recipe="crasher:Crasher", rounds=1, shards=1, sync_every=5)
    assert doc["state"] == "failed"
    assert "failed 3 attempts" in doc["error"]
    tries = attempts_of(doc, "r0/shard-0")
    assert len(tries) == 4 and tries[-1]["outcome"].startswith("refused")
    assert any(i["kind"] == "attempt_limit" for i in doc["incidents"])


NAN_ONCE = '''
import hashlib
import os
import torch
from tensorturn.recipes.digits import DigitsMLP

class NanOnce(DigitsMLP):
    """The first attempt of shard training produces NaN weights; later attempts are sound."""
    def loss(self, model, x, y):
        marker = os.path.join(os.path.dirname(__file__), "poisoned")
        if not os.path.exists(marker):
            open(marker, "w").close()
            return super().loss(model, x, y) * float("nan")
        return super().loss(model, x, y)
'''


def test_non_finite_update_is_rejected_and_retried(tmp_path, pool_factory, monkeypatch):
    (tmp_path / "nan_once.py").write_text(NAN_ONCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    p = pool_factory(1)
    doc = run_to_end(p, mode="fused", recipe="nan_once:NanOnce", rounds=1, shards=2, sync_every=5)
    assert doc["state"] == "succeeded", doc.get("error")
    rejected = [i for i in doc["incidents"] if i["kind"] == "update_rejected"]
    assert len(rejected) == 1 and "non-finite" in rejected[0]["detail"]
    assert sum(1 for a in doc["attempts"] if a["outcome"].startswith("failed")) == 1


def test_an_agent_killed_mid_multipart_upload_leaves_no_object_and_the_task_is_retried(
        s3_bucket, pool_factory, monkeypatch):
    """An upload in parts, frozen half way (SIGSTOP: the parts so far are on S3, the object is
    not), then the agent killed: no object a round could read, and the task runs again on the
    other agent."""
    import boto3

    monkeypatch.setenv("TENSORTURN_PART_MB", "5")  # a 28 MB pseudo-gradient goes in 6 parts
    s3, store = boto3.client("s3"), f"s3://{s3_bucket}/parts"
    s3pool = pool_factory(2, store)
    spec = submit_run(s3pool, mode="fused", recipe="charlm", rounds=1, shards=2,
                      recipe_options={"n_layer": 4, "n_head": 6, "n_embd": 384, "context": 32},
                      sync_every=2, batch_size=4, eval_batches=1, outer="sgd")
    killed = None
    deadline = time.monotonic() + 300
    while killed is None:
        assert time.monotonic() < deadline, "no upload in parts was caught half way"
        assert not board(s3pool).runs.is_finished(spec.run_id), "the run ended before an upload was caught"
        for upload in s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []):
            task = task_of(upload["Key"])
            running = [a for a in board(s3pool).attempts.all(spec.run_id)
                       if a["task"] == task and a["outcome"] == "running"]
            if not running:
                continue
            group = s3pool.agents[agent_index(running[0])].pid
            os.killpg(group, signal.SIGSTOP)
            pending = [u["Key"] for u in s3.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])]
            exists = s3.list_objects_v2(Bucket=s3_bucket, Prefix=upload["Key"])["KeyCount"] > 0
            if upload["Key"] in pending and not exists:  # caught half way: kill it there
                os.killpg(group, signal.SIGKILL)
                killed = (running[0], upload["Key"])
                break
            os.killpg(group, signal.SIGCONT)  # it finished meanwhile: watch the next one
        time.sleep(0.01)
    attempt, key = killed
    assert s3.list_objects_v2(Bucket=s3_bucket, Prefix=key)["KeyCount"] == 0  # nothing to read
    doc = runs.wait(s3pool.broker_url, spec.run_id, timeout_s=300)
    assert doc["state"] == "succeeded", doc.get("error")
    tries = attempts_of(doc, attempt["task"])
    assert tries[0]["outcome"].startswith("lost")
    assert tries[-1]["outcome"] == "succeeded" and tries[-1]["worker"] != attempt["worker"]
    body = s3.get_object(Bucket=s3_bucket, Key=key)  # the retry's upload, whole
    assert hashlib.sha256(body["Body"].read()).hexdigest() == body["Metadata"]["sha256"]


def task_of(key: str) -> str | None:
    """The task whose upload ``key`` is: a shard's pseudo-gradient, or an outer step's θ/state."""
    parts = key.split("/")
    if parts[-1].startswith("shard-"):
        return f"r{int(parts[-2][1:])}/shard-{int(parts[-1][6:9])}"
    if parts[-2] in ("global", "outer"):
        return f"r{int(parts[-1][1:5]) - 1}/outer"
    return None


def stepped_in_a_slot(doc: dict) -> list[str]:
    """The outer steps a slot of the next round took while it waited for θ (its machine's, and
    begun between that slot's start and its training)."""
    shards = [a for a in doc["attempts"] if "/shard-" in a["task"] and a["outcome"] == "succeeded"]
    found = []
    for step in doc["attempts"]:
        if step["task"].endswith("/outer") and step["outcome"] == "succeeded":
            r = int(step["task"][1:].split("/")[0])
            if any(s["task"].startswith(f"r{r + 1}/") and s["worker"] == step["worker"]
                   and s["started_at"] <= step["started_at"] <= s["trained_from"] for s in shards):
                found.append(step["task"])
    return found


def test_an_agent_killed_while_rounds_hand_their_steps_to_the_next_changes_nothing(pool_factory):
    """With rounds short enough (here: any), the next round is queued ahead and one of its
    slots stands by to take the outer step. An agent killed mid-run — standing by, stepping or
    training — is requeued, and the run still gives the fault-free run's model."""
    pool = pool_factory(agents=3, env={"TENSORTURN_QUICK_END_S": "600", "TENSORTURN_VISIBILITY_TIMEOUT_S": "4"})
    spec = dict(mode="fused", recipe="digits-mlp", rounds=6, shards=3, sync_every=40, eval_every=6)
    reference = run_to_end(pool, **spec)
    assert reference["state"] == "succeeded", reference.get("error")
    assert stepped_in_a_slot(reference)  # rounds 1.. hand their steps over
    run = submit_run(pool, **spec)
    victim = running_attempt(pool, run.run_id, round_=2, settle=0.0)
    os.killpg(pool.agents[agent_index(victim)].pid, signal.SIGKILL)
    doc = finish(pool, run, reference)
    assert [r["round"] for r in doc["rounds"]] == list(range(6))
