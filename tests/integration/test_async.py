"""Asynchronous fused runs (``--sync async``): the delayed-Nesterov math, the applier's fencing,
and a real pool whose applier is killed mid-update."""

from __future__ import annotations

import json

import pytest
import redis
import torch
from conftest import as_agent_of

from tensorturn import layout, runs
from tensorturn.state.ledger import AsyncLedger, Fenced
from tensorturn.tasks.attempt import signed
from tensorturn.train.diloco import async_update, outer_update


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_s_fresh_updates_applied_one_by_one_equal_the_synchronous_outer_step(momentum):
    """With no staleness (every update from the same θ), S updates applied as they arrive —
    the momentum moved once, on the S-th, its movement spread over all S — give the
    synchronous round's Nesterov (or FedAvg) step on their average, three rounds running."""
    gen = torch.Generator().manual_seed(0)
    shards, lr = 4, 0.7
    theta_sync = theta_async = torch.randn(64, generator=gen)
    buf_sync = buf = acc = None
    for _ in range(3):
        deltas = [torch.randn(64, generator=gen) * 0.1 for _ in range(shards)]
        avg = {"w": sum(deltas) / shards}
        new, bufs = outer_update({"w": theta_sync}, avg, {"w": buf_sync} if buf_sync is not None else None,
                                 lr, momentum, nesterov=True)
        theta_sync, buf_sync = new["w"], bufs.get("w")
        for i, d in enumerate(deltas):
            theta_async, buf, acc = async_update(theta_async, d, buf, acc, 1 / shards, lr, momentum,
                                                 momentum_due=i == shards - 1, share=1 / shards)
        assert torch.allclose(theta_async, theta_sync, atol=1e-6)
    if momentum:
        assert torch.allclose(buf, buf_sync, atol=1e-6) and not acc.any()


def test_an_integer_buffer_has_no_update_and_passes_through():
    steps = torch.arange(3)
    assert async_update(steps, None, None, None, 0.25, 0.7, 0.9, True, 0.25)[0] is steps


def test_only_the_lock_holder_commits_each_version_once(redis_server):
    """The applier's commit is fenced: a token that lost the lock, a base version that moved on,
    and an update applied already are each refused, and nothing changes."""
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    book = AsyncLedger(r, "run-x")
    book.init("theta0", "sha0")
    book.push(0, "w1", 1.0)
    book.push(1, "w2", 2.0)
    book.push(0, "w1", 3.0)  # a second push of update 0 changes nothing
    assert book.pending() == [0, 1] and book.trainer(1) == "w2"
    with book.lock("w1", ttl_s=30, refresh_s=10) as token:
        assert token and book.holder() == "w1"
        with book.lock("w2", ttl_s=30, refresh_s=10) as other:
            assert other is None  # one applier at a time
        with pytest.raises(Fenced, match="no longer holds"):
            book.commit("w2:stale", 0, "v1-x", "", "sha1", 0, {"version": 1})
        book.commit(token, 0, "v1", "", "sha1", 0, {"version": 1})
        with pytest.raises(Fenced, match="moved on"):
            book.commit(token, 0, "v1-again", "", "sha1b", 1, {"version": 1})
        with pytest.raises(Fenced, match="applied already"):
            book.commit(token, 1, "v2", "", "sha2", 0, {"version": 2})
        assert book.next_pending() == 1
    assert book.holder() is None
    assert book.latest() == {"version": 1, "key": "v1", "state_key": "", "sha256": "sha1"}
    assert book.version_key(1) == "v1" and [a["version"] for a in book.applied()] == [1]


def test_an_async_run_resumes_from_the_stores_log_after_redis_lost_it(world):
    """Updates driven in-process: two of four applied (round 0 recorded), then Redis loses
    everything; `resume` rebuilds the latest version and the applied updates from the store's
    log, and the other two finish the run — four versions, each made by one update."""
    from tensorturn.modes.fused import update as updates
    from tensorturn.modes.fused.weights import cache

    def update(j: int) -> None:
        as_agent_of(spec)
        updates.async_step.apply(args=(spec.run_id, j),
                                 kwargs=signed(spec.run_id, f"u{j}")).get()

    cache.clear()
    spec = world.submit(mode="fused", recipe="digits-mlp", sync="async", rounds=2, shards=2,
                  sync_every=10)
    update(0)
    update(1)
    assert [r["round"] for r in world.board.rounds.all(spec.run_id)] == [0]
    world.board.r.flushall()
    _, what = runs.resume(spec.run_id, world.broker, spec.store_url)
    assert what == "resumed asynchronously at version 2 of 4"
    update(2)
    update(3)
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "succeeded", doc.get("error")
    assert [(u["version"], u["update"]) for u in doc["updates"]] == [(1, 0), (2, 1), (3, 2), (4, 3)]
    assert [r["round"] for r in doc["rounds"]] == [0, 1]


def test_an_async_run_with_eval_every_evaluates_every_nth_round_and_the_last(world):
    """--sync async --eval-every 2 over 3 rounds of 2 shards: rounds 1 and 2 (the last) carry
    validation figures, round 0 its updates' training figures and staleness only."""
    from tensorturn.modes.fused import update as updates
    from tensorturn.modes.fused.weights import cache

    cache.clear()
    spec = world.submit(mode="fused", recipe="digits-mlp", sync="async", rounds=3, shards=2,
                        sync_every=10, eval_every=2)
    for j in range(6):
        as_agent_of(spec)
        updates.async_step.apply(args=(spec.run_id, j), kwargs=signed(spec.run_id, f"u{j}")).get()
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "succeeded", doc.get("error")
    records = {r["round"]: r for r in doc["rounds"]}
    assert sorted(records) == [0, 1, 2]
    assert records[0]["val_loss"] is None and records[0]["val_rows"] == 0
    assert records[0]["samples"] > 0 and "max_staleness" in records[0]
    assert all(records[r]["val_loss"] is not None and records[r]["val_rows"] > 0 for r in (1, 2))


def test_a_ledger_put_back_from_the_log_applies_again_what_the_log_lacks(redis_server):
    """A ledger rolled back by someone with the broker's password is repaired from
    the store's log: an update applied since, which the log does not hold, is pending again —
    lost work, never a hang or a foreign update."""
    from tensorturn.state.broker import redis_client

    book = AsyncLedger(redis_client(redis_server.url), "run-a")
    book.init("runs/run-a/global/r0000.safetensors", "s0")
    for j in range(3):
        book.push(j, "w1", float(j))
    book.r.zrem(book.k["pending"], "0", "1", "2")
    book.r.hset(book.k["applied"], mapping={str(j): json.dumps({"update": j, "version": j + 1}) for j in range(3)})
    latest = {"version": 2, "key": "runs/run-a/async/versions/v00002-t.safetensors", "state_key": "", "sha256": "s2"}
    book.repair(latest, {0: "k0", 1: "k1", 2: latest["key"]},
                {0: {"update": 0, "version": 1}, 1: {"update": 1, "version": 2}})
    assert book.latest() == latest
    assert book.pending() == [2] and not book.is_applied(2) and book.is_applied(1)


def test_an_update_a_round_behind_the_latest_gets_a_backup_copy_before_all_are_handed_out(world):
    """A slow machine trains u2 from version 6 while the others go on (past the warm-up's first
    round). Once the latest weights are a round (S = 3 versions) past u2's, a machine that
    would train a whole copy sooner by the two rates queues one on its own queue — before every
    update is handed out (the copy trains from the latest weights; landing later, u2 would be
    weighted down and pull the model back). One version fewer, or a machine no faster, and nothing is queued."""
    from tensorturn.modes.fused import update as updates
    from tensorturn.modes.fused.async_versions import ledger

    spec = world.submit(mode="fused", recipe="digits-mlp", sync="async", rounds=4, shards=3, sync_every=10)
    board, run_id = world.board, spec.run_id
    book = ledger(board, run_id)
    fast, slow, peer = "fast@h", "slow@h", "peer@h"
    for worker, rate in ((fast, 400.0), (slow, 40.0), (peer, 40.0)):
        board.r.hset(layout.worker_key(worker), "last_rate", rate)
    for j, base in ((0, 6), (1, 6), (2, 6), (3, 7), (4, 8)):  # 5 of 12 updates handed out
        book.start(j, base)
    board.attempts.begin(run_id, "u2", slow, 3)

    def backups_queued(version: int, worker: str) -> list[dict]:
        board.r.hset(book.k["async"], "version", version)
        updates.queue_update_backup(spec, board, book, worker)
        return [i for i in board.describe(run_id)["incidents"] if i["kind"] == "backup_queued"]

    assert backups_queued(8, fast) == []     # two versions behind: within a round
    assert backups_queued(9, peer) == []     # a round behind, but the peer is no faster
    queued = backups_queued(9, fast)
    assert [(i["task"], i["worker"]) for i in queued] == [("u2/backup", fast)]
    assert "3 versions behind" in queued[0]["detail"]
    assert board.r.llen(layout.agent_queue(fast)) == 1


def test_during_the_first_round_an_update_one_version_behind_gets_a_backup_copy(world):
    """The warm-up: while the latest weights are fewer than S versions in, an update one
    version behind is copied already by a machine that would train it sooner — early updates
    move the weights most, and one landing late there costs the most (1:1:4, 3 shards:
    docs/benchmarks/mixed-speeds.md §12c). Within the same version, or by a machine no faster,
    nothing is queued."""
    from tensorturn.modes.fused import update as updates
    from tensorturn.modes.fused.async_versions import ledger

    spec = world.submit(mode="fused", recipe="digits-mlp", sync="async", rounds=4, shards=3, sync_every=10)
    board, run_id = world.board, spec.run_id
    book = ledger(board, run_id)
    fast, slow, peer = "fast@h", "slow@h", "peer@h"
    for worker, rate in ((fast, 400.0), (slow, 40.0), (peer, 40.0)):
        board.r.hset(layout.worker_key(worker), "last_rate", rate)
    for j in range(3):
        book.start(j, 0)
    board.attempts.begin(run_id, "u2", slow, 3)

    def backups_queued(version: int, worker: str) -> list[dict]:
        board.r.hset(book.k["async"], "version", version)
        updates.queue_update_backup(spec, board, book, worker)
        return [i for i in board.describe(run_id)["incidents"] if i["kind"] == "backup_queued"]

    assert backups_queued(0, fast) == []     # trained from the latest
    assert backups_queued(1, peer) == []     # one behind, but the peer is no faster
    queued = backups_queued(1, fast)
    assert [(i["task"], i["worker"]) for i in queued] == [("u2/backup", fast)]
    assert "1 version behind" in queued[0]["detail"]
