"""Sealed objects: what a later task reads from the store must be what one of the
run's own tasks stored — checked against a seal signed with the pool key — and an outer step
looks at every pseudo-gradient itself before it steps θ."""

from __future__ import annotations

import json

import pytest
import torch

from tensorturn import layout
from tensorturn.modes.fused.finalize import finalize
from tensorturn.modes.fused.outer import average_and_step
from tensorturn.modes.fused.weights import global_bytes
from tensorturn.recipes import resolve
from tensorturn.spec import RunSpec
from tensorturn.state.manifest import save_spec
from tensorturn.store import seals
from tensorturn.store.objects import open_store, sha256_hex
from tensorturn.store.tensors import delta_bytes, from_bytes
from tensorturn.train import diloco
from tensorturn.train.diloco import UpdateRejected
from tensorturn.trust import PoolKey


@pytest.fixture
def store(tmp_path):
    return open_store((tmp_path / "store").as_uri())


def test_a_sealed_object_reads_back_and_anything_else_is_refused_naming_it(store, tmp_path):
    theta = layout.key("global", "run-a", 1)
    seals.put_bytes(store, theta, b"the weights")
    assert seals.get_bytes(store, theta) == b"the weights"
    seals.get_file(store, theta, tmp_path / "copy")
    assert (tmp_path / "copy").read_bytes() == b"the weights"

    store.put_bytes(theta, b"other weights")  # someone with write access to the store
    with pytest.raises(seals.TamperedObject, match=r"^θ of round 1 \(runs/run-a/global/r0001.safetensors\) "
                                                   r"is not what the run stored .*tampered with or corrupted"):
        seals.get_bytes(store, theta)
    with pytest.raises(seals.TamperedObject, match="is not what the run stored"):
        seals.get_file(store, theta, tmp_path / "copy")


def test_a_seal_is_for_one_key_and_one_pool(store):
    a, b = layout.key("shard", "run-a", 0, 1), layout.key("shard", "run-b", 0, 1)
    seals.put_bytes(store, a, b"delta")
    sha = sha256_hex(b"delta")
    store.put_bytes(b, b"delta")  # the same bytes copied to another run, with a's seal
    store.put_bytes(seals.seal_key(b, sha), store.get_bytes(seals.seal_key(a, sha)))
    with pytest.raises(seals.TamperedObject, match="its seal is another object's"):
        seals.get_bytes(store, b)
    # a seal written without the pool key: tampering (never the reading machine's fault)
    forged = PoolKey.generate().sign_doc(seals.PURPOSE, {"key": b, "sha256": sha, "size": 5})
    store.put_json(seals.seal_key(b, sha), forged)
    with pytest.raises(seals.TamperedObject, match="the pseudo-gradient of shard 1 of round 0 .*: its seal is forged"):
        seals.get_bytes(store, b)
    store.delete(seals.seal_key(b, sha))
    with pytest.raises(seals.TamperedObject, match="no seal for its bytes"):
        seals.get_bytes(store, b)


def test_two_copies_of_a_unit_storing_different_bytes_each_find_their_seal(store):
    """Backup copies and redelivered steps write one key twice; whichever object stays is
    sealed (the seal goes first, one per hash)."""
    key = layout.key("round", "run-a", 0)
    seals.put_json(store, key, {"round": 0, "at": 1.0})
    seals.put_json(store, key, {"round": 0, "at": 2.0})
    assert seals.get_json(store, key) == {"round": 0, "at": 2.0}


def test_seals_live_under_their_run_apart_from_its_objects():
    assert (seals.seal_key("runs/r1/global/r0002.safetensors", "ab12")
            == "runs/r1/seals/global/r0002.safetensors/ab12.json")
    with pytest.raises(ValueError):
        seals.seal_key("datasets/x/v0001.json", "ab12")
    assert seals.describe("runs/r1/members/m02/seg-003.safetensors").startswith("segment 3 of ensemble member 2")


# ---- the outer step's own look at the pseudo-gradients -------------------------------------------

@pytest.fixture
def round0(store):
    """A digits-mlp run with θ_0 stored; ``put(k, delta, samples)`` stores shard k's output of
    round 0, sealed as a trainer of the pool would (so only the outer step's own checks stand
    between it and θ_1)."""
    spec = RunSpec.create(mode="fused", recipe="digits-mlp", store_url=store.url, rounds=2,
                          shards=2, sync_every=10, batch_size=32, outer="nesterov").validate()
    recipe = resolve(spec.recipe)
    theta0 = diloco.initial_state(recipe, spec.seed)
    save_spec(store, spec)
    seals.put_bytes(store, layout.key("global", spec.run_id, 0), global_bytes(spec, recipe, theta0))
    floats = {k: v for k, v in theta0.items() if v.is_floating_point()}

    def put(k: int, delta: dict[str, torch.Tensor] | None = None, samples: int = 320) -> None:
        delta = delta or {name: 1e-3 * torch.ones_like(v) for name, v in floats.items()}
        seals.put_bytes(store, layout.key("shard", spec.run_id, 0, k), delta_bytes(
            delta, "fp32", {"samples": str(samples), "loss": "1.0", "bytes_down": f"{0:015d}"}))

    return spec, floats, put


def test_the_outer_step_refuses_a_pseudo_gradient_claiming_more_samples_than_a_round_has(round0, store, tmp_path):
    spec, _, put = round0
    put(0)
    put(1, samples=10 ** 9)
    with pytest.raises(UpdateRejected, match=r"shard 1 claims 1000000000 samples, not 1\.\.320"):
        average_and_step(spec, store, 0, tmp_path)
    assert not store.exists(layout.key("global", spec.run_id, 1))


def test_the_outer_step_refuses_a_non_finite_or_huge_pseudo_gradient(round0, store, tmp_path):
    spec, floats, put = round0
    put(0)
    nan = {name: torch.full_like(v, float("nan")) for name, v in floats.items()}
    put(1, nan)
    with pytest.raises(UpdateRejected, match="the pseudo-gradient of shard 1 holds NaN/Inf"):
        average_and_step(spec, store, 0, tmp_path)
    huge = {name: 1e6 * torch.ones_like(v) for name, v in floats.items()}
    put(1, huge)
    with pytest.raises(UpdateRejected, match="the pseudo-gradient of shard 1 has norm .* over"):
        average_and_step(spec, store, 0, tmp_path)
    assert not store.exists(layout.key("global", spec.run_id, 1))
    put(1)  # a sound one: the step is taken, θ_1 sealed
    average_and_step(spec, store, 0, tmp_path)
    theta1 = from_bytes(seals.get_bytes(store, layout.key("global", spec.run_id, 1)))
    assert all(bool(torch.isfinite(v).all()) for v in theta1.values())


def test_a_round_record_rewritten_in_the_store_is_refused(round0, store, tmp_path):
    spec, _, put = round0
    key = layout.key("round", spec.run_id, 0)
    seals.put_json(store, key, {"round": 0, "val_loss": 1.5})
    assert seals.get_json(store, key) == {"round": 0, "val_loss": 1.5}
    store.put_bytes(key, json.dumps({"round": 0, "val_loss": 0.0}).encode())  # to steer --keep best
    with pytest.raises(seals.TamperedObject, match="the record of round 0"):
        seals.get_json(store, key)


def test_a_run_never_keeps_weights_that_are_not_finite(round0, store):
    spec, floats, _ = round0
    recipe = resolve(spec.recipe)
    nan = {n: torch.full_like(v, float("nan")) for n, v in floats.items()}
    theta = {**diloco.initial_state(recipe, spec.seed), **nan}
    seals.put_bytes(store, layout.key("global", spec.run_id, 2), global_bytes(spec, recipe, theta))
    with pytest.raises(UpdateRejected, match="the weights after round 1 hold NaN/Inf: no model is kept"):
        finalize(spec, store, board=None)  # type: ignore[arg-type]  # refused before the board
    assert not store.exists(layout.key("final_model", spec.run_id))


def test_the_async_applier_refuses_what_the_outer_step_refuses(round0, store, redis_server):
    """An asynchronous run's applier takes the same outer step with the same look at the update:
    its sample count, its values, its norm against the weights it steps — and commits nothing
    it refused."""
    import redis

    from tensorturn.modes.fused.async_apply import apply_one
    from tensorturn.state.ledger import AsyncLedger

    spec, floats, _ = round0
    book = AsyncLedger(redis.Redis.from_url(redis_server.url, decode_responses=True), spec.run_id)
    theta0 = layout.key("global", spec.run_id, 0)
    book.init(theta0, sha256_hex(store.get_bytes(theta0)))

    def apply(j: int, delta: dict[str, torch.Tensor], samples: int = 320) -> None:
        seals.put_bytes(store, layout.key("update", spec.run_id, j), delta_bytes(delta, "fp32", {
            "samples": str(samples), "loss": "1.0", "bytes_down": f"{0:015d}", "base_version": "0"}))
        book.push(j, "w", float(j))
        with book.lock("w", 30, 10) as token:
            apply_one(spec, store, None, book, j, token, "w")  # type: ignore[arg-type]  # (a sound ledger: no board needed)

    sound = {name: 1e-3 * torch.ones_like(v) for name, v in floats.items()}
    with pytest.raises(UpdateRejected, match=r"update u0 claims 1000000000 samples, not 1\.\.320.*by the applier"):
        apply(0, sound, 10 ** 9)
    with pytest.raises(UpdateRejected, match="update u1 holds NaN/Inf"):
        apply(1, {name: torch.full_like(v, float("nan")) for name, v in floats.items()})
    with pytest.raises(UpdateRejected, match="update u2 has norm .* over"):
        apply(2, {name: 1e6 * torch.ones_like(v) for name, v in floats.items()})
    assert book.latest()["version"] == 0  # nothing committed
    apply(3, sound)
    assert book.latest()["version"] == 1


def test_an_outer_steps_kept_output_is_read_here_only_while_the_run_holds_those_bytes(store, tmp_path):
    """The outer step keeps θ_{r+1} and its state on its machine for its next step (an 86M
    model's 1 GB a round not downloaded again): read back here, checked against its seal; a kept
    file the run does not hold (no seal for its bytes) is dropped and the object downloaded."""
    from tensorturn.modes.fused.ahead import KeptFiles

    def no_download(store, key, path):
        raise AssertionError(f"{key} downloaded")

    kept, theta = KeptFiles(), layout.key("global", "run-k", 2)
    (tmp_path / "next").write_bytes(b"theta two")
    kept.keep("global", theta, tmp_path / "next", seals.put_file(store, theta, tmp_path / "next"))
    assert (tmp_path / "next").read_bytes() == b"theta two"  # left in place for the step's own use
    sha = kept.fetch(no_download)(store, theta, tmp_path / "read")
    assert (tmp_path / "read").read_bytes() == b"theta two" and sha == sha256_hex(b"theta two")

    later = layout.key("global", "run-k", 3)  # the next round's θ takes the kept θ's place
    (tmp_path / "next3").write_bytes(b"theta three")
    kept.keep("global", later, tmp_path / "next3", sha256_hex(b"theta three"))  # never sealed
    assert list(kept.files) == [later]
    store.put_bytes(later, b"theta three, as stored")
    seals.seal(store, later, sha256_hex(b"theta three, as stored"), 22)
    sha = kept.fetch(seals.get_file)(store, later, tmp_path / "read3")
    assert (tmp_path / "read3").read_bytes() == b"theta three, as stored" and later not in kept.files
    folder = kept.folder
    kept.clear()  # the agent's process ends
    assert folder is not None and not folder.exists() and kept.files == {}


def test_the_next_broadcast_is_read_ahead_once_stored_and_checked_against_its_seal(store, monkeypatch):
    """With overlapped rounds a machine's next task starts from the broadcast the outer step
    stores while this task trains: a thread looks for it and downloads it meanwhile; the next
    task takes it (waiting for a download under way), or downloads it itself when nothing was
    read ahead. What the run did not seal is never handed over."""
    from tensorturn.modes.fused import weights

    monkeypatch.setattr(weights, "AHEAD_LOOK_S", 0.01)
    ahead, key, counted = weights.BroadcastAhead(), layout.key("broadcast", "run-b", 4), []
    ahead.start(store, key, counted.append)
    seals.put_bytes(store, key, b"the move")
    assert ahead.look is not None and ahead.look.done.wait(60)
    assert ahead.take(key) == b"the move" and counted[0] >= len(b"the move")  # (its seal's too)
    assert ahead.take(key) is None  # taken once

    never = layout.key("broadcast", "run-b", 5)
    ahead.start(store, never)
    looking = ahead.look
    assert looking is not None and ahead.take(never) is None
    assert looking.done.wait(60)  # the look stops: the task downloads it

    forged = layout.key("broadcast", "run-b", 6)
    ahead.start(store, forged)
    store.put_bytes(forged, b"not the run's")  # no seal
    assert ahead.look is not None and ahead.look.done.wait(60) and ahead.take(forged) is None

    # a look replaced by another never hands over what it read
    first, second = layout.key("broadcast", "run-b", 7), layout.key("broadcast", "run-c", 7)
    seals.put_bytes(store, first, b"run b's move")
    ahead.start(store, first)
    replaced = ahead.look
    assert replaced is not None and replaced.done.wait(60)
    ahead.start(store, second)
    assert ahead.take(first) is None
