"""Compressed downloads in fused mode: the broadcast delta θ_r − θ_{r−1}, error feedback, and the
order in which a shard task looks for θ_r (held, seed, broadcast, full file) — with a real store."""

from __future__ import annotations

import pytest
import torch

from tensorturn import layout
from tensorturn.modes.fused import weights
from tensorturn.modes.fused.outer import step_global
from tensorturn.modes.fused.step import RESIDUAL
from tensorturn.modes.fused.weights import fetch_global, global_bytes
from tensorturn.recipes import resolve
from tensorturn.spec import RunSpec
from tensorturn.store import seals
from tensorturn.store.objects import open_store, sha256_hex
from tensorturn.store.tensors import from_bytes, metadata_of, to_bytes
from tensorturn.train import diloco


def test_error_feedback_keeps_the_rebuilt_weights_on_the_exact_trajectory():
    torch.manual_seed(0)
    exact = {"w": torch.randn(50, 40), "b": torch.randn(40), "steps": torch.tensor(3)}
    theta, residual = {k: v.clone() for k, v in exact.items()}, None
    for _ in range(30):
        move = {"w": 1e-2 * torch.randn(50, 40), "b": 1e-2 * torch.randn(40)}
        exact = diloco.apply_step(exact, move)
        _, theta, residual = diloco.compress_broadcast(theta, diloco.apply_step(theta, move),
                                                      residual, "int8")
        # what was not sent is carried: rebuilt + residual is the exact trajectory
        for k in ("w", "b"):
            assert torch.allclose(theta[k] + residual[k], exact[k], atol=1e-5)
    assert theta["steps"].item() == 3 and theta["steps"].dtype == torch.int64
    # the residual stays within one quantization step; it does not grow with the rounds
    assert max(residual[k].abs().max().item() for k in residual) < 0.01


def test_without_error_feedback_the_error_would_accumulate():
    torch.manual_seed(0)
    exact = {"w": torch.zeros(4096)}
    fed, plain, residual = dict(exact), dict(exact), None
    for _ in range(50):
        move = {"w": 1e-3 + 1e-2 * torch.rand(4096) ** 8}   # biased: rounding errs one way
        exact = diloco.apply_step(exact, move)
        _, fed, residual = diloco.compress_broadcast(fed, diloco.apply_step(fed, move), residual,
                                                    "int8")
        _, plain, _ = diloco.compress_broadcast(plain, diloco.apply_step(plain, move), None, "int8")
    err_fed = (fed["w"] - exact["w"]).abs().mean().item()
    err_plain = (plain["w"] - exact["w"]).abs().mean().item()
    assert err_fed < 0.2 * err_plain


@pytest.fixture(params=["int8", "int4", "ternary", "int2"])
def run(tmp_path, request):
    """A digits-mlp run's θ_0 and θ_1 in a real file store, as ``fused`` writes them, with each
    quantising codec."""
    store = open_store((tmp_path / "store").as_uri())
    spec = RunSpec.create(mode="fused", recipe="digits-mlp", store_url=store.url, codec=request.param,
                          outer="nesterov", rounds=3).validate()
    recipe = resolve(spec.recipe)
    theta0 = diloco.initial_state(recipe, spec.seed)
    blob0 = global_bytes(spec, recipe, theta0)
    spec.options.init_sha256 = sha256_hex(blob0)  # type: ignore[attr-defined]
    store.put_json(f"runs/{spec.run_id}/spec.json", spec.to_json())
    seals.put_bytes(store, layout.key("global", spec.run_id, 0), blob0)
    torch.manual_seed(1)
    avg = {k: 1e-2 * torch.randn_like(v) for k, v in theta0.items() if v.is_floating_point()}
    step_global(spec, recipe, store, 0, avg)
    theta1 = from_bytes(store.get_bytes(layout.key("global", spec.run_id, 1)))
    weights.cache.clear()
    yield spec, recipe, store, theta0, theta1
    weights.cache.clear()


def test_shard_tasks_fetch_the_fewest_bytes(run):
    spec, recipe, store, theta0, theta1 = run
    # round 0: rebuilt from the seed, verified against init_sha256 — nothing downloaded
    got, moved = fetch_global(spec, recipe, store, 0)
    assert moved == 0 and all(torch.equal(got[k], theta0[k]) for k in theta0)
    # round 1 while holding θ_0: only the compressed broadcast delta comes down
    got, moved = fetch_global(spec, recipe, store, 1)
    broadcast = store.get_bytes(layout.key("broadcast", spec.run_id, 1))
    full = store.get_bytes(layout.key("global", spec.run_id, 1))
    ratio = {"int8": 3.5, "int4": 6, "ternary": 12, "int2": 11}[spec.options.codec]
    assert moved == len(broadcast) and len(full) > ratio * len(broadcast)
    assert to_bytes(got) == to_bytes(from_bytes(full))           # bit for bit the stored θ_1
    assert all(torch.equal(got[k], theta1[k]) for k in theta1)
    # a second shard of round 1 in this process: nothing moves
    assert fetch_global(spec, recipe, store, 1)[1] == 0
    # the outer state carries the broadcast's residual beside the momentum
    state = from_bytes(store.get_bytes(layout.key("outer", spec.run_id, 1)))
    assert any(k.startswith(RESIDUAL) for k in state)
    assert any(not k.startswith(RESIDUAL) for k in state)


def flipped(blob: bytes) -> bytes:
    """A broadcast whose codes are reversed, its metadata (and claimed sha256) kept."""
    packed = from_bytes(blob)
    for name in packed:
        if name.endswith("@q"):
            packed[name] = torch.flip(packed[name], [0])
    return to_bytes(packed, metadata_of(blob))


def test_a_delta_that_does_not_rebuild_the_stored_weights_costs_bytes_not_correctness(run):
    spec, recipe, store, theta0, theta1 = run
    fetch_global(spec, recipe, store, 0)
    # a broadcast whose values rebuild another θ_1 here (its claimed sha256 stays), stored and
    # sealed by the run (as another machine's arithmetic might): the rebuilt θ_1 would differ
    key = layout.key("broadcast", spec.run_id, 1)
    seals.put_bytes(store, key, flipped(store.get_bytes(key)))
    got, moved = fetch_global(spec, recipe, store, 1)
    full = store.get_bytes(layout.key("global", spec.run_id, 1))
    assert moved == len(store.get_bytes(key)) + len(full)
    assert to_bytes(got) == to_bytes(from_bytes(full))
    assert all(torch.equal(got[k], theta1[k]) for k in theta1)


def test_a_seed_that_does_not_rebuild_theta0_falls_back_to_the_file(run):
    spec, recipe, store, theta0, _ = run
    spec.options.init_sha256 = "0" * 64  # type: ignore[attr-defined]  # as if this machine's torch initialized differently
    got, moved = fetch_global(spec, recipe, store, 0)
    assert moved == len(store.get_bytes(layout.key("global", spec.run_id, 0)))
    assert all(torch.equal(got[k], theta0[k]) for k in theta0)


def test_a_broadcast_rewritten_in_the_store_fails_naming_it(run):
    """Bytes no task of the run stored are refused, not used."""
    spec, recipe, store, _, _ = run
    fetch_global(spec, recipe, store, 0)
    key = layout.key("broadcast", spec.run_id, 1)
    store.put_bytes(key, flipped(store.get_bytes(key)))  # someone with store write access
    with pytest.raises(seals.TamperedObject,
                       match=r"the broadcast delta of round 1 \(runs/.*\) is not what the run stored"):
        fetch_global(spec, recipe, store, 1)
