"""State dicts ⇄ safetensors bytes, and the pseudo-gradient codecs.

Nothing here unpickles: weights travel as safetensors only. A model file holds the weights and
deterministic metadata (recipe and model config, never a run id or a time), so identical weights
give identical bytes and the same sha256.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

MODEL_FORMAT = "tensorturn-model/1"
DELTA_FORMAT = "tensorturn-delta/2"          # a shard's pseudo-gradient
BROADCAST_FORMAT = "tensorturn-broadcast/1"  # θ_{r+1} − θ_r for the download
ENSEMBLE_FORMAT = "tensorturn-ensemble/1"
CODECS = ("fp32", "fp16", "int8")
INT8_BLOCK = 256

if TYPE_CHECKING:
    from tensorturn.store.objects import Store

StateDict = dict[str, torch.Tensor]


def to_bytes(tensors: StateDict, metadata: dict[str, str] | None = None) -> bytes:
    """Serialize tensors (moved to CPU, made contiguous) with string metadata."""
    clean = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return _canonical(st_save(clean, metadata=metadata or None))


def _canonical(blob: bytes) -> bytes:
    """Rewrite the header with sorted keys: safetensors writes metadata in hash-map order, which
    differs between processes, and the same weights must give the same bytes everywhere."""
    n = int.from_bytes(blob[:8], "little")
    header = json.dumps(json.loads(blob[8:8 + n]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * ((-len(header)) % 8)  # keep the data 8-byte aligned, as safetensors does
    return len(header).to_bytes(8, "little") + header + blob[8 + n:]


def from_bytes(data: bytes) -> StateDict:
    return st_load(data)


def metadata_of(data: bytes) -> dict[str, str]:
    """The string metadata of a safetensors blob, read from its header alone."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    return header.get("__metadata__", {})


def stored_metadata(store: Store, key: str) -> dict[str, str]:
    """The metadata of a stored safetensors file, from its header alone (two range reads)."""
    n = int.from_bytes(store.get_range(key, 0, 8), "little")
    if not 0 < n < 100 * 1024 ** 2:
        raise ValueError(f"{key}: not a safetensors file (header length {n})")
    return json.loads(store.get_range(key, 8, 8 + n)).get("__metadata__", {})


def model_bytes(state: StateDict, recipe: str, config: dict,
                options: dict | None = None) -> bytes:
    """A model file: weights plus the recipe name, options and model config to rebuild it."""
    return to_bytes(state, model_metadata(recipe, config, options))


def model_metadata(recipe: str, config: dict, options: dict | None = None) -> dict[str, str]:
    """What a model file says of itself beside its weights."""
    meta = {"format": MODEL_FORMAT, "recipe": recipe, "config": json.dumps(config, sort_keys=True)}
    if options:
        meta["recipe_options"] = json.dumps(options, sort_keys=True)
    return meta


def ensemble_bytes(members: list[tuple[int, StateDict, dict]], recipe: str, vote: str,
                   options: dict | None = None) -> bytes:
    """One file for a voting ensemble: each member's weights under ``m<member>.`` and the
    members' configs and the vote rule in the metadata."""
    tensors: StateDict = {}
    for member, state, _ in members:
        tensors.update({f"m{member}.{k}": v for k, v in state.items()})
    meta = {"format": ENSEMBLE_FORMAT, "recipe": recipe, "vote": vote,
            "members": json.dumps([{"member": m, "config": c} for m, _, c in members],
                                  sort_keys=True)}
    if options:
        meta["recipe_options"] = json.dumps(options, sort_keys=True)
    return to_bytes(tensors, meta)


def float_keys(state: StateDict) -> list[str]:
    """Keys of floating-point entries: the ones averaged; integer buffers are copied through."""
    return [k for k, v in state.items() if v.is_floating_point()]


# ---- pseudo-gradient codecs ------------------------------------------------------------------

def encode_delta(delta: StateDict, codec: str) -> dict[str, torch.Tensor]:
    """Pack a float32 delta for transfer.

    ``int8`` concatenates every tensor (in name order) into one vector, cut into blocks of 256
    with one fp32 scale each (max-abs / 127): about 1.016 bytes per value whatever the model's
    layout, where per-tensor blocks would pad each small tensor (biases, norms) to 256 values.
    """
    if codec == "fp32":
        return {k: v.float() for k, v in delta.items()}
    if codec == "fp16":
        return {k: v.half() for k, v in delta.items()}
    if codec == "int8":
        flat = torch.cat([delta[k].float().flatten() for k in sorted(delta)]) if delta \
            else torch.zeros(0)
        pad = (-flat.numel()) % INT8_BLOCK
        blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, INT8_BLOCK)
        scale = blocks.abs().amax(dim=1) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / safe[:, None]).clamp(-127, 127).to(torch.int8)
        return {"int8.q": q.flatten(), "int8.scale": scale}
    raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")


def decode_delta(packed: dict[str, torch.Tensor], codec: str,
                 shapes: dict[str, list[int]]) -> StateDict:
    """Inverse of :func:`encode_delta`, back to float32 with the original shapes."""
    if codec in ("fp32", "fp16"):
        return {k: v.float() for k, v in packed.items()}
    if codec == "int8":
        q, scale = packed["int8.q"], packed["int8.scale"]
        flat = (q.view(-1, INT8_BLOCK).float() * scale[:, None]).flatten()
        out, pos = {}, 0
        for k in sorted(shapes):
            n = math.prod(shapes[k])
            out[k] = flat[pos:pos + n].view(shapes[k]).clone()
            pos += n
        return out
    raise ValueError(f"unknown codec {codec!r}")


def delta_bytes(delta: StateDict, codec: str, extra: dict[str, str]) -> bytes:
    shapes = {k: list(v.shape) for k, v in delta.items()}
    meta = {"format": DELTA_FORMAT, "codec": codec, "shapes": json.dumps(shapes, sort_keys=True), **extra}
    return to_bytes(encode_delta(delta, codec), meta)


def delta_from_bytes(data: bytes) -> tuple[StateDict, dict[str, str]]:
    meta = metadata_of(data)
    if meta.get("format") not in (DELTA_FORMAT, BROADCAST_FORMAT):
        raise ValueError(f"a delta in format {meta.get('format')!r}, not {DELTA_FORMAT!r}: "
                         "written by another TensorTurn version (upgrade every agent)")
    shapes = json.loads(meta["shapes"])
    return decode_delta(from_bytes(data), meta["codec"], shapes), meta


def is_finite(state: StateDict) -> bool:
    return all(bool(torch.isfinite(v).all()) for v in state.values())


# ---- optimizer state (ensemble checkpoints) ----------------------------------------------------

def optimizer_tensors(optimizer: torch.optim.Optimizer) -> StateDict:
    """An optimizer's per-parameter state as flat tensors (``<param index>.<field>``).

    Hyper-parameters are not saved: they come from the run's spec when the state is loaded.
    """
    out: StateDict = {}
    for idx, fields in optimizer.state_dict()["state"].items():
        for name, value in fields.items():
            out[f"{idx}.{name}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return out


def load_optimizer_tensors(optimizer: torch.optim.Optimizer, tensors: StateDict) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        idx, _, name = key.partition(".")
        state.setdefault(int(idx), {})[name] = value
    optimizer.load_state_dict({"state": state,
                               "param_groups": optimizer.state_dict()["param_groups"]})
