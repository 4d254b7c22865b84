"""The one outer step (``modes/fused/step.py``) through files, against the in-memory list forms in
``train/diloco.py`` that define its bits: a round's step (Nesterov, SGD; with a compressed
broadcast and its residual), an asynchronous run's updates (delayed Nesterov), and its look at
an update before it writes anything."""

from __future__ import annotations

import pytest
import torch

from tensorturn.modes.fused.step import (
    ACCUMULATED,
    MOMENTUM,
    RESIDUAL,
    Broadcast,
    Delayed,
    InputCheck,
    Synchronous,
    outer_step,
)
from tensorturn.store.objects import file_sha256
from tensorturn.store.tensors import from_bytes, metadata_of, to_bytes
from tensorturn.train.diloco import UpdateRejected, async_update, compress_broadcast, outer_update

META = {"format": "test"}


def weights(seed: int) -> dict[str, torch.Tensor]:
    """θ of mixed dtypes: float32, float16 and an integer buffer."""
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 4, generator=gen), "b": torch.randn(4, generator=gen),
            "h": torch.randn(3, generator=gen).half(), "steps": torch.tensor([7, 9])}


def move(theta: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: 1e-2 * torch.randn(v.shape, generator=gen) for k, v in theta.items() if v.is_floating_point()}


@pytest.mark.parametrize("nesterov,momentum,codec", [(True, 0.9, None), (False, 0.0, None),
                                                      (True, 0.9, "int8"), (False, 0.0, "int4"),
                                                      (True, 0.9, "int2")])
def test_a_rounds_step_gives_the_list_forms_bits(tmp_path, nesterov, momentum, codec):
    theta = weights(0)
    buf = move(theta, 1) if momentum else None
    residual = {k: 1e-4 * v for k, v in move(theta, 2).items()} if codec else None
    state = {**(buf or {}), **{RESIDUAL + k: v for k, v in (residual or {}).items()}}
    (tmp_path / "theta").write_bytes(to_bytes(theta, META))
    if state:
        (tmp_path / "state").write_bytes(to_bytes(state))
    delta = move(theta, 3)

    files = outer_step(tmp_path, tmp_path / "theta", tmp_path / "state" if state else None, dict(delta),
                       Synchronous(0.7, momentum, nesterov), META,
                       broadcast=Broadcast(codec, "base") if codec else None)

    stepped, new_buf = outer_update(theta, delta, buf, 0.7, momentum, nesterov)
    kept = {**new_buf}
    if codec:
        packed, stepped, left = compress_broadcast(theta, stepped, residual, codec)
        kept.update({RESIDUAL + k: v for k, v in left.items()})
        assert files.broadcast is not None
        data = files.broadcast.read_bytes()
        sent, meta = from_bytes(data), metadata_of(data)
        assert sent.keys() == packed.keys() and all(torch.equal(sent[k], packed[k]) for k in packed)
        assert meta["sha256"] == file_sha256(files.next) and meta["base_sha256"] == "base"
        assert files.broadcast.read_bytes() == to_bytes(packed, meta)  # the header written last: still canonical
    else:
        assert files.broadcast is None
    assert files.next.read_bytes() == to_bytes(stepped, META)
    if kept:
        assert files.state is not None
        assert files.state.read_bytes() == to_bytes(kept)
    else:
        assert files.state is None


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_asynchronous_updates_give_the_per_tensor_forms_bits(tmp_path, momentum):
    theta = weights(0)
    held = {k: v.clone() for k, v in theta.items()}
    buf: dict[str, torch.Tensor | None] = dict.fromkeys(held)
    acc: dict[str, torch.Tensor | None] = dict.fromkeys(held)
    (tmp_path / "theta").write_bytes(to_bytes(theta, META))
    state = None
    shards = 2
    for i in range(3):
        delta, weight, due = move(theta, 10 + i), 0.4 + 0.1 * i, i % shards == shards - 1
        files = outer_step(tmp_path, tmp_path / "theta", state, delta,
                           Delayed(0.7, momentum, weight, due, 1 / shards), META)
        for k in held:
            held[k], buf[k], acc[k] = async_update(held[k], delta.get(k), buf[k], acc[k], weight, 0.7,
                                                   momentum, due, 1 / shards)
        assert files.next.read_bytes() == to_bytes(held, META)
        if momentum:
            assert files.state is not None
            expected = {p + k: (v if v is not None else torch.zeros_like(delta[k]))
                        for k in delta for p, v in ((MOMENTUM, buf[k]), (ACCUMULATED, acc[k]))}
            assert files.state.read_bytes() == to_bytes(expected)
            files.state.rename(tmp_path / "state")
            state = tmp_path / "state"
        else:
            assert files.state is None
        files.next.rename(tmp_path / "theta")


def test_an_update_too_large_for_the_weights_is_refused_before_anything_is_written(tmp_path):
    theta = weights(0)
    (tmp_path / "theta").write_bytes(to_bytes(theta, META))
    check = InputCheck(most=320, max_ratio=10.0, by="this test")
    check.samples("update u1", 320)
    huge = dict(check.values("update u1", {k: 1e6 * torch.ones_like(v) for k, v in move(theta, 1).items()}.items()))
    with pytest.raises(UpdateRejected, match="update u1 has norm .* over 10× θ's norm .*; refused by this test"):
        outer_step(tmp_path, tmp_path / "theta", None, huge, Synchronous(0.7, 0.9, True), META, check)
    assert not (tmp_path / "next").exists()
    with pytest.raises(UpdateRejected, match="update u2 claims 321 samples, not 1..320"):
        check.samples("update u2", 321)
    with pytest.raises(UpdateRejected, match=r"update u3 holds NaN/Inf \(w\)"):
        dict(check.values("update u3", [("b", torch.zeros(4)), ("w", torch.full((8, 4), float("nan")))]))
