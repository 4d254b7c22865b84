"""An agent that fails every task on the store (wrong S3 endpoint on that machine) among healthy
ones is taken out of rotation with an incident; the run completes on the others."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import clean_env, submit_run, wait_for

from tensorturn import runs
from tensorturn.pool.embedded import free_port, stop_process_group
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import redis_client

pytestmark = [pytest.mark.e2e, pytest.mark.long]


@pytest.mark.parametrize("fault", ["unreachable", "another-store"])
def test_an_agent_failing_on_the_store_is_quarantined_and_the_run_completes(
        s3_endpoint, s3_bucket, tmp_path, pool_factory, fault):
    store = f"s3://{s3_bucket}/q"
    pool = pool_factory(2, store)
    # attempts enough that the bad agent, idle and failing at once, cannot use up a unit's before
    # a good agent's next success shows the store works (on a loaded machine, 3 were: 1 s, 2 s apart)
    spec = submit_run(pool, mode="fused", recipe="digits-mlp", rounds=3, shards=8, sync_every=1500,
                      max_attempts=10)
    board = RunBoard(redis_client(pool.broker_url))
    wait_for(lambda: any(a["outcome"] == "succeeded" for a in board.attempts.all(spec.run_id)),
             "a first attempt succeeded", timeout=600)
    if fault == "unreachable":  # this machine's S3 settings point nowhere
        env = clean_env(TENSORTURN_BROKER_URL=pool.broker_url, TENSORTURN_STORE_URL=store,
                        TENSORTURN_STORE_RETRIES="0", AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}",
                        AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y", AWS_DEFAULT_REGION="us-east-1")
    else:  # it reaches S3, but was given another store than the pool's: the runs are not there
        env = clean_env(TENSORTURN_BROKER_URL=pool.broker_url, TENSORTURN_STORE_URL=f"{store}-elsewhere",
                        TENSORTURN_SHUTDOWN_GRACE_S="1",  # its stop at the end: nothing to hand back
                        **s3_endpoint)
    log = open(tmp_path / "bad-agent.log", "wb")
    bad = subprocess.Popen([sys.executable, "-m", "tensorturn", "agent", "--name", "bad"], env=env,
                           stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           start_new_session=True)
    try:
        if fault == "unreachable":  # it checks its store at start: it never takes a task
            assert bad.wait(timeout=300) == 3
            said = (tmp_path / "bad-agent.log").read_text().strip().splitlines()
            assert len(said) == 1 and said[0].startswith("error: store s3://"), said
            return
        doc = runs.wait(pool.broker_url, spec.run_id, timeout_s=900)
        workers = {w["name"].split("@")[0]: w for w in runs.workers(pool.broker_url)}
    finally:
        stop_process_group(bad, grace=10)

    assert doc["state"] == "succeeded", doc["error"]
    quarantined = [i for i in doc["incidents"] if i["kind"] == "worker_quarantined"]
    assert len(quarantined) == 1 and quarantined[0]["worker"].startswith("bad@")
    assert ("tasks in a row on the object store (wrong credentials or endpoint on that machine?) "
            "while other machines' tasks succeeded") in quarantined[0]["detail"]
    assert workers["bad"]["state"] == "quarantined"
    failed_on_bad = [a for a in doc["attempts"] if a["worker"].startswith("bad@")]
    assert failed_on_bad and all(a["outcome"].startswith("failed: store") for a in failed_on_bad)
