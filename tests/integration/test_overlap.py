"""``--sync overlap``: rounds one step apart, outputs uploaded behind the next round's training.

The result is defined by rounds alone: the same weights on 1 agent and on 3 with one killed, and
an upload whose lease lapses is a shard trained again, to the same weights."""

from __future__ import annotations

import threading

import redis
from conftest import as_agent_of, run_shard, wait_for

from tensorturn import config, layout
from tensorturn.modes.fused import driver, uploads
from tensorturn.modes.fused.sync import overlapped, rounds
from tensorturn.tasks.attempt import signed

SPEC = dict(mode="fused", recipe="digits-mlp", sync="overlap", rounds=3, shards=3, sync_every=150,
            threads_per_task=1)


def test_round_r_trains_from_the_weights_one_round_before():
    policy = overlapped.Overlap()
    assert [policy.shard_plan(r, 0).base for r in range(4)] == [0, 0, 1, 2]
    assert [rounds.Rounds().shard_plan(r, 0).base for r in range(3)] == [0, 1, 2]


def outer_outcome(world, spec, r: int) -> str:
    """Round r's outer step in this process; the outcome its attempt recorded."""
    as_agent_of(spec)
    driver.outer_step.apply(args=([], spec.run_id, r), kwargs=signed(spec.run_id, f"r{r}/outer")).get()
    return [a for a in world.board.attempts.all(spec.run_id) if a["task"] == f"r{r}/outer"][-1]["outcome"]


def drive(world, spec, lose: tuple[int, int] | None = None) -> dict:
    """Every shard and outer step of ``spec`` in this process, in the order an overlapped pool
    runs them (round r+1's shards before round r's outer step); with ``lose`` = (r, k), that
    shard's task ends as that of an agent that died mid-upload would: handed over under a lease
    that lapses, nothing stored — and round r's outer step runs before round r+1's shards (the
    next round of shard k would wait for it). The run's description."""
    board, n = world.board, spec.options.rounds
    for r in range(n + 1):
        lost_before = lose is not None and lose[0] == r - 1
        if lost_before:  # the outer step waits for the upload, and sees its lease lapse
            outcome = outer_outcome(world, spec, r - 1)
            assert outcome.startswith(f"refused: shard {lose[1]} of round {lose[0]}: upload lost"), outcome
            assert lose[1] not in board.uploads.handed(spec.run_id, lose[0])
            run_shard(spec, *lose)  # what the queued train_shard does on some agent
        for k in range(spec.options.shards if r < n else 0):
            if (r, k) == lose:
                board.uploads.hand_over(spec.run_id, r, k, "gone@nowhere", lease_s=0.3)
            else:
                run_shard(spec, r, k)
        if r >= 1:
            outcome = outer_outcome(world, spec, r - 1)
            assert outcome == "succeeded", outcome
    return board.describe(spec.run_id)


def test_an_upload_whose_lease_lapses_is_trained_again_to_the_same_weights(world):
    """Round 1's shard 2 ends as if its agent died mid-upload. Round 1's outer step waits for
    its upload, sees the lease lapse, records ``upload_lost``, gives its claim back and queues
    the shard again (a named shard task); once that is stored the outer step runs, and the
    model is the one an undisturbed run gives."""
    clean = drive(world, world.submit(**SPEC))
    spec = world.submit(**SPEC)
    doc = drive(world, spec, lose=(1, 2))
    assert doc["state"] == "succeeded" and doc["model_sha256"] == clean["model_sha256"]
    lost = [i for i in doc["incidents"] if i["kind"] == "upload_lost"]
    assert [i["task"] for i in lost] == ["r1/shard-2"]
    queued = [m for m in world.board.r.lrange(layout.DEFAULT_QUEUE, 0, -1) + sum(
        (world.board.r.lrange(q, 0, -1) for q in world.board.r.keys("tt.fits.*")), [])
        if "tensorturn.fused.train_shard" in m]
    assert queued, "the lost shard was not queued again"


def finish_uploads() -> None:
    """Wait for this process's background uploads (the in-process world's "agent")."""
    for thread in list(uploads.uploads):
        thread.join()


def test_a_cancelled_overlapped_run_resumes_to_the_model_an_undisturbed_run_gives(world):
    """Cancelled mid-run — θ_1 stored, round 1 two shards in, round 2 not begun — and resumed:
    of round 1's shards, the two stored are found stored and not trained again, the third and
    round 2 are trained, and the model is the one an undisturbed run gives, bit for bit."""
    from tensorturn import runs

    clean = drive(world, world.submit(**SPEC))
    spec = world.submit(**SPEC)
    for k in range(3):
        run_shard(spec, 0, k)
    run_shard(spec, 1, 0)
    run_shard(spec, 1, 1)
    assert outer_outcome(world, spec, 0) == "succeeded"
    finish_uploads()
    runs.cancel(spec.run_id, world.broker, spec.store_url, by="test", wait_s=0)
    assert world.board.runs.state(spec.run_id) == "cancelled"

    _, what = runs.resume(spec.run_id, world.broker, spec.store_url)
    assert what == "resumed at round 1 of 0..2, overlapped"
    for r in (1, 2):  # every shard of rounds 1 and 2, as the tasks resume queues would run them
        for k in range(3):
            run_shard(spec, r, k)
    for r in (1, 2):
        assert outer_outcome(world, spec, r) == "succeeded"
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "succeeded", doc.get("error")
    assert doc["model_sha256"] == clean["model_sha256"]
    trained = sorted(a["task"] for a in doc["attempts"] if a["outcome"] == "succeeded")
    assert trained == sorted(set(trained))  # nothing stored before the cancel was trained again
    assert {"r1/shard-0", "r1/shard-1", "r1/shard-2"} <= set(trained)
    redone = [i["task"] for i in doc["incidents"] if i["kind"] == "duplicate_ignored"]
    assert sorted(redone) == ["r1/shard-0", "r1/shard-1"]  # found stored: nothing retrained


def test_an_agent_keeps_its_outputs_of_the_last_two_rounds_of_its_last_two_runs(tmp_path):
    kept = uploads.KeptOutputs()

    def keep(run: str, r: int, k: int):
        path = tmp_path / f"{run}-{r}-{k}"
        path.write_bytes(b"x")
        kept.keep(run, r, k, path)  # in use (uploading) until released
        kept.release(path)
        return path

    a0, a1, a2 = keep("a", 0, 0), keep("a", 1, 0), keep("a", 2, 0)
    assert not a0.exists() and kept.get("a", 0, 0) is None  # round 0 is two rounds back
    assert kept.get("a", 1, 0) == a1 and kept.get("a", 2, 0) == a2  # each in use until released
    kept.release(a1)
    kept.release(a2)
    keep("b", 0, 0)
    keep("c", 0, 1)  # a third run: run a's files go
    assert not a1.exists() and not a2.exists() and kept.get("a", 2, 0) is None
    for held in (kept.get("b", 0, 0), kept.get("c", 0, 1)):
        assert held is not None
        kept.release(held)
    # a file in use when it is dropped goes when it is released
    busy = tmp_path / "busy"
    busy.write_bytes(b"x")
    kept.keep("d", 0, 0, busy)
    keep("e", 0, 0)
    keep("f", 0, 0)  # run d is dropped while its file is still uploading: it stays until released
    assert kept.get("d", 0, 0) is None and busy.exists()
    kept.release(busy)
    assert not busy.exists()


def test_a_shard_whose_last_round_is_not_there_yet_is_queued_again_without_using_an_attempt(world):
    """Round 1's shard 0 delivered before round 0's shard 0 was trained anywhere (a thief, or
    more agents than shards): it does not wait in its slot (on one agent that slot is the one
    that would train it) — its attempt ends refused, is given back, and the shard is queued
    again a few seconds later."""
    spec = world.submit(**SPEC)
    run_shard(spec, 1, 0)
    attempts = [a for a in world.board.attempts.all(spec.run_id) if a["task"] == "r1/shard-0"]
    assert [a["outcome"] for a in attempts] == [
        "refused: round 1's shard 0 starts from shard 0 of round 0, not stored yet; queued again in 3 s"]
    assert not [i for i in world.board.describe(spec.run_id)["incidents"] if i["kind"] == "upload_lost"]
    run_shard(spec, 0, 0)
    run_shard(spec, 1, 0)  # the attempt given back: this one is number 1 of its allowance again
    assert [a["outcome"] for a in world.board.attempts.all(spec.run_id) if a["task"] == "r1/shard-0"][-1] == "succeeded"


def test_a_shard_whose_last_round_trains_on_another_machine_waits_for_it(world, monkeypatch):
    """Round 1's shard 0 taken while round 0's shard 0 trains elsewhere (its slot bound): the
    task waits for that output instead of going back to the queue for seconds (a 3 s stall a
    round, before), and trains once it is stored."""
    monkeypatch.setattr(uploads, "BIND_GRACE_S", 0.0)  # only a bound shard is waited for,
    # for up to a lease: one long enough that round 0's shard trains within it on busy cores
    monkeypatch.setattr(config, "_current", config.current().with_(visibility_timeout_s=600))
    spec = world.submit(**SPEC)
    world.board.claims.claim_shard(spec.run_id, 0, 0, "elsewhere@host", spec.options.shards)  # r0 slot 0 → shard 0
    waiting = threading.Thread(target=run_shard, args=(spec, 1, 0))
    waiting.start()
    wait_for(lambda: any(a["task"] == "r1/shard-0" for a in world.board.attempts.all(spec.run_id)),
             "round 1's shard 0 to begin")
    run_shard(spec, 0, 0)  # "elsewhere": its output is handed over and uploaded
    waiting.join(timeout=180)
    assert not waiting.is_alive()
    outcomes = [a["outcome"] for a in world.board.attempts.all(spec.run_id) if a["task"] == "r1/shard-0"]
    assert outcomes == ["succeeded"]
    finish_uploads()


def test_an_upload_lease_is_refreshed_and_ended_only_by_its_holder(redis_server):
    from tensorturn.state.uploads import UploadLeases

    claims = UploadLeases(redis.Redis.from_url(redis_server.url, decode_responses=True))
    claims.hand_over("run-x", 0, 1, "a#1", lease_s=30)
    assert claims.uploading("run-x", 0, 1) and claims.handed("run-x", 0) == {1}
    assert not claims.refresh_upload("run-x", 0, 1, "b#2", lease_s=30)  # another upload's token
    claims.upload_ended("run-x", 0, 1, "b#2")
    assert claims.uploading("run-x", 0, 1)
    assert claims.refresh_upload("run-x", 0, 1, "a#1", lease_s=30)
    claims.upload_ended("run-x", 0, 1, "a#1")
    assert not claims.uploading("run-x", 0, 1)
    assert claims.take_back("run-x", 0, 1) and not claims.take_back("run-x", 0, 1)  # one taker



def test_a_hand_over_between_two_looks_is_not_an_upload_lost(world, monkeypatch):
    """Round 1's shard 0 waits for round 0's shard 0, whose task hands its upload over just after
    the waiting task looked at the upload's lease: the waiting task must not take it for an
    upload lost (that trained the shard again and gave the round's outer step back while the
    upload went on). The hand-over sets the lease and the handed set together, so the handed
    set is looked at first."""
    from tensorturn.state.uploads import UploadLeases

    spec = world.submit(**SPEC)
    real = UploadLeases.uploading
    looks = []

    def uploading(self, run_id, r, k):  # round 0's hand-over lands right after the first look at it
        was = real(self, run_id, r, k)
        if r == 0 and not looks:
            self.hand_over(run_id, r, k, "elsewhere#1", 600.0)
        if r == 0:
            looks.append(was)
        return was

    monkeypatch.setattr(UploadLeases, "uploading", uploading)
    monkeypatch.setattr(uploads, "BIND_GRACE_S", 0.0)
    run_shard(spec, 1, 0)
    incidents = [i["kind"] for i in world.board.describe(spec.run_id)["incidents"]]
    outcomes = [a["outcome"] for a in world.board.attempts.all(spec.run_id) if a["task"] == "r1/shard-0"]
    assert looks and "upload_lost" not in incidents
    assert outcomes == ["refused: round 1's shard 0 starts from shard 0 of round 0, not stored yet; "
                        "queued again in 3 s"]


def test_a_shard_taken_back_while_its_upload_goes_on_has_the_round_stepped_once_stored(world, monkeypatch):
    """Round 0's shard 2 is taken back as lost while its upload still goes on (what the race
    above did): the outer step's claim is given back, and the copy queued to train it again finds
    the output in flight and does nothing. Once the upload stores it, the uploader hands it to
    the policy again, and the round's outer step is queued — before, no one queued it, and the
    run stopped making progress."""
    from tensorturn.modes.fused.plans import Context
    from tensorturn.store import seals
    from tensorturn.store.objects import open_store

    spec = world.submit(**SPEC)
    stalled, real_put = threading.Event(), seals.put_file

    def put_file(store, key, path, *args, **kwargs):
        if key == layout.key("shard", spec.run_id, 0, 2):
            assert stalled.wait(60)
        return real_put(store, key, path, *args, **kwargs)

    monkeypatch.setattr(seals, "put_file", put_file)
    for k in range(3):
        run_shard(spec, 0, k)
    claims = layout.run_key(spec.run_id, "claims")
    assert world.board.r.hexists(claims, layout.outer_claim(0))  # queued as round 0's last shard ended
    wires = driver.Driver.of_run(Context(spec, open_store(spec.store_url), world.board))
    assert uploads.train_again(wires, spec, world.board, 0, [2], "judge@nowhere") == [2]
    run_shard(spec, 0, 2)  # the copy queued again: its output is in flight
    assert not world.board.r.hexists(claims, layout.outer_claim(0))
    incidents = [(i["kind"], i["task"]) for i in world.board.describe(spec.run_id)["incidents"]]
    assert ("duplicate_ignored", "r0/shard-2") in incidents

    stalled.set()
    finish_uploads()
    assert world.board.r.hexists(claims, layout.outer_claim(0))
    assert outer_outcome(world, spec, 0) == "succeeded"
