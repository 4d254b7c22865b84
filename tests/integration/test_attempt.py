"""The attempt protocol, in-process: every task of both modes run here against a real
redis-server and a file store, delivered in the orders a real broker can produce — twice, late,
after the unit finished, after the run finished — and failing in every recipe hook and in the
store. Each case must end in a recorded state and change nothing a correct run would not.

The tasks run with Celery's ``apply`` (in this process); what they queue goes to the test's Redis
and is not consumed: this module drives rounds and segments itself, in the order each case needs.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import as_agent_of, wait_for
from conftest import run_outer as outer
from conftest import run_rounds as drive_fused
from conftest import run_shard as shard

from tensorturn import config, layout, runs
from tensorturn.errors import BrokerError, RecipeError
from tensorturn.modes.ensemble import tasks as ensemble
from tensorturn.modes.fused import driver as fused
from tensorturn.modes.fused import shard as fused_shard
from tensorturn.modes.fused import standby
from tensorturn.modes.fused.weights import global_bytes
from tensorturn.recipes import base as recipe_base
from tensorturn.spec import RunSpec
from tensorturn.state.broker import redis_client
from tensorturn.state.manifest import read_manifest
from tensorturn.state.runs import Runs
from tensorturn.store.objects import open_store
from tensorturn.store.tensors import stored_metadata
from tensorturn.tasks.attempt import signed

FUSED = dict(mode="fused", recipe="digits-mlp", rounds=2, shards=2, sync_every=10)
ENSEMBLE = dict(mode="ensemble", recipe="digits-mlp", members=3, segments=2, segment_steps=10)


def segment(spec: RunSpec, m: int, j: int) -> None:
    as_agent_of(spec)
    ensemble.train_segment.apply(args=(spec.run_id, m, j), kwargs=signed(spec.run_id, f"m{m}/seg-{j}")).get()


def vote(spec: RunSpec) -> None:
    as_agent_of(spec)
    ensemble.vote.apply(args=(spec.run_id,), kwargs=signed(spec.run_id, "vote")).get()


def drive_ensemble(spec: RunSpec) -> None:
    for m in range(spec.options.members):  # type: ignore[attr-defined]
        for j in range(spec.options.segments):  # type: ignore[attr-defined]
            segment(spec, m, j)
    vote(spec)


def second_delivery_during(monkeypatch, module, name: str, deliver) -> None:
    """Patch ``module.name`` (a training function) so that the first call runs ``deliver()`` — a
    second delivery of the same task, to its end — before it trains: the first attempt then
    finishes late. Later calls train as usual."""
    real = getattr(module, name)
    delivered = []

    def training(*args, **kwargs):
        if not delivered:
            delivered.append(1)
            deliver()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, training)


def kinds(doc: dict) -> list[str]:
    return [i["kind"] for i in doc["incidents"]]


# ---- duplicate and late deliveries --------------------------------------------------------------

def test_fused_duplicates_at_every_stage_change_nothing(world, monkeypatch):
    clean = world.submit("clean", **FUSED)
    drive_fused(clean)
    expected = world.board.describe(clean.run_id)
    assert expected["state"] == "succeeded"

    spec = world.submit("dup", **FUSED)
    second_delivery_during(monkeypatch, fused_shard, "train_replica", lambda: shard(spec, 0, 0))
    shard(spec, 0, 0)                      # during: the first attempt finishes late
    shard(spec, 0, 1)
    shard(spec, 0, 1)                      # before the outer step: a plain duplicate
    outer(spec, 0)
    shard(spec, 0, 1)                      # after the round
    outer(spec, 0, evaluate=False)         # the outer step delivered twice
    drive_fused(spec, start=1)
    shard(spec, 1, 0)                      # after the run finished
    outer(spec, 1)
    doc = world.board.describe(spec.run_id)

    assert doc["state"] == "succeeded", doc["error"]
    assert doc["model_sha256"] == expected["model_sha256"]
    assert doc["bytes_up"] == expected["bytes_up"]          # nothing counted twice
    assert [r["samples"] for r in doc["rounds"]] == [r["samples"] for r in expected["rounds"]]
    assert [r["val_loss"] for r in doc["rounds"]] == [r["val_loss"] for r in expected["rounds"]]
    assert "late_ignored" in kinds(doc) and kinds(doc).count("duplicate_ignored") == 3


def slot(spec: RunSpec, r: int, i: int) -> None:
    as_agent_of(spec)
    fused.train_slot.apply(args=(spec.run_id, r, i), kwargs=signed(spec.run_id, f"r{r}/slot-{i}")).get()


def test_slots_bind_to_shards_once_and_give_the_model_shards_give(world):
    clean = world.submit("clean", **FUSED)
    drive_fused(clean)
    spec = world.submit("slots", **FUSED)
    for r in range(2):
        slot(spec, r, 1)
        slot(spec, r, 1)                   # a duplicate: bound to the same shard, nothing redone
        slot(spec, r, 0)
        outer(spec, r)
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "succeeded", doc["error"]
    assert doc["model_sha256"] == world.board.describe(clean.run_id)["model_sha256"]
    trained = sorted(a["task"] for a in doc["attempts"] if a["outcome"] == "succeeded")
    assert trained == ["r0/eval", "r0/outer", "r0/shard-0", "r0/shard-1", "r1/outer", "r1/shard-0", "r1/shard-1"]
    assert kinds(doc).count("duplicate_ignored") == 2


@pytest.mark.parametrize("outer,codec,down", [("sgd", "fp32", None), ("nesterov", "fp32", None),
                                              ("nesterov", "int8", None), ("nesterov", "int4", None),
                                              ("nesterov", "ternary", "int4"), ("sgd", "fp32", "int8")])
def test_the_streaming_outer_step_gives_the_list_averages_bits(world, outer, codec, down):
    """The outer step reads one shard and one tensor at a time and writes θ_{r+1} and the
    broadcast the same way; θ_{r+1} must be what averaging the list of all shards' deltas (the
    arithmetic before streaming) and stepping in memory gives, to the bit — for a compressed
    round, θ_r plus the broadcast as :func:`compress_broadcast` encodes it in memory, with the
    residual it leaves. With ``down`` (``--broadcast-codec``) the shards upload in ``codec`` and
    the broadcast comes down in ``down``."""
    from tensorturn import layout
    from tensorturn.recipes import recipe_of
    from tensorturn.store.objects import open_store, sha256_hex
    from tensorturn.store.tensors import delta_from_bytes, from_bytes, metadata_of
    from tensorturn.train.diloco import compress_broadcast, outer_update

    spec = world.submit(f"stream-{outer}-{codec}-{down}", **{**FUSED, "rounds": 3, "shards": 3, "outer": outer,
                                                               "codec": codec, "broadcast_codec": down})
    drive_fused(spec)
    store, recipe, opts = open_store(spec.store_url), recipe_of(spec), spec.options
    compared = 0
    broadcast = down or codec
    for r in range(3):
        assert {metadata_of(store.get_bytes(layout.key("shard", spec.run_id, r, k)))["codec"]
                for k in range(3)} == {codec}
        if broadcast != "fp32" and r + 1 < 3:
            assert metadata_of(store.get_bytes(layout.key("broadcast", spec.run_id, r + 1)))["codec"] == broadcast
        decoded = [delta_from_bytes(store.get_bytes(layout.key("shard", spec.run_id, r, k))) for k in range(3)]
        total = float(sum(int(meta["samples"]) for _, meta in decoded))
        listed: dict = {}
        for delta, meta in decoded:  # the list-based average, as it was written
            w = int(meta["samples"]) / total
            for name, value in delta.items():
                listed[name] = listed[name] + w * value if name in listed else w * value
        theta = from_bytes(store.get_bytes(layout.key("global", spec.run_id, r)))
        state_key = layout.key("outer", spec.run_id, r)
        state = from_bytes(store.get_bytes(state_key)) if r > 0 and store.exists(state_key) else {}
        buf = {k: v for k, v in state.items() if not k.startswith("residual::")} or None
        residual = {k.removeprefix("residual::"): v for k, v in state.items() if k.startswith("residual::")} or None
        nesterov = outer == "nesterov"
        stepped, _ = outer_update(theta, listed, buf, opts.outer_lr, opts.outer_momentum if nesterov else 0.0,
                                  nesterov=nesterov)
        if broadcast != "fp32" and r + 1 < 3:  # the last round's θ is kept exact
            _, stepped, left = compress_broadcast(theta, stepped, residual, broadcast)
            stored = from_bytes(store.get_bytes(layout.key("outer", spec.run_id, r + 1)))  # its residual
            assert all(torch.equal(stored["residual::" + k], v) for k, v in left.items()), r
        expected = sha256_hex(global_bytes(spec, recipe, stepped))
        assert expected == sha256_hex(store.get_bytes(layout.key("global", spec.run_id, r + 1))), r
        compared += 1
    assert compared == 3


def test_a_worker_claims_its_own_shards_first_then_new_ones_then_steals(world):
    board, run = world.board, "affinity"
    claim = lambda r, i, w: board.claims.claim_shard(run, r, i, w, 8)  # noqa: E731
    order = "ABCABCAB"
    round0 = [claim(0, i, w) for i, w in enumerate(order)]
    assert round0 == list(range(8))                      # nobody owns anything: lowest first
    owners = board.claims.shard_owners(run)
    assert [owners[k] for k in range(8)] == list(order)
    assert [claim(1, i, w) for i, w in enumerate("CBA")] == [2, 1, 0]  # each takes its own
    assert claim(1, 0, "B") == 2                         # a redelivered slot keeps its shard ...
    assert board.claims.shard_owners(run)[2] == "B"             # ... and whoever trains it owns it now
    # A is gone: B and C run out of their own shards and steal A's, last first
    rest = [claim(1, i, w) for i, w in zip(range(3, 8), "BCBCB")]
    assert rest == [4, 5, 7, 6, 3]
    assert sorted([2, 1, 0, *rest]) == list(range(8))    # every shard once
    with pytest.raises(RuntimeError, match="no shard left"):
        claim(1, 8, "C")
    # a new run: a worker holding some shards' data (an earlier run's cache) takes those first
    assert [board.claims.claim_shard("again", 0, i, "A", 8, held=[5, 2]) for i in range(3)] == [2, 5, 0]
    # and a thief takes a shard whose data it holds before the busiest owner's last
    for i, w in enumerate("BBBBB", start=3):
        board.claims.claim_shard("again", 0, i, w, 8)           # B: 1, 3, 4, 6, 7
    assert [board.claims.claim_shard("again", 1, i, "C", 8, held=[4]) for i in range(3)] == [4, 7, 6]


def test_ensemble_duplicate_after_a_member_finished_keeps_it_in_the_vote(world):
    """The reported bug: a second delivery of m0/seg-0 after member 0 stored its last
    checkpoint reset it to `running` and left it out of the vote."""
    spec = world.submit(**ENSEMBLE)
    segment(spec, 0, 0)
    segment(spec, 0, 1)                    # member 0 finished
    segment(spec, 0, 0)                    # after its completion
    segment(spec, 1, 0)
    segment(spec, 1, 0)                    # before the next segment
    segment(spec, 1, 1)
    segment(spec, 2, 0)
    segment(spec, 2, 1)
    vote(spec)
    segment(spec, 0, 0)                    # after the run finished
    vote(spec)
    doc = world.board.describe(spec.run_id)

    assert doc["state"] == "succeeded", doc["error"]
    assert doc["metrics"]["members_succeeded"] == 3
    assert [(m["state"], m["segments_done"]) for m in doc["members"]] == [("succeeded", 2)] * 3
    assert kinds(doc).count("duplicate_ignored") == 2


def test_ensemble_late_segment_is_discarded(world, monkeypatch):
    spec = world.submit(**ENSEMBLE)
    second_delivery_during(monkeypatch, ensemble, "train_steps", lambda: segment(spec, 0, 0))
    segment(spec, 0, 0)
    drive_ensemble(spec)
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "succeeded" and doc["metrics"]["members_succeeded"] == 3
    assert "late_ignored" in kinds(doc)


# ---- a recipe that raises ---------------------------------------------------------------------

@pytest.mark.parametrize("mode,hook", [
    ("fused", "raw_data"), ("fused", "loss"), ("fused", "evaluate"),
    ("ensemble", "raw_data"), ("ensemble", "loss"), ("ensemble", "evaluate"),
    ("ensemble", "predict_proba"),
])
def test_a_recipe_that_raises_ends_the_run_with_its_error(world, monkeypatch, mode, hook):
    options = {**(FUSED if mode == "fused" else ENSEMBLE), "recipe": "failing:Failing"}
    spec = world.submit(**options)
    monkeypatch.setenv("TT_FAIL_IN", hook)
    recipe_base._SPLITS.clear()  # raw_data runs again, as on a fresh agent
    (drive_fused if mode == "fused" else drive_ensemble)(spec)
    doc = world.board.describe(spec.run_id)

    assert doc["state"] == "failed"
    assert f"ValueError: boom in {hook}" in doc["error"] and "\n" not in doc["error"]
    failed = [a for a in doc["attempts"] if a["outcome"].startswith("failed")]
    assert failed and all(f"boom in {hook}" in a["outcome"] for a in failed)


@pytest.mark.parametrize("end", ["fused succeeds", "ensemble succeeds", "fused fails", "ensemble fails",
                                 "cancelled"])
def test_whoever_sees_a_run_finished_on_the_board_finds_its_manifest_saying_so(world, monkeypatch, end):
    # the manifest as the store holds it at the moment the board's state moves: `run` prints
    # the board's state, and `serve` or a distillation read the store the moment after
    seen = []
    real = Runs.finish

    def finish(self, run_id, state, pipe=None, **fields):
        seen.append((str(state), read_manifest(open_store(spec.store_url), run_id)["state"]))
        return real(self, run_id, state, pipe, **fields)

    monkeypatch.setattr(Runs, "finish", finish)
    ensemble_run = end.startswith("ensemble")
    options = {**(ENSEMBLE if ensemble_run else FUSED), "recipe": "failing:Failing"}
    spec = world.submit(**options)
    if end.endswith("fails"):
        monkeypatch.setenv("TT_FAIL_IN", "loss" if ensemble_run else "evaluate")
    if end == "cancelled":
        shard(spec, 0, 0)
        runs.cancel(spec.run_id, world.broker, spec.store_url, by="test", wait_s=0)
    else:
        (drive_ensemble if ensemble_run else drive_fused)(spec)
    state = world.board.runs.state(spec.run_id)
    assert state == {"succeeds": "succeeded", "fails": "failed", "cancelled": "cancelled"}[end.split()[-1]]
    assert seen[0] == (state, state), seen
    saved = read_manifest(open_store(spec.store_url), spec.run_id)
    assert saved["state"] == state and saved["finished_at"] == world.board.describe(spec.run_id)["finished_at"]


def test_a_recipe_whose_model_raises_is_refused_before_queueing(world, monkeypatch):
    monkeypatch.setenv("TT_FAIL_IN", "model")
    spec = RunSpec.create(store_url=(world.tmp / "s").as_uri(),
                          **{**FUSED, "recipe": "failing:Failing"})
    with pytest.raises(RecipeError, match="boom in model"):
        runs.submit(spec, world.broker)
    assert not world.board.runs.exists(spec.run_id)


# ---- the store failing, attempt caps, resume ----------------------------------------------------

def test_a_lost_store_fails_the_run_in_one_line_and_resume_continues(world):
    spec = world.submit(**FUSED)
    store_dir = world.tmp / "store"
    shutil.move(store_dir, world.tmp / "away")
    store_dir.write_text("not a directory any more")   # every store call now fails
    shard(spec, 0, 0)
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "failed"
    assert doc["error"].startswith("r0/shard-0 failed 3 attempts; last: store ")
    assert "\n" not in doc["error"]
    assert [a["outcome"].split(":")[0] for a in doc["attempts"]] == ["failed"] * 3

    store_dir.unlink()
    shutil.move(world.tmp / "away", store_dir)          # the store is back
    _, what = runs.resume(spec.run_id, world.broker, spec.store_url)
    assert what.startswith("resumed at round 0")
    drive_fused(spec)
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "succeeded", doc["error"]


def test_a_run_that_failed_on_its_attempt_cap_resumes_once_fixed(world, monkeypatch):
    spec = world.submit(**{**FUSED, "recipe": "failing:Failing"})
    monkeypatch.setenv("TT_FAIL_IN", "loss")
    shard(spec, 0, 0)
    assert world.board.runs.state(spec.run_id) == "failed"
    monkeypatch.delenv("TT_FAIL_IN")                     # the cause is fixed
    runs.resume(spec.run_id, world.broker, spec.store_url)
    drive_fused(spec)
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "succeeded", doc["error"]
    tries = [a for a in doc["attempts"] if a["task"] == "r0/shard-0"]
    assert [a["outcome"].split(":")[0] for a in tries] == ["failed"] * 3 + ["succeeded"]


def test_an_ensemble_member_dropped_for_failures_gets_another_chance_on_resume(world, monkeypatch):
    spec = world.submit(**{**ENSEMBLE, "recipe": "failing:Failing", "min_members": 3})
    monkeypatch.setenv("TT_FAIL_IN", "evaluate")
    monkeypatch.setenv("TT_FAIL_AS", "RuntimeError")  # one a machine may cause: each member drops
    drive_ensemble(spec)
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "failed" and "only 0 of 3 members finished" in doc["error"]
    assert all(m["state"] == "dropped" and "boom in evaluate" in m["reason"] for m in doc["members"])
    monkeypatch.delenv("TT_FAIL_IN")
    runs.resume(spec.run_id, world.broker, spec.store_url)
    for m in range(3):
        segment(spec, m, 1)   # the last segment: stored already, so only evaluated again
    vote(spec)
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "succeeded", doc["error"]
    assert doc["metrics"]["members_succeeded"] == 3


def queued_tasks(world) -> list[tuple[str, str]]:
    """Every task message waiting on the broker: (task name, its arguments as Celery shows them)."""
    import json

    r = world.board.r
    found = []
    for key in r.scan_iter(count=1000):
        if r.type(key) == "list" and not key.startswith(layout.run_key("")):  # (a run's own lists)
            for raw in r.lrange(key, 0, -1):
                headers = json.loads(raw).get("headers", {})
                found.append((headers.get("task", ""), headers.get("argsrepr", "")))
    return found


def outer_steps_queued(world, r: int) -> int:
    return sum(1 for name, args in queued_tasks(world)
               if name == "tensorturn.fused.outer_step" and args.endswith(f", {r})"))


def test_a_stored_shard_whose_follow_up_fails_is_retried_not_failed(world, monkeypatch):
    """What follows a stored shard (queuing the outer step) failing — the broker gone for a
    moment — is retried; the attempt stays succeeded and no attempt of the cap is spent."""
    from celery.exceptions import Retry

    from tensorturn.modes.fused.sync.rounds import Rounds

    spec = world.submit(**FUSED)
    shard(spec, 0, 0)
    real = Rounds.on_output
    monkeypatch.setattr(Rounds, "on_output", lambda *a: (_ for _ in ()).throw(BrokerError("broker gone")))
    as_agent_of(spec)
    with pytest.raises(Retry):
        fused.train_shard.apply(args=(spec.run_id, 0, 1), kwargs=signed(spec.run_id, "r0/shard-1"),
                                throw=True).get()
    monkeypatch.setattr(Rounds, "on_output", real)
    shard(spec, 0, 1)  # the retry: the shard is stored, what follows is queued now
    doc = world.board.describe(spec.run_id)
    assert [a["outcome"] for a in doc["attempts"] if a["task"] == "r0/shard-1"] == ["succeeded"]
    assert outer_steps_queued(world, 0) == 1


def test_a_task_whose_first_look_at_the_broker_fails_is_retried_not_dropped(world, monkeypatch):
    """No chord counts a round's tasks any more, so a task must never end without its shard:
    the broker failing its first look is retried, and nothing is recorded for it."""
    from celery.exceptions import Retry

    from tensorturn.state.board import RunBoard

    spec = world.submit(**FUSED)
    as_agent_of(spec)
    real = RunBoard.state_and_standing
    monkeypatch.setattr(RunBoard, "state_and_standing", lambda *a: (_ for _ in ()).throw(BrokerError("gone")))
    with pytest.raises(Retry):
        fused.train_shard.apply(args=(spec.run_id, 0, 0), kwargs=signed(spec.run_id, "r0/shard-0"),
                                throw=True).get()
    assert world.board.describe(spec.run_id)["attempts"] == []
    monkeypatch.setattr(RunBoard, "state_and_standing", real)
    shard(spec, 0, 0)
    assert [a["outcome"] for a in world.board.describe(spec.run_id)["attempts"]] == ["succeeded"]


def test_a_shard_tasks_own_protocol_is_six_round_trips(world, monkeypatch):
    """On a home link each round trip to the broker costs the RTT: a round's slot task (a short
    one: no progress report) reads the run's state, claims its shard, begins, looks whether the
    run was cancelled before storing, ends and marks its shard stored — one write to the socket
    each. Celery's own message traffic is not in this count (the task is applied in this
    process)."""
    from redis.connection import Connection

    spec = world.submit(**FUSED)
    for k in range(2):
        shard(spec, 0, k)
    outer(spec, 0)
    trips = []
    send = Connection.send_packed_command

    def counted(self, command, check_health=True):
        trips.append(command)
        return send(self, command, check_health)

    monkeypatch.setattr(Connection, "send_packed_command", counted)
    fused.train_slot.apply(args=(spec.run_id, 1, 0), kwargs=signed(spec.run_id, "r1/slot-0")).get()
    monkeypatch.setattr(Connection, "send_packed_command", send)
    assert len(trips) == 6, trips
    assert world.board.describe(spec.run_id)["attempts"][-1]["outcome"] == "succeeded"


def test_the_rounds_last_shard_stored_queues_its_outer_step_once(world):
    """No chord: the shard task that finds every shard of the round stored queues the outer step,
    once, however often shard tasks are delivered; one redelivered after a crash that came
    before the step was queued (the claim given back, the message lost) queues it."""
    spec = world.submit(**FUSED)
    shard(spec, 0, 0)
    assert outer_steps_queued(world, 0) == 0  # one of two shards stored
    shard(spec, 0, 1)
    assert outer_steps_queued(world, 0) == 1
    shard(spec, 0, 1)  # a duplicate delivery: nothing redone, nothing queued again
    shard(spec, 0, 0)
    assert outer_steps_queued(world, 0) == 1
    for queue in world.board.r.scan_iter("tt.*"):  # the message lost, and its claim with it
        world.board.r.delete(queue)
    world.board.claims.release(spec.run_id, layout.outer_claim(0))
    shard(spec, 0, 0)  # the redelivered task of a stored shard
    assert outer_steps_queued(world, 0) == 1
    doc = world.board.describe(spec.run_id)
    assert [i["kind"] for i in doc["incidents"]] == ["duplicate_ignored"] * 3


def test_an_outer_step_queues_its_rounds_evaluation_behind_the_next_round(world):
    """The outer step of a round before the last stores θ_{r+1} and queues the next round's
    shards, then the round's evaluation, once (a second delivery queues nothing); the round is
    recorded by the evaluation, not by the outer step."""
    spec = world.submit(**FUSED)
    shard(spec, 0, 0)
    shard(spec, 0, 1)
    for queue in world.board.r.scan_iter("tt.*"):  # round 0's slots and outer step (run here)
        world.board.r.delete(queue)
    outer(spec, 0, evaluate=False)
    outer(spec, 0, evaluate=False)  # a duplicate: θ_1 is stored
    # in the order agents take them (a queue is pushed at its head, taken at its tail)
    names = [name for name, _ in reversed(queued_tasks(world)) if name]
    assert names == ["tensorturn.fused.train_slot"] * spec.options.shards + ["tensorturn.fused.evaluate"]
    assert not world.board.rounds.has(spec.run_id, 0)
    from conftest import run_eval

    run_eval(spec, 0)
    assert [r["round"] for r in world.board.rounds.all(spec.run_id)] == [0]


def test_an_evaluation_past_its_attempts_leaves_the_round_to_the_last_outer_step(world):
    """A round's evaluation that runs out of attempts does not fail the run: an incident says
    so, and the last round's outer step evaluates that round again before the run finishes."""
    from conftest import run_eval

    spec = world.submit(**{**FUSED, "max_attempts": 1})
    shard(spec, 0, 0)
    shard(spec, 0, 1)
    outer(spec, 0, evaluate=False)
    world.board.attempts.begin(spec.run_id, "r0/eval", "gone@host", 1)  # its machine died mid-way
    run_eval(spec, 0)  # the redelivery: past the cap
    assert world.board.runs.state(spec.run_id) == "running" and not world.board.rounds.has(spec.run_id, 0)
    shard(spec, 1, 0)
    shard(spec, 1, 1)
    outer(spec, 1)
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "succeeded"
    assert [r["round"] for r in doc["rounds"]] == [0, 1]
    assert [i["task"] for i in doc["incidents"] if i["kind"] == "evaluation_given_up"] == ["r0/eval"]
    assert [a["outcome"].split(":")[0] for a in doc["attempts"] if a["task"] == "r0/eval"] == ["lost", "refused"]


# ---- a broker that lost its data; a run that makes no progress ----------------------------------

def test_after_redis_loses_its_data_the_run_says_so_and_resumes(world):
    spec = world.submit(**FUSED)
    shard(spec, 0, 0)
    shard(spec, 0, 1)
    outer(spec, 0)                          # round 0 done, its manifest saved
    world.board.r.flushall()

    doc = runs.describe(spec.run_id, world.broker, spec.store_url)
    assert "the broker has no record of the run" in doc["note"]
    assert f"tensorturn resume {spec.run_id}" in doc["note"]
    listed = runs.list_runs(world.broker, spec.store_url)
    assert [m["run_id"] for m in listed] == [spec.run_id] and "resume" in listed[0]["note"]
    with pytest.raises(BrokerError, match="tensorturn resume"):
        runs.wait(world.broker, spec.run_id, timeout_s=5)

    _, what = runs.resume(spec.run_id, world.broker, spec.store_url)
    assert what.startswith("resumed at round 1")
    drive_fused(spec, start=1)
    assert world.board.runs.state(spec.run_id) == "succeeded"
    assert [r["round"] for r in world.board.rounds.all(spec.run_id)] == [0, 1]


def test_a_run_without_progress_says_why(world):
    spec = world.submit(**FUSED)
    config.use(config.current().with_(stall_s=0.0))
    try:
        doc = runs.describe(spec.run_id, world.broker, spec.store_url)
    finally:
        config.reload()
    assert doc["note"].startswith("no progress for") and "no agent is online" in doc["note"]


def test_a_follow_up_that_fails_to_queue_is_queued_by_the_retry(world, monkeypatch):
    """The claim for round 1 is taken, then queuing it fails (a broker blip): the claim is
    given back and the retried outer step queues the round; the run does not hang."""
    spec = world.submit(**FUSED)
    real_dispatch = fused.dispatch_round
    calls = []

    def flaky_dispatch(spec_, r, board):
        calls.append(r)
        if len(calls) == 1:
            raise ConnectionError("broker went away for a moment")
        real_dispatch(spec_, r, board)

    monkeypatch.setattr(fused, "dispatch_round", flaky_dispatch)
    shard(spec, 0, 0)
    shard(spec, 0, 1)
    outer(spec, 0)
    assert calls == [1, 1]
    assert world.board.r.hexists(f"tt:run:{spec.run_id}:claims", "dispatch-r1")
    monkeypatch.setattr(fused, "dispatch_round", real_dispatch)
    drive_fused(spec, start=1)
    assert world.board.runs.state(spec.run_id) == "succeeded"


def test_an_agent_is_listed_again_at_its_next_heartbeat_after_redis_lost_its_data(world):
    from tensorturn.pool.telemetry import Heartbeat
    from tensorturn.state.roster import list_workers

    beat = Heartbeat.__new__(Heartbeat)          # the bootstep's beat, without a worker around it
    beat.client, beat.node, beat.tref, beat.outer = redis_client(world.broker), "w1@host", None, []
    beat.beat(first=True)
    assert [w["name"] for w in list_workers(beat.client)] == ["w1@host"]
    beat.client.flushall()
    assert list_workers(beat.client) == []
    beat.beat()                                  # the next heartbeat, as every few seconds
    assert [w["name"] for w in list_workers(beat.client)] == ["w1@host"]


def test_listing_agents_scans_a_thousand_keys_a_round_trip(world):
    """Once, `SCAN MATCH tt:worker:*` at Redis's default count took 212 round trips at 2,213
    keys, twice a run; a thousand keys a call, then one pipeline for the hashes."""
    from tensorturn.pool.telemetry import Heartbeat
    from tensorturn.state.roster import list_workers

    client = redis_client(world.broker)
    client.mset({f"other:{i}": i for i in range(3000)})  # runs, queues, results: most keys are not agents
    for node in ("w1@host", "w2@host"):
        beat = Heartbeat.__new__(Heartbeat)
        beat.client, beat.node, beat.tref, beat.outer = client, node, None, []
        beat.beat(first=True)
    calls = lambda name: client.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0)  # noqa: E731
    scans, reads = calls("scan"), calls("hgetall")
    assert [w["name"] for w in list_workers(client)] == ["w1@host", "w2@host"]
    assert calls("scan") - scans <= 4 and calls("hgetall") - reads == 2


def test_a_task_stored_by_two_attempts_is_counted_once(world):
    """A partitioned machine heals and finishes its shard beside the attempt that replaced it,
    both storing the same bytes: the first to finish is the success, the other is late."""
    board = world.board
    first, _, _ = board.attempts.begin("twice", "r0/shard-1", "a@h", 3)
    second, _, _ = board.attempts.begin("twice", "r0/shard-1", "b@h", 3)  # the first was lost
    board.attempts.finish("twice", second, "succeeded")
    board.attempts.finish("twice", first, "succeeded")
    outcomes = {a["worker"]: a["outcome"] for a in board.attempts.all("twice")}
    assert outcomes == {"b@h": "succeeded", "a@h": "late: attempt 2 of this task stored the same output first"}
    board.attempts.finish("twice", second, "succeeded")  # a repeat of the winner's own record
    assert {a["worker"]: a["outcome"] for a in board.attempts.all("twice")}["b@h"] == "succeeded"



def test_every_task_a_machine_finishes_counts_as_done_outer_steps_and_evaluations_too(world):
    """``workers`` DONE and the dashboard's "Tasks done" count what each machine finished — a
    machine beside the store that only steps and evaluates included — and a late copy not."""
    r = world.board.r
    r.set(layout.PRUNE_LOCK, 1)  # pruned a moment ago: this process's tasks have no heartbeat to keep
    spec = world.submit(**FUSED)
    drive_fused(spec)
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "succeeded", doc["error"]
    succeeded = [a for a in doc["attempts"] if a["outcome"] == "succeeded"]
    done: dict[str, int] = {}
    for a in succeeded:
        done[a["worker"]] = done.get(a["worker"], 0) + 1
    kinds_done = {getattr(layout.parse_label(a["task"]), "kind", None) for a in succeeded}
    assert {"shard", "outer", "eval"} <= kinds_done
    assert {w: int(r.hget(layout.worker_key(w), "tasks_done") or 0) for w in done} == done

    board = world.board  # a late copy of a task is not counted again
    first, _, _ = board.attempts.begin("twice", "r0/shard-1", "a@h", 3)
    second, _, _ = board.attempts.begin("twice", "r0/shard-1", "b@h", 3)
    board.attempts.finish("twice", second, "succeeded")
    board.attempts.finish("twice", first, "succeeded")
    assert [r.hget(layout.worker_key(w), "tasks_done") for w in ("a@h", "b@h")] == [None, "1"]


# ---- little data --------------------------------------------------------------------------------

def test_keep_best_keeps_the_round_with_the_lowest_validation_loss(world):
    from tensorturn import layout
    from tensorturn.store.objects import open_store

    spec = world.submit(**{**FUSED, "rounds": 3, "keep": "best"})
    drive_fused(spec)
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "succeeded", doc["error"]
    best = min(doc["rounds"], key=lambda r: (r["val_loss"], -r["round"]))
    assert doc["metrics"]["kept_round"] == best["round"]
    store = open_store(spec.store_url)
    assert store.get_bytes(layout.key("final_model", spec.run_id)) == store.get_bytes(
        layout.key("global", spec.run_id, best["round"] + 1))


def test_eval_every_evaluates_every_nth_round_and_the_last(world):
    """--eval-every 2 over 4 rounds: rounds 1 and 3 are evaluated (3 by the last outer step),
    rounds 0 and 2 recorded by their outer steps with their training figures and no evaluation
    queued; --keep best keeps among the evaluated; the weights are those of every round
    evaluated."""
    every = world.submit(**{**FUSED, "rounds": 4, "keep": "best"}, eval_every=2)
    drive_fused(every)
    doc = world.board.describe(every.run_id)
    assert doc["state"] == "succeeded", doc["error"]
    records = {rec["round"]: rec for rec in doc["rounds"]}
    assert [r for r in sorted(records) if records[r]["val_loss"] is not None] == [1, 3]
    assert all(records[r]["val_rows"] == 0 and records[r]["loss"] > 0 and records[r]["samples"] > 0
               for r in (0, 2))
    assert not {a["task"] for a in world.board.attempts.all(every.run_id)} & {"r0/eval", "r2/eval"}
    for r, queued in ((0, False), (1, True), (2, False)):  # a claim is taken where one is queued
        assert world.board.claims.claim(every.run_id, layout.eval_claim(r)) is not queued
    assert doc["metrics"]["kept_round"] == min((1, 3), key=lambda r: (records[r]["val_loss"], -r))

    each = world.submit("store2", **{**FUSED, "rounds": 4, "keep": "best"})
    drive_fused(each)
    reference = {rec["round"]: rec for rec in world.board.rounds.all(each.run_id)}
    assert [records[r]["val_loss"] for r in (1, 3)] == [reference[r]["val_loss"] for r in (1, 3)]
    assert [records[r]["loss"] for r in range(4)] == [reference[r]["loss"] for r in range(4)]
    kept = open_store(every.store_url).get_bytes(layout.key("final_model", every.run_id))
    assert kept == open_store(each.store_url).get_bytes(
        layout.key("global", each.run_id, doc["metrics"]["kept_round"] + 1))  # evaluation moves no weight


def test_a_shard_with_little_data_for_its_steps_is_warned_about(world):
    spec = world.submit(**{**FUSED, "shards": 8, "sync_every": 200})
    warned = world.board.describe(spec.run_id)["warnings"]
    assert len(warned) == 2
    assert warned[0].startswith("outer optimizer sgd (FedAvg), chosen by --outer auto: each shard goes "
                                "over its rows 39.6 times a round")
    assert "each shard holds about 162 training rows but trains 200 steps × batch 32 per round" in warned[1]
    quiet = world.submit("quiet", **FUSED)
    assert world.board.describe(quiet.run_id)["warnings"] == []
    # --outer auto is decided once, at start, and the spec every machine reads says what it chose
    from tensorturn.state.manifest import load_spec
    from tensorturn.store.objects import open_store

    chosen = {s.run_id: load_spec(open_store(s.store_url), s.run_id).options for s in (spec, quiet)}
    assert (chosen[spec.run_id].outer, chosen[spec.run_id].outer_lr) == ("sgd", 1.0)
    assert (chosen[quiet.run_id].outer, chosen[quiet.run_id].outer_lr) == ("nesterov", 0.7)


def test_a_round_whose_record_was_lost_is_evaluated_again_before_the_run_finishes(world):
    """The outer step queues the next round before it evaluates; if round 0's evaluation never
    got recorded (its machine died, the broker lost it), the last outer step evaluates it again
    from the store, so --keep best chooses among every round and the records are whole."""
    spec = world.submit(**{**FUSED, "rounds": 3}, keep="best")
    drive_fused(spec)
    reference = {rec["round"]: rec["val_loss"] for rec in world.board.rounds.all(spec.run_id)}
    assert sorted(reference) == [0, 1, 2]

    lost = world.submit("store2", **{**FUSED, "rounds": 3}, keep="best")
    for k in range(2):
        shard(lost, 0, k)
    outer(lost, 0)
    world.board.r.hdel(f"tt:run:{lost.run_id}:rounds", "0")   # the record, in Redis and the store
    open_store(lost.store_url).delete(layout.key("round", lost.run_id, 0))
    drive_fused(lost, start=1)
    doc = world.board.describe(lost.run_id)
    assert doc["state"] == "succeeded"
    assert {rec["round"]: rec["val_loss"] for rec in doc["rounds"]} == reference
    assert doc["model_sha256"] == world.board.describe(spec.run_id)["model_sha256"]


# ---- the outer step taken in the task of the round's last shard -----------------------------------

def shard_in_a_worker(spec: RunSpec, r: int, k: int, delivery: str = "delivery-1") -> None:
    """Shard ``k`` of round ``r`` as an agent's worker runs its message ``delivery`` (Celery's
    task id: the same for the message delivered again) — not an eager ``apply``, so the round's
    last shard takes the outer step in its own task."""
    as_agent_of(spec)
    task = fused.train_shard
    task.push_request(id=delivery, hostname="local9@test", is_eager=False, retries=0)
    try:
        task.run(spec.run_id, r, k, **signed(spec.run_id, f"r{r}/shard-{k}"))
    finally:
        task.pop_request()


def test_the_round_s_last_shard_takes_the_outer_step_in_its_own_task(world):
    spec = world.submit(**FUSED)
    shard(spec, 0, 0)
    shard_in_a_worker(spec, 0, 1)
    store = open_store(spec.store_url)
    assert store.exists(layout.key("global", spec.run_id, 1))
    doc = world.board.describe(spec.run_id)
    steps = [a for a in doc["attempts"] if a["task"] == "r0/outer"]
    assert [(a["outcome"], a["worker"]) for a in steps] == [("succeeded", "local9@test")]
    last = next(a for a in doc["attempts"] if a["task"] == "r0/shard-1")
    assert steps[0]["started_at"] >= last["finished_at"] and last["trained_from"] >= last["started_at"]
    assert outer_steps_queued(world, 0) == 0  # no message, no queue hop
    assert sorted(args for name, args in queued_tasks(world) if name == "tensorturn.fused.train_slot"
                  and ", 1, " in args) == [f"('{spec.run_id}', 1, {i})" for i in range(2)]  # round 1 queued


def test_an_outer_step_that_fails_in_the_task_is_queued_for_its_retries(world, monkeypatch):
    """The outer step failing in the last shard's task is an attempt like any (recorded, with
    its traceback); its message is queued then, and its retries finish the round."""
    spec = world.submit(**{**FUSED, "recipe": "failing:Failing", "rounds": 1})  # the last round evaluates
    shard(spec, 0, 0)
    monkeypatch.setenv("TT_FAIL_IN", "evaluate")
    monkeypatch.setenv("TT_FAIL_AS", "RuntimeError")  # a failure a machine may cause: retried
    shard_in_a_worker(spec, 0, 1)
    doc = world.board.describe(spec.run_id)
    failed = [a for a in doc["attempts"] if a["task"] == "r0/outer"]
    assert [a["outcome"].split(":")[0] for a in failed] == ["failed"] and "boom in evaluate" in failed[0]["traceback"]
    assert doc["state"] == "running" and outer_steps_queued(world, 0) == 1
    monkeypatch.delenv("TT_FAIL_IN")
    outer(spec, 0)  # the queued message's delivery
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "succeeded", doc["error"]
    assert [a["outcome"] for a in doc["attempts"] if a["task"] == "r0/outer"][-1] == "succeeded"


def test_a_shard_delivered_again_takes_the_outer_step_its_first_delivery_claimed(world):
    """The machine that took a round's outer step in its shard's task is lost mid-step: the
    shard's message, delivered again (the same task id), holds the claim and steps; another
    task that finds the round complete does not."""
    spec = world.submit(**FUSED)
    shard(spec, 0, 0)
    shard(spec, 0, 1)  # (eager: it queues the outer step's message, which this test drops)
    for key in world.board.r.scan_iter("*"):
        if world.board.r.type(key) == "list":
            world.board.r.delete(key)
    world.board.claims.release(spec.run_id, layout.outer_claim(0))
    world.board.claims.claim_for(spec.run_id, layout.outer_claim(0), "task:lost-one")  # claimed, then lost
    store = open_store(spec.store_url)
    shard_in_a_worker(spec, 0, 1, delivery="another")
    assert not store.exists(layout.key("global", spec.run_id, 1))
    shard_in_a_worker(spec, 0, 1, delivery="lost-one")
    assert store.exists(layout.key("global", spec.run_id, 1))
    assert [a["outcome"] for a in world.board.describe(spec.run_id)["attempts"]
            if a["task"] == "r0/outer"] == ["succeeded"]


def test_the_last_outer_step_waits_in_the_queue_behind_an_evaluation_not_yet_recorded(world):
    """The last round's outer step finishes the run: taken in the shard's task only once every
    earlier round is recorded, else queued behind that round's evaluation (not evaluating the
    round a second time itself)."""
    from conftest import run_eval

    spec = world.submit(**FUSED)  # 2 rounds, every round evaluated
    shard(spec, 0, 0)
    shard(spec, 0, 1)
    outer(spec, 0, evaluate=False)  # round 0's evaluation is queued, not run
    shard(spec, 1, 0)
    shard_in_a_worker(spec, 1, 1)
    assert outer_steps_queued(world, 1) == 1
    assert not [a for a in world.board.describe(spec.run_id)["attempts"] if a["task"] == "r1/outer"]
    run_eval(spec, 0)
    outer(spec, 1)
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "succeeded", doc["error"]
    assert [a["task"] for a in doc["attempts"]].count("r0/eval") == 1


def test_a_slot_queued_ahead_of_its_weights_waits_for_them_and_trains_from_them(world):
    """Round r+1's slots are queued as round r's outer step begins: one that starts before
    θ_{r+1} is stored waits for its announcement, then trains from it."""
    import threading

    spec = world.submit(**FUSED)
    shard(spec, 0, 0)
    shard(spec, 0, 1)
    waiting = threading.Thread(target=shard, args=(spec, 1, 0))
    waiting.start()
    outer(spec, 0, evaluate=False)  # θ_1 stored and announced while shard 0 of round 1 waits
    waiting.join(timeout=60)
    assert not waiting.is_alive()
    doc = world.board.describe(spec.run_id)
    done = [a for a in doc["attempts"] if a["task"] == "r1/shard-0"]
    assert [a["outcome"] for a in done] == ["succeeded"]
    stepped = next(a for a in doc["attempts"] if a["task"] == "r0/outer")
    assert done[0]["started_at"] < stepped["finished_at"] <= done[0]["trained_from"] + 0.5


def test_a_slot_waiting_for_weights_no_outer_step_is_making_goes_back_to_the_queue(world, monkeypatch):
    """θ_{r+1} not stored and round r's outer step not running (it failed, or its machine
    stopped answering): after a grace the slot is queued again a little later, its attempt
    refused (not one of its attempts used), so its machine takes the next message."""
    monkeypatch.setattr(standby, "STEP_GRACE_S", 0.0)
    spec = world.submit(**FUSED)
    shard(spec, 0, 0)
    shard(spec, 0, 1)
    shard(spec, 1, 0)  # round 0's outer step never ran
    tries = [a for a in world.board.describe(spec.run_id)["attempts"] if a["task"] == "r1/shard-0"]
    assert [a["outcome"].split(":")[0] for a in tries] == ["refused"]
    assert "θ_1 is not stored yet (round 0's outer step is not running)" in tries[0]["outcome"]
    assert ("tensorturn.fused.train_shard", f"('{spec.run_id}', 1, 0)") in queued_tasks(world)
    outer(spec, 0, evaluate=False)
    shard(spec, 1, 0)  # the message queued again
    assert [a["outcome"] for a in world.board.describe(spec.run_id)["attempts"]
            if a["task"] == "r1/shard-0"][-1] == "succeeded"


def test_a_slot_waiting_for_weights_is_handed_back_when_its_owner_pauses_the_machine(world, monkeypatch):
    """An owner who pauses the machine gets it back from a slot waiting for θ_{r+1} within
    about a second, as from a training one: the attempt ends handed back, costs none of the
    shard's attempts, and its message goes back to the queue for another machine."""
    import threading

    from celery.exceptions import Retry

    monkeypatch.setattr(standby, "STEP_GRACE_S", 600.0)  # it would wait on: only the owner ends the wait
    monkeypatch.setattr(standby, "WAIT_CAP_S", 600.0)
    spec = world.submit(**{**FUSED, "max_attempts": 1})
    shard(spec, 0, 0)
    shard(spec, 0, 1)  # round 0's outer step is queued, never run: θ_1 does not come
    ended: list[BaseException] = []

    def waits() -> None:
        try:
            shard_in_a_worker(spec, 1, 0)
        except BaseException as exc:  # noqa: BLE001 - what the task raised, for the test to look at
            ended.append(exc)

    waiting = threading.Thread(target=waits, daemon=True)
    waiting.start()
    wait_for(lambda: any(a["task"] == "r1/shard-0" and a["outcome"] == "running"
                         for a in world.board.describe(spec.run_id)["attempts"]), "the slot to wait")
    world.board.r.hset(layout.worker_key("local9@test"), "paused", "owner: game night")
    waiting.join(timeout=60)
    assert not waiting.is_alive() and [type(e) for e in ended] == [Retry]  # Celery queues it again
    tries = [a for a in world.board.describe(spec.run_id)["attempts"] if a["task"] == "r1/shard-0"]
    assert [a["outcome"] for a in tries] == ["handed back: owner: game night"]
    world.board.r.hdel(layout.worker_key("local9@test"), "paused")
    outer(spec, 0, evaluate=False)
    shard(spec, 1, 0)  # delivered again, on a machine at work: its one attempt was not used up
    assert [a["outcome"] for a in world.board.describe(spec.run_id)["attempts"]
            if a["task"] == "r1/shard-0"][-1] == "succeeded"


def test_an_outer_step_past_its_attempts_in_the_task_gives_the_run_up_once(world, monkeypatch):
    """The shard's message delivered again (its machine lost after the step failed there) finds
    the step past its attempt cap: the run fails in that task, as the queued message would, and
    no second message or refusal is added."""
    spec = world.submit(**{**FUSED, "recipe": "failing:Failing", "rounds": 1, "max_attempts": 1})
    shard(spec, 0, 0)
    monkeypatch.setenv("TT_FAIL_IN", "evaluate")
    monkeypatch.setenv("TT_FAIL_AS", "RuntimeError")
    shard_in_a_worker(spec, 0, 1, delivery="lost-one")  # the step fails in the task: its message is queued
    assert outer_steps_queued(world, 0) == 1
    shard_in_a_worker(spec, 0, 1, delivery="lost-one")
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "failed" and "r0/outer failed 1 attempts" in doc["error"]
    assert outer_steps_queued(world, 0) == 1
    assert kinds(doc).count("attempt_limit") == 1


# ---- the outer step taken by a slot of the next round ---------------------------------------------

def attempts_of(world, spec: RunSpec, task: str) -> list[dict]:
    return [a for a in world.board.describe(spec.run_id)["attempts"] if a["task"] == task]


def step_claim(world, spec: RunSpec, r: int) -> str | None:
    return world.board.r.hget(layout.run_key(spec.run_id, "claims"), layout.outer_claim(r))


def test_a_slot_of_the_next_round_takes_the_step_its_round_left_and_trains_from_it(world):
    """Where the round's last shard task left the outer step to the next round (a short round:
    its slots queued at once), the first slot to start finds the round complete and the step
    unclaimed, takes it in its own task — an attempt recorded as a queued one's — and trains
    from θ_{r+1} kept in memory (nothing downloaded); the round's record follows its first step.
    The weights are those of a run whose steps were queued."""
    fields = {**FUSED, "eval_every": 2}
    queued = world.submit("queued", **fields)
    drive_fused(queued)
    spec = world.submit(**fields)
    shard(spec, 0, 0)
    shard(spec, 0, 1)
    world.board.claims.release(spec.run_id, layout.outer_claim(0))  # left to the next round, as a short round's is
    slot(spec, 1, 0)
    outer_attempts = attempts_of(world, spec, "r0/outer")
    assert [a["outcome"] for a in outer_attempts] == ["succeeded"]
    trained = [a for a in attempts_of(world, spec, "r1/shard-0") + attempts_of(world, spec, "r1/shard-1")]
    assert [a["outcome"] for a in trained] == ["succeeded"]
    assert trained[0]["worker"] == outer_attempts[0]["worker"]
    store, other = open_store(spec.store_url), open_store(queued.store_url)
    k = int(trained[0]["task"][-1])
    assert int(stored_metadata(store, layout.key("shard", spec.run_id, 1, k))["bytes_down"]) == 0
    assert [rec["round"] for rec in world.board.rounds.all(spec.run_id)] == [0]  # the deferred record
    ours, theirs = layout.key("global", spec.run_id, 1), layout.key("global", queued.run_id, 1)
    assert store.get_bytes(ours) == other.get_bytes(theirs)


def test_a_slot_queued_ahead_stands_by_and_steps_as_soon_as_the_round_completes(world, monkeypatch):
    """A slot of round r+1 queued while round r's last shard still trains claims the step and
    stands by, reading the step's inputs stored so far (the first shard, θ_r); the last shard
    stored wakes it (``announce_complete``) and it takes the step — no message queued for it —
    reading only that shard then. The weights are those of a run whose steps were queued."""
    import threading

    from tensorturn.modes.fused import ahead as fused_ahead

    fields = {**FUSED, "eval_every": 2}
    queued = world.submit("queued", **fields)
    drive_fused(queued)
    spec = world.submit(**fields)
    handed, real_fetch = [], fused_ahead.ReadAhead.fetch

    def fetch(self, store, key, path):
        handed.append((key, key in self.files))  # (read ahead?)
        return real_fetch(self, store, key, path)

    monkeypatch.setattr(fused_ahead.ReadAhead, "fetch", fetch)
    queued_before = outer_steps_queued(world, 0)  # (by the other run)
    shard(spec, 0, 0)
    waiter = threading.Thread(target=slot, args=(spec, 1, 0))
    waiter.start()
    wait_for(lambda: step_claim(world, spec, 0), "the slot standing by to claim round 0's step")
    shard(spec, 0, 1)  # (applied here, it leaves the queuing to the claim's holder)
    world.board.announcements.announce_complete(spec.run_id, 0)  # what the last shard task of a short round does
    waiter.join(timeout=300)
    assert not waiter.is_alive()
    assert [a["outcome"] for a in attempts_of(world, spec, "r0/outer")] == ["succeeded"]
    assert outer_steps_queued(world, 0) == queued_before
    run = spec.run_id
    assert sorted(handed) == sorted([(layout.key("shard", run, 0, 0), True), (layout.key("shard", run, 0, 1), False),
                                     (layout.key("global", run, 0), True)])
    store, other = open_store(spec.store_url), open_store(queued.store_url)
    assert store.get_bytes(layout.key("global", run, 1)) == other.get_bytes(layout.key("global", queued.run_id, 1))


def test_reading_ahead_stops_at_a_failure_or_its_bytes_and_the_step_reads_the_rest(world, monkeypatch):
    """What the standby reads ahead is bounded (:data:`READ_AHEAD_BYTES`: once over it, nothing
    more is read); a store that fails stops the reading ahead without failing the slot, and the
    step then downloads what was not read; a cancel seen between downloads stops the slot."""
    from tensorturn.modes.fused import ahead as fused_ahead
    from tensorturn.store import seals
    from tensorturn.tasks.attempt import RunCancelled

    spec = world.submit(**FUSED)
    shard(spec, 0, 0)
    shard(spec, 0, 1)
    store, run = open_store(spec.store_url), spec.run_id
    shards = [layout.key("shard", run, 0, k) for k in (0, 1)]

    monkeypatch.setattr(fused_ahead, "READ_AHEAD_BYTES", 1)  # full after one file
    ahead = fused_ahead.ReadAhead(spec, store, 0)
    ahead.read({0, 1})
    assert list(ahead.files) == shards[:1]
    ahead.close()
    assert not ahead.files and ahead.folder is None
    monkeypatch.undo()

    real, reads = seals.get_file, []

    def flaky(store_, key, path):
        reads.append(key)
        if key == shards[1]:
            raise OSError("connection reset")
        return real(store_, key, path)

    monkeypatch.setattr(seals, "get_file", flaky)
    ahead = fused_ahead.ReadAhead(spec, store, 0)
    ahead.read({0, 1})
    assert ahead.stopped and list(ahead.files) == shards[:1]
    ahead.read({0, 1})  # stopped: nothing more is tried
    assert reads == shards
    monkeypatch.setattr(seals, "get_file", real)
    folder = ahead.folder
    assert ahead.fetch(store, shards[0], folder / "got-0") == ahead.fetch(store, shards[0], folder / "again-0")
    assert (folder / "got-0").read_bytes() == store.get_bytes(shards[0])
    ahead.close()
    assert not folder.exists()

    def cancelled() -> None:
        raise RunCancelled("cancelled")

    ahead = fused_ahead.ReadAhead(spec, store, 0, check=cancelled)
    with pytest.raises(RunCancelled):
        ahead.read({0, 1})
    ahead.close()


def test_a_slot_that_stops_standing_by_gives_the_step_back_and_is_queued_again(world, monkeypatch):
    """A slot that stood by past its cap — the round's last shard still not stored — gives the
    step's claim back (the next slot to start, or one that waits, takes it) and is queued again,
    its attempt refused at no cost."""
    spec = world.submit(**FUSED)
    shard(spec, 0, 0)
    monkeypatch.setattr(standby, "WAIT_CAP_S", 0.5)
    slot(spec, 1, 0)
    assert step_claim(world, spec, 0) is None
    assert [a["outcome"].split(":")[0] for a in attempts_of(world, spec, "r1/shard-0")] == ["refused"]
    assert ("tensorturn.fused.train_shard", f"('{spec.run_id}', 1, 0)") in queued_tasks(world)


def test_an_outer_step_that_fails_in_a_slot_is_queued_and_the_slot_given_back(world, monkeypatch):
    """The step failing in the slot that took it is recorded failed and queued as a message (its
    retries and cap as ever); the slot is given back, to train once θ_{r+1} is stored."""
    from tensorturn.modes.fused import outer as fused_outer

    spec = world.submit(**FUSED)
    shard(spec, 0, 0)
    shard(spec, 0, 1)
    world.board.claims.release(spec.run_id, layout.outer_claim(0))
    queued = outer_steps_queued(world, 0)  # (the shard applied here queued one as it claimed)
    real = fused_outer.average_and_step
    monkeypatch.setattr(fused_outer, "average_and_step", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
    slot(spec, 1, 0)
    assert [a["outcome"].split(":")[0] for a in attempts_of(world, spec, "r0/outer")] == ["failed"]
    assert [a["outcome"].split(":")[0] for a in attempts_of(world, spec, "r1/shard-0")] == ["refused"]
    assert outer_steps_queued(world, 0) == queued + 1
    monkeypatch.setattr(fused_outer, "average_and_step", real)
    outer(spec, 0)  # the queued message
    shard(spec, 1, 0)
    assert attempts_of(world, spec, "r1/shard-0")[-1]["outcome"] == "succeeded"


def test_a_rounds_end_is_timed_and_its_step_claimed_only_by_one(world):
    """The broker times a round's end — its second-to-last shard stored to the next weights
    announced — for the next round's shards to read; the step's claim says which of the round's
    shards are stored, is held by one holder, and is given back only by it."""
    claims, run = world.board.claims, "r-ends"
    assert claims.note_stored(run, 0, 0, "a", 3) == (1, None)
    claims.note_stored(run, 0, 1, "b")  # marked first where backup copies look (--sync backup)
    claims.note_stored(run, 0, 1, "b", 3)  # then counted: the second-to-last, timed
    assert claims.claim_step(run, 0, "step", "task:x") == (True, {0, 1})  # standing by
    assert claims.claim_step(run, 0, "step", "task:y") == (False, {0, 1})
    assert claims.release_unless_complete(run, 0, 3, "step", "task:x")  # gives up, the round incomplete
    assert claims.claim_step(run, 0, "step", "task:x") == (True, {0, 1})  # stands by again
    claims.note_stored(run, 0, 2, "c", 3)
    assert not claims.release_unless_complete(run, 0, 3, "step", "task:x")  # complete: it keeps the step
    assert claims.claim_step(run, 0, "step", "task:x") == (True, {0, 1, 2})
    claims.release_if_held(run, "step", "task:y")  # not its holder: nothing given back
    assert claims.claim_step(run, 0, "step", "task:y") == (False, {0, 1, 2})
    claims.release_if_held(run, "step", "task:x")
    assert claims.claim_step(run, 0, "step", "task:y") == (True, {0, 1, 2})
    world.board.announcements.announce_global(run, 1)
    count, end = claims.note_stored(run, 1, 0, "a", 3)
    assert count == 1 and end is not None and end >= 0


def test_a_standing_look_between_downloads_keeps_the_pace_of_a_cancel_look():
    """check_standing(now=False) asks the broker once per CANCEL_LOOK_S at most, as a cancel
    look does; a plain check_standing always asks."""
    from types import SimpleNamespace

    from tensorturn.tasks.attempt import Attempt

    asked = []
    board = SimpleNamespace(state_and_standing=lambda run_id, worker: asked.append(run_id) or ("running", None, None))
    a = Attempt(task=None, board=board, store=None, spec=SimpleNamespace(run_id="r"), label=None, worker="w")
    a.check_standing()
    a.check_standing(now=False)  # just looked: no round trip
    assert len(asked) == 1
    a.looked_at -= 2  # a while ago
    a.check_standing(now=False)
    a.check_standing()
    assert len(asked) == 3
