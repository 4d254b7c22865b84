"""Unit tests for the math: the outer step, the average, the codecs, canonical bytes."""

import hashlib

import pytest
import torch

from tensorturn.store.tensors import delta_bytes, delta_from_bytes, from_bytes, metadata_of, model_bytes, to_bytes
from tensorturn.train.diloco import outer_update, shard_rows, weighted_average


def test_nesterov_outer_step_matches_hand_computation():
    theta = {"w": torch.tensor([1.0, -2.0])}
    d1 = {"w": torch.tensor([0.5, 0.25])}
    d2 = {"w": torch.tensor([-1.0, 2.0])}
    lr, mu = 0.7, 0.9
    # round 1: b = d1; step = d1 + mu*b = 1.9*d1
    t1, b1 = outer_update(theta, d1, None, lr, mu, nesterov=True)
    assert torch.allclose(b1["w"], torch.tensor([0.5, 0.25]))
    assert torch.allclose(t1["w"], torch.tensor([1.0 - 0.7 * 0.95, -2.0 - 0.7 * 0.475]))
    # round 2: b = 0.9*b1 + d2 = [-0.55, 2.225]; step = d2 + 0.9*b = [-1.495, 4.0025]
    t2, b2 = outer_update(t1, d2, b1, lr, mu, nesterov=True)
    assert torch.allclose(b2["w"], torch.tensor([-0.55, 2.225]))
    expected = t1["w"] - 0.7 * torch.tensor([-1.495, 4.0025])
    assert torch.allclose(t2["w"], expected)


def test_outer_step_equals_torch_sgd_nesterov():
    torch.manual_seed(0)
    theta = {"a": torch.randn(5, 3), "b": torch.randn(3)}
    deltas = [{k: torch.randn_like(v) for k, v in theta.items()} for _ in range(3)]
    params = {k: torch.nn.Parameter(v.clone()) for k, v in theta.items()}
    opt = torch.optim.SGD(params.values(), lr=0.7, momentum=0.9, nesterov=True)
    ours, buf = theta, None
    for d in deltas:
        for k, p in params.items():
            p.grad = d[k].clone()
        opt.step()
        ours, buf = outer_update(ours, d, buf, 0.7, 0.9, nesterov=True)
    for k in theta:
        assert torch.allclose(ours[k], params[k].detach(), atol=1e-6)


@pytest.mark.parametrize("momentum,nesterov", [(0.9, True), (0.9, False), (0.0, False)])
def test_a_consuming_outer_step_gives_the_same_bits_and_empties_its_inputs(momentum, nesterov):
    torch.manual_seed(1)
    theta = {"a": torch.randn(7, 3), "b": torch.randn(3), "n": torch.tensor(4)}
    delta = {k: torch.randn_like(v) for k, v in theta.items() if v.is_floating_point()}
    buf = {k: torch.randn_like(v) for k, v in delta.items()}
    kept = outer_update(theta, delta, buf, 0.7, momentum, nesterov)
    copies = [{k: v.clone() for k, v in d.items()} for d in (theta, delta, buf)]
    used = outer_update(*copies, 0.7, momentum, nesterov, consume=True)
    for want, got in zip(kept, used):
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert not copies[0] and not copies[1] and len(copies[2]) == (0 if momentum else len(buf))


def test_sgd_lr1_is_fedavg():
    theta = {"w": torch.tensor([1.0, 1.0])}
    trained = [torch.tensor([0.0, 2.0]), torch.tensor([2.0, 4.0])]
    deltas = [{"w": theta["w"] - t} for t in trained]
    avg = weighted_average(deltas, [1, 1])
    new, _ = outer_update(theta, avg, None, 1.0, 0.0, nesterov=False)
    assert torch.allclose(new["w"], torch.tensor([1.0, 3.0]))  # the mean of the trained weights


def test_weighted_average_uses_sample_weights():
    deltas = [{"w": torch.tensor([1.0])}, {"w": torch.tensor([4.0])}]
    assert weighted_average(deltas, [3, 1])["w"].item() == pytest.approx(1.75)


def test_integer_buffers_pass_through():
    theta = {"w": torch.ones(2), "n": torch.tensor(7)}
    new, _ = outer_update(theta, {"w": torch.ones(2)}, None, 0.5, 0.0, nesterov=False)
    assert new["n"].item() == 7 and torch.allclose(new["w"], torch.full((2,), 0.5))


def test_shards_partition_the_training_rows():
    rows = [shard_rows(100, 8, k, seed=3) for k in range(8)]
    allrows = torch.cat(rows).sort().values
    assert torch.equal(allrows, torch.arange(100))
    assert torch.equal(shard_rows(100, 8, 2, seed=3), rows[2])  # deterministic


@pytest.mark.parametrize("codec,tol", [("fp32", 0.0), ("fp16", 1e-3), ("int8", 1 / 254), ("int4", 1 / 14)])
def test_codecs_round_trip(codec, tol):
    torch.manual_seed(1)
    # odd sizes: a tensor whose last block is short, one of a single value, an empty one
    delta = {"w": torch.randn(300, 7), "b": torch.randn(5), "z": torch.zeros(3, 1), "one": torch.randn(1),
             "none": torch.zeros(0, 4)}
    back, meta = delta_from_bytes(delta_bytes(delta, codec, {"samples": "10"}))
    assert meta["samples"] == "10" and meta["codec"] == codec
    assert set(back) == set(delta)
    for k in delta:
        assert back[k].shape == delta[k].shape and back[k].dtype == torch.float32
        # int8/int4: each value is within half a quantization step (its block's max-abs / levels)
        err = (back[k] - delta[k]).abs().max().item() if delta[k].numel() else 0.0
        assert err <= tol * (delta[k].abs().max().item() if delta[k].numel() else 0.0) + 1e-7
    assert torch.equal(back["z"], torch.zeros(3, 1))


@pytest.mark.parametrize("codec, low, high", [("int8", 3.8, 4.0), ("int4", 6.7, 7.2), ("ternary", 16.5, 17.5),
                                                  ("int2", 14.0, 15.5)])
def test_quantised_codecs_shrink_a_transformer_layout_as_their_bits_say(codec, low, high):
    # a matrix and many biases and norm weights the width of a small transformer's: per-tensor
    # blocks pad nothing; each tensor's two entries in the header cost a little
    delta = {"w": torch.randn(512, 512)} | {f"bias{i}": torch.randn(512) for i in range(40)}
    ratio = len(delta_bytes(delta, "fp32", {})) / len(delta_bytes(delta, codec, {}))
    assert low < ratio < high


def test_a_stale_asynchronous_update_keeps_less_of_its_weight_past_a_round():
    from tensorturn.train.diloco import staleness_scale

    # within a round's worth of versions (S = 3): the whole weight, as a synchronous round
    assert [staleness_scale(s, 3) for s in (0, 1, 2)] == [1.0, 1.0, 1.0]
    # past it: S / (staleness + 1), falling as versions pile up; never zero
    assert staleness_scale(3, 3) == 0.75 and staleness_scale(16, 3) == 3 / 17
    assert staleness_scale(16, 3, power=0.5) == (3 / 17) ** 0.5
    scales = [staleness_scale(s, 8) for s in range(100)]
    assert all(a >= b > 0 for a, b in zip(scales, scales[1:]))


def test_the_cli_offers_the_codecs_the_store_has():
    from tensorturn.modes.fused.options import CODECS as OFFERED
    from tensorturn.store.tensors import CODECS

    assert OFFERED == CODECS


def test_ternary_keeps_the_sign_of_values_above_its_threshold_five_codes_a_byte():
    from tensorturn.store.tensors import TERNARY_BLOCK, decode_tensor, encode_tensor

    # a block of 256: four values of magnitude 1.5 and 0.5, the rest 0.1 → mean magnitude
    # (4 + 0.1 × 252) / 256 ≈ 0.114, threshold 0.08: all but the zeros are kept
    value = torch.tensor([1.5, -0.5, 0.5, -1.5, 0.0] + [0.1] * (TERNARY_BLOCK - 5))
    parts = encode_tensor("v", value, "ternary")
    assert parts["v@scale"].tolist() == pytest.approx([(4.0 + 0.1 * 251) / 255])
    # codes -1/0/1 stored +1, five a byte, the first value in the lowest digit
    assert parts["v@q"][0].item() == 2 + 0 * 3 + 2 * 9 + 0 * 27 + 1 * 81
    back = decode_tensor("v", parts, "ternary", [TERNARY_BLOCK])
    assert (back[:5] / parts["v@scale"][0]).tolist() == [1.0, -1.0, 1.0, -1.0, 0.0]
    # a block of zeros: scale 0, every code 0
    zeros = encode_tensor("z", torch.zeros(7), "ternary")
    assert zeros["z@scale"].tolist() == [0.0] and zeros["z@q"].tolist() == [1 + 3 + 9 + 27 + 81, 1 + 3]


def test_int2_sends_a_sign_and_one_of_two_magnitudes_four_codes_a_byte():
    from tensorturn.store.tensors import decode_tensor, encode_tensor

    # magnitudes 1 and 4, three of each: the two levels are their means; a short last block
    value = torch.tensor([1.0, -4.0, 4.0, -1.0, 1.0, -4.0])
    parts = encode_tensor("v", value, "int2")
    assert parts["v@scale"].tolist() == [1.0, 4.0]
    # codes 0..3 for -high, -low, low, high, four a byte, the first value in the lowest bits
    assert parts["v@q"].tolist() == [2 + (0 << 2) + (3 << 4) + (1 << 6), 2 + (0 << 2)]
    assert torch.equal(decode_tensor("v", parts, "int2", [6]), value)
    # equal magnitudes, zeros: one level serves every value
    assert decode_tensor("c", encode_tensor("c", torch.full((5,), -0.5), "int2"), "int2", [5]).tolist() == [-0.5] * 5
    assert not decode_tensor("z", encode_tensor("z", torch.zeros(9), "int2"), "int2", [9]).any()


def test_int2_errs_less_than_ternary_on_a_gaussian_tensor():
    from tensorturn.store.tensors import decode_tensor, encode_tensor

    torch.manual_seed(4)
    value = torch.randn(64, 100)

    def error(codec: str) -> float:
        back = decode_tensor("v", encode_tensor("v", value, codec), codec, [64, 100])
        return float((back - value).norm() / value.norm())

    # Lloyd-Max's four levels for a Gaussian leave 34 % relative error; ternary about 40 %
    assert error("int2") < 0.36 < error("ternary")


def test_ternary_zeroes_the_small_values_of_a_dense_block_and_keeps_its_direction():
    from tensorturn.store.tensors import decode_tensor, encode_tensor

    torch.manual_seed(3)
    value = torch.randn(4096)
    back = decode_tensor("v", encode_tensor("v", value, "ternary"), "ternary", [4096])
    assert set(back.sign().unique().tolist()) <= {-1.0, 0.0, 1.0}
    kept = back != 0
    assert 0.4 < kept.float().mean() < 0.6  # about half of a Gaussian passes 0.7 × its mean |x|
    assert torch.equal(back[kept].sign(), value[kept].sign())
    assert torch.nn.functional.cosine_similarity(back, value, dim=0) > 0.85


def test_int4_packs_two_codes_a_byte_and_decodes_each_as_code_times_its_blocks_scale():
    from tensorturn.store.tensors import decode_tensor, encode_tensor

    value = torch.tensor([7.0, -7.0, 3.0, 0.0, -1.0])  # one block: scale 1
    parts = encode_tensor("v", value, "int4")
    assert parts["v@scale"].tolist() == [1.0]
    assert parts["v@q"].tolist() == [(7 + 8) | ((-7 + 8) << 4), (3 + 8) | (8 << 4), -1 + 8]
    assert torch.equal(decode_tensor("v", parts, "int4", [5]), value)


def test_model_bytes_are_canonical():
    state = {"b": torch.arange(3.0), "a": torch.ones(2, 2)}
    blobs = {model_bytes(dict(reversed(list(state.items()))), "r", {"x": 1, "y": [2]})
             for _ in range(3)} | {model_bytes(state, "r", {"y": [2], "x": 1})}
    assert len(blobs) == 1
    blob = blobs.pop()
    assert metadata_of(blob)["recipe"] == "r"
    assert torch.equal(from_bytes(blob)["a"], torch.ones(2, 2))
    assert int.from_bytes(blob[:8], "little") % 8 == 0
    assert hashlib.sha256(to_bytes(state)).digest() == hashlib.sha256(to_bytes(state)).digest()


def test_a_delta_from_another_version_is_one_clear_error():
    blob = to_bytes({"int8.q": torch.zeros(256, dtype=torch.int8), "int8.scale": torch.ones(1)},
                    {"format": "tensorturn-delta/2", "codec": "int8", "shapes": '{"w": [256]}'})
    with pytest.raises(ValueError, match="another TensorTurn version"):
        delta_from_bytes(blob)


def test_gradient_accumulation_takes_the_step_of_the_whole_batch():
    """Two minibatches of 4 accumulated: the step one minibatch of the same 8 rows takes."""
    from tensorturn.recipes import resolve
    from tensorturn.recipes.base import load_splits
    from tensorturn.train.loop import train_steps

    recipe = resolve("digits-mlp")
    splits = load_splits(recipe)
    rows = torch.arange(8)  # one epoch of 8 rows: both draw the same 8, in the same order
    after = []
    for batch, accumulate in ((8, 1), (4, 2)):
        torch.manual_seed(0)
        model = recipe.model(recipe.default_config())
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        _, samples = train_steps(recipe, model, opt, splits.x_train, splits.y_train, rows, 1, batch,
                                 seed=3, device=torch.device("cpu"), accumulate=accumulate)
        assert samples == 8
        after.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*after))


def test_bf16_and_fp16_train_on_the_cpu():
    from tensorturn.recipes import resolve
    from tensorturn.recipes.base import load_splits
    from tensorturn.train.loop import train_steps

    recipe = resolve("digits-mlp")
    splits = load_splits(recipe)
    losses = {}
    for precision in ("fp32", "bf16", "fp16"):
        torch.manual_seed(0)
        model = recipe.model(recipe.default_config())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses[precision], _ = train_steps(recipe, model, opt, splits.x_train, splits.y_train,
                                           torch.arange(len(splits.y_train)), 30, 32, seed=1,
                                           device=torch.device("cpu"), precision=precision)
    with torch.no_grad():
        first = recipe.loss(recipe.model(recipe.default_config()), splits.x_train[:256], splits.y_train[:256])
    assert all(loss < float(first) for loss in losses.values())   # each learned
    assert losses["bf16"] != losses["fp32"]                        # and bf16 did run in bf16


@pytest.mark.parametrize("codec", ["fp32", "fp16", "int8", "int4", "ternary", "int2"])
def test_a_delta_written_tensor_by_tensor_is_delta_bytes_and_reads_back_alike(tmp_path, codec):
    from tensorturn.store.tensorfile import TensorReader, delta_tensors, write_delta

    torch.manual_seed(2)
    delta = {"w": torch.randn(300, 7), "b": torch.randn(7), "e": torch.randn(2, 3, 4)}
    extra = {"samples": "64", "loss": "0.5", "bytes_down": f"{12:015d}"}
    write_delta(tmp_path / "d", delta, codec, extra)
    assert (tmp_path / "d").read_bytes() == delta_bytes(delta, codec, extra)
    whole, _ = delta_from_bytes(delta_bytes(delta, codec, extra))
    with TensorReader(tmp_path / "d") as f:
        streamed = dict(delta_tensors(f))
    assert streamed.keys() == whole.keys() and all(torch.equal(streamed[k], whole[k]) for k in whole)


def test_a_file_written_in_any_order_is_the_canonical_file_and_refuses_mistakes(tmp_path):
    from tensorturn.store.tensorfile import TensorWriter

    tensors = {"b": torch.arange(6, dtype=torch.int64), "a": torch.randn(3, 2), "c": torch.randn(4).half()}
    specs = {k: (v.dtype, list(v.shape)) for k, v in tensors.items()}
    meta = {"sha256": "0" * 64, "format": "test"}
    with TensorWriter(tmp_path / "f", specs, meta) as out:
        for name in reversed(out.order):
            out.put(name, tensors[name])
        with pytest.raises(ValueError, match="written already"):
            out.put("a", tensors["a"])
        with pytest.raises(ValueError, match="header's length"):
            out.set_metadata({**meta, "sha256": "1"})
        out.set_metadata({**meta, "sha256": "f" * 64})
        out.close()
    assert (tmp_path / "f").read_bytes() == to_bytes(tensors, {**meta, "sha256": "f" * 64})
    with TensorWriter(tmp_path / "g", specs) as out, pytest.raises(ValueError, match="never written"):
        out.put("a", tensors["a"])
        out.close()
