"""The built-in ``charlm`` recipe in a fused run through the CLI, with a quantising codec: the bytes
moved are compressed."""

from __future__ import annotations

import hashlib
import math

import pytest
from conftest import tt_json

from tensorturn.store.tensors import delta_bytes, from_bytes, metadata_of

# A small text with a learnable structure (and a non-ASCII character) for custom-data tests.
SMALL_TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13} — ok\n"
                     for i in range(80))


@pytest.mark.parametrize("codec, ratio, down, down_ratio", [("int8", 3.5, None, 3.5), ("int4", 6.0, None, 6.0),
                                                           ("ternary", 12.0, "int4", 6.0)])
def test_a_fused_run_with_a_quantising_codec_through_the_cli_moves_compressed_bytes(tmp_path, codec, ratio,
                                                                                     down, down_ratio):
    """A codec's ratio over fp32 at least ``ratio`` up and ``down_ratio`` down on charlm's small
    model (whose many small tensors each cost a header entry); with ``down``, the broadcast's
    own codec (``--broadcast-codec``)."""
    path = tmp_path / "small.txt"
    path.write_text(SMALL_TEXT * 2, encoding="utf-8")
    store = tmp_path / "store"
    doc = tt_json("run", "--recipe", "charlm", "--recipe-option", f"data={path}", "--rounds", "3",
                  "--sync-every", "5", "--shards", "2", "--local-workers", "1", "--codec", codec,
                  *(["--broadcast-codec", down] if down else []), "--store", str(store), "--json", cwd=tmp_path)
    assert doc["state"] == "succeeded", doc.get("error")
    assert doc["spec"]["recipe_options"] == {"data": str(path)}
    assert len(doc["rounds"]) == 3
    assert math.isfinite(doc["metrics"]["test_loss"]) and doc["metrics"]["test_loss"] > 0
    assert doc["rounds"][2]["val_loss"] < math.log(len(set(SMALL_TEXT)))

    run = store / "runs" / doc["run_id"]
    model_size = (run / "global" / "r0000.safetensors").stat().st_size
    rounds = doc["rounds"]
    # θ_0 is rebuilt from the seed (verified by its sha256): round 0 downloads nothing
    assert rounds[0]["bytes_down"] == 0
    # later rounds: the one agent holds θ_{r−1} and downloads only the compressed broadcast, once
    # — or nothing, where its slot of round r took round r−1's outer step and kept θ_r (round 0
    # never hands its step over: no round before it was timed)
    for r in (1, 2):
        broadcast = run / "broadcast" / f"r{r:04d}.safetensors"
        assert rounds[r]["bytes_down"] in ((broadcast.stat().st_size,) if r == 1 else (0, broadcast.stat().st_size))
        assert model_size / broadcast.stat().st_size > down_ratio
        meta = metadata_of(broadcast.read_bytes())
        assert meta["codec"] == (down or codec)
        assert meta["sha256"] == hashlib.sha256(
            (run / "global" / f"r{r:04d}.safetensors").read_bytes()).hexdigest()
    assert not (run / "broadcast" / "r0003.safetensors").exists()  # the final θ stays exact
    # uploads: the pseudo-gradients are as much smaller than the fp32 ones would be
    theta = from_bytes((run / "global" / "r0000.safetensors").read_bytes())
    fp32_upload = len(delta_bytes({k: v.float() for k, v in theta.items()}, "fp32", {}))
    for r in range(3):
        assert rounds[r]["bytes_up"] * ratio < 2 * fp32_upload
