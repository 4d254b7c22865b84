"""State dicts ⇄ safetensors bytes, and the pseudo-gradient codecs.

Nothing here unpickles: weights travel as safetensors only. A model file holds the weights and
deterministic metadata (recipe and model config, never a run id or a time), so identical weights
give identical bytes and the same sha256.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

MODEL_FORMAT = "tensorturn-model/1"
DELTA_FORMAT = "tensorturn-delta/3"          # a shard's pseudo-gradient (3: int8 per tensor, int4)
BROADCAST_FORMAT = "tensorturn-broadcast/2"  # θ_{r+1} − θ_r for the download
ENSEMBLE_FORMAT = "tensorturn-ensemble/1"
CODECS = ("fp32", "fp16", "int8", "int4", "ternary", "int2")
INT8_BLOCK = 256  # values per scale: 1.016 bytes a value, 3.94× fewer than fp32
INT4_BLOCK = 64   # 0.5625 bytes a value, 7.1× fewer (finer blocks: 15 levels need them)

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


def header_of(data: bytes) -> tuple[dict[str, str], dict[str, list[int]]]:
    """(string metadata, tensor name → shape) of a safetensors blob, from its header alone — no
    tensor is read or allocated. ValueError, saying what is wrong, for bytes that are not a whole
    safetensors file: too short, a header that is not a JSON object, a tensor entry without a
    shape or whose bytes lie past the end (a truncated file)."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes, too short for a safetensors file")
    n = int.from_bytes(data[:8], "little")
    if not 2 <= n <= len(data) - 8:
        raise ValueError(f"its header length {n} does not fit its {len(data)} bytes (truncated, or "
                         f"not a safetensors file)")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as exc:
        raise ValueError(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("its metadata is not a map of strings")
    body, shapes = len(data) - 8 - n, {}
    for name, entry in header.items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (_whole_numbers(shape) and _whole_numbers(offsets) and len(offsets) == 2
                and offsets[0] <= offsets[1] <= body):
            raise ValueError(f"tensor {name!r} is not a tensor within the file's {len(data)} bytes "
                             f"(truncated?)")
        shapes[name] = list(shape)
    return meta, shapes


def _whole_numbers(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                           for v in value)


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
                options: dict | None = None, learned: dict | None = None) -> bytes:
    """A model file: weights plus the recipe name, options, learned state and model config to
    rebuild it."""
    return to_bytes(state, model_metadata(recipe, config, options, learned))


def model_metadata(recipe: str, config: dict, options: dict | None = None,
                   learned: dict | None = None) -> dict[str, str]:
    """What a model file says of itself beside its weights."""
    meta = {"format": MODEL_FORMAT, "recipe": recipe, "config": json.dumps(config, sort_keys=True)}
    return _with_recipe(meta, options, learned)


def _with_recipe(meta: dict[str, str], options: dict | None, learned: dict | None) -> dict[str, str]:
    """``meta`` with the recipe's options and learned state (``recipes/learned.py``), if any."""
    if options:
        meta["recipe_options"] = json.dumps(options, sort_keys=True)
    if learned:
        meta["recipe_state"] = json.dumps(learned, sort_keys=True)
    return meta


def ensemble_bytes(members: list[tuple[int, StateDict, dict]], recipe: str, vote: str,
                   options: dict | None = None, learned: dict | None = None) -> bytes:
    """One file for a voting ensemble: each member's weights under ``m<member>.`` and the
    members' configs and the vote rule in the metadata."""
    tensors: StateDict = {}
    for member, state, _ in members:
        tensors.update({f"m{member}.{k}": v for k, v in state.items()})
    meta = {"format": ENSEMBLE_FORMAT, "recipe": recipe, "vote": vote,
            "members": json.dumps([{"member": m, "config": c} for m, _, c in members],
                                  sort_keys=True)}
    return to_bytes(tensors, _with_recipe(meta, options, learned))


def float_keys(state: StateDict) -> list[str]:
    """Keys of floating-point entries: the ones averaged; integer buffers are copied through."""
    return [k for k, v in state.items() if v.is_floating_point()]


# ---- pseudo-gradient codecs ------------------------------------------------------------------
#
# Every codec works a tensor at a time, so a pseudo-gradient or a broadcast is encoded, written,
# read and decoded tensor by tensor (no copy of the whole model is packed in memory). fp32 and
# fp16 store each tensor under its own name. int8 and int4 quantise each tensor in blocks of its
# flattened values (the last block may be short), one float32 scale per block (max-abs over the
# levels): ``NAME@q`` holds the codes (int8: one a byte; int4: two a byte, low nibble first,
# stored as code + 8), ``NAME@scale`` the scales. A value decodes as its code times its block's
# scale — one multiplication, so the same bits whichever slice it is computed in.
#
# ternary keeps, in blocks of 256 values, the sign of each value above 0.7 × the block's mean
# magnitude (ternary weight networks' threshold, Li et al. 2016) and zero for the rest; the block's
# scale is the mean magnitude of the values kept. Codes -1, 0, 1 are stored as 0, 1, 2, five a byte
# (3^5 = 243 ≤ 256, first value lowest): 1.6 bits a value, 1.725 with the scales — 18.5× below fp32.
#
# int2 sends each value as its sign and one magnitude bit: per block of 1,024 values two
# magnitudes, ``low`` and ``high`` (a two-level Lloyd-Max quantiser of the magnitudes: four passes
# of "split at the midpoint, each level the mean of its side", from 0.5 and 2 × the block's mean
# magnitude). Codes 0..3 stand for -high, -low, low, high, four a byte (first value in the lowest
# bits); ``NAME@scale`` holds low, high for each block in turn: 2.06 bits a value, 15.5× below
# fp32, with a third less squared error than ternary on pseudo-gradients (30.9 % relative
# error against 38.3 % on a charlm round's).
#
# ternary and int2 encode and decode a tensor VALUES_AT_ONCE values at a time (the same bits as
# at once: every block is computed on its own), so their float64 sums and int32 codes stay a
# few tens of MB; on gpt2-small's 38.6M-value embedding ternary's encoding peaked at 1.1 GB
# above the tensor at once, and at 0.05–0.3 GB so.

CODE, SCALE = "@q", "@scale"


TERNARY_BLOCK = 256
TERNARY_THRESHOLD = 0.7  # × a block's mean magnitude: smaller values are sent as zero
TRITS = 5                # ternary codes a byte
TRIT_WEIGHTS = torch.tensor([3 ** i for i in range(TRITS)], dtype=torch.int32)
INT2_BLOCK = 1024
INT2_PASSES = 4
CRUMB_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.int32)  # four 2-bit codes a byte
# values ternary and int2 encode at a time: whole blocks of either (4,000 of ternary's, 1,000 of
# int2's) whose codes end on a whole byte (a multiple of 5 and of 4), so their float64 sums and
# int32 codes take a few tens of MB whatever the tensor's size
VALUES_AT_ONCE = 1_024_000


@dataclass(frozen=True)
class Quantiser:
    levels: int   # codes run from -levels to levels
    block: int    # values per scale
    bits: int     # bits a code takes in the file (ternary: 8 / TRITS, stored as 0)
    scales: int = 1  # float32 scales a block (int2: its two magnitudes)

    def codes_for(self, n: int) -> int:
        """Bytes (or int8 codes) that hold ``n`` codes."""
        per_byte = {8: 1, 4: 2, 2: 4, 0: TRITS}[self.bits]
        return -(-n // per_byte)


QUANTISERS = {"int8": Quantiser(127, INT8_BLOCK, 8), "int4": Quantiser(7, INT4_BLOCK, 4),
              "ternary": Quantiser(1, TERNARY_BLOCK, 0), "int2": Quantiser(2, INT2_BLOCK, 2, scales=2)}


def part_specs(name: str, shape: list[int], codec: str) -> dict[str, tuple[torch.dtype, list[int]]]:
    """The tensors (dtype, shape) that hold one encoded tensor in a delta file."""
    if codec == "fp32" or codec == "fp16":
        return {name: (torch.float32 if codec == "fp32" else torch.float16, list(shape))}
    quant = quantiser(codec)
    n = math.prod(shape)
    return {name + CODE: (torch.int8 if quant.bits == 8 else torch.uint8, [quant.codes_for(n)]),
            name + SCALE: (torch.float32, [-(-n // quant.block) * quant.scales])}


def quantiser(codec: str) -> Quantiser:
    if codec not in QUANTISERS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    return QUANTISERS[codec]


def encode_tensor(name: str, value: torch.Tensor, codec: str) -> dict[str, torch.Tensor]:
    """One float tensor encoded: the tensors :func:`part_specs` names, by name."""
    if codec == "fp32":
        return {name: value.float()}
    if codec == "fp16":
        return {name: value.half()}
    quant = quantiser(codec)
    flat = value.detach().float().flatten()
    n = flat.numel()

    def blocks_of(values: torch.Tensor) -> torch.Tensor:  # the last block padded with zeros
        return torch.nn.functional.pad(values, (0, (-values.numel()) % quant.block)).view(-1, quant.block)

    if quant.bits in (0, 2):  # a chunk of blocks at a time: their float64 and int32 sums stay small
        pieces = [packed(blocks_of(flat[i:i + VALUES_AT_ONCE]), min(n - i, VALUES_AT_ONCE), quant)
                  for i in range(0, n, VALUES_AT_ONCE)] or [(torch.zeros(0, dtype=torch.uint8), torch.zeros(0))]
        return {name + CODE: torch.cat([codes for codes, _ in pieces]),
                name + SCALE: torch.cat([scales for _, scales in pieces])}
    blocks = blocks_of(flat)
    scale = blocks.abs().amax(dim=1) / quant.levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(blocks / safe[:, None]).clamp(-quant.levels, quant.levels).flatten()[:n]
    if quant.bits == 8:
        codes = q.to(torch.int8)
    else:
        nibbles = torch.nn.functional.pad((q + 8).to(torch.uint8), (0, n % 2))
        codes = nibbles[0::2] | (nibbles[1::2] << 4)
    return {name + CODE: codes, name + SCALE: scale}


def packed(blocks: torch.Tensor, n: int, quant: Quantiser) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes packed in bytes, scales) of ternary's or int2's ``blocks`` holding ``n`` real values."""
    if quant.bits == 0:
        scale, q = ternary(blocks, n)
        trits = torch.nn.functional.pad((q.flatten()[:n] + 1).to(torch.int32), (0, (-n) % TRITS))
        return (trits.view(-1, TRITS) * TRIT_WEIGHTS).sum(dim=1).to(torch.uint8), scale
    levels, codes = two_level(blocks, n)
    crumbs = torch.nn.functional.pad(codes.flatten()[:n], (0, (-n) % 4)).view(-1, 4)
    return (crumbs << CRUMB_SHIFTS).sum(dim=1).to(torch.uint8), levels.flatten()


def ternary(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale per block, codes -1/0/1) of float32 ``blocks`` (one a row; ``n`` real values, the
    last row's rest padding): a value's sign where its magnitude passes TERNARY_THRESHOLD × its
    block's mean magnitude (over its real values), the scale the mean magnitude of those kept
    (0 for a block of zeros). The sums are in float64, whose rounding leaves the float32
    results the same whatever order a CPU's vector units add in."""
    magnitude = blocks.abs().double()
    real = (n - torch.arange(blocks.shape[0], dtype=torch.float64) * blocks.shape[1]).clamp(max=blocks.shape[1])
    mean = (magnitude.sum(dim=1) / real.clamp(min=1)).float()
    kept = blocks.abs() > TERNARY_THRESHOLD * mean[:, None]
    scale = ((magnitude * kept).sum(dim=1) / kept.sum(dim=1).clamp(min=1)).float()
    return scale, torch.sign(blocks) * kept


def two_level(blocks: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(low and high magnitude per block, shape [blocks, 2]; codes 0..3 as int32) of float32
    ``blocks`` with ``n`` real values: INT2_PASSES passes of a two-level Lloyd-Max quantiser of
    the magnitudes. Sums in float64 and levels rounded to float32 each pass, so the split points
    are the same bits whatever order a CPU's vector units add in."""
    magnitude = blocks.abs()
    real = (torch.arange(blocks.numel()).view(blocks.shape) < n)
    wide = magnitude.double() * real
    mean = (wide.sum(dim=1) / real.sum(dim=1).clamp(min=1)).float()
    low, high = 0.5 * mean, 2.0 * mean
    for _ in range(INT2_PASSES):
        upper = magnitude > ((low + high) / 2)[:, None]
        count_high = (upper & real).sum(dim=1)
        count_low = real.sum(dim=1) - count_high
        new_high = ((wide * upper).sum(dim=1) / count_high.clamp(min=1)).float()
        new_low = ((wide * ~upper).sum(dim=1) / count_low.clamp(min=1)).float()
        # a side left empty keeps its level (a block of equal magnitudes: one level serves all)
        high = torch.where(count_high > 0, new_high, high)
        low = torch.where(count_low > 0, new_low, low)
    upper = magnitude > ((low + high) / 2)[:, None]
    codes = torch.where(blocks < 0, 1 - upper.int(), 2 + upper.int())
    return torch.stack([low, high], dim=1), codes


def decode_tensor(name: str, parts: dict[str, torch.Tensor], codec: str, shape: list[int]) -> torch.Tensor:
    """Inverse of :func:`encode_tensor`: the float32 tensor of ``shape``."""
    if codec == "fp32" or codec == "fp16":
        return parts[name].float()
    quant = quantiser(codec)
    n = math.prod(shape)
    codes, scales = parts[name + CODE], parts[name + SCALE]
    if quant.bits in (0, 2):  # a chunk at a time, as encoded: the int32 codes stay small
        out = torch.empty(n)
        per_byte, step = (TRITS if quant.bits == 0 else 4), VALUES_AT_ONCE
        for i in range(0, n, step):
            m = min(n - i, step)
            first = i // quant.block * quant.scales
            out[i:i + m] = unpacked(codes[i // per_byte:(i + m + per_byte - 1) // per_byte],
                                    scales[first:first + -(-m // quant.block) * quant.scales], m, quant)
        return out.view(shape)
    if quant.bits == 8:
        q = codes.float()
    else:
        q = torch.stack([codes & 15, codes >> 4], dim=1).flatten()[:n].float() - 8
    blocks = torch.nn.functional.pad(q, (0, (-n) % quant.block)).view(-1, quant.block)
    return (blocks * scales[:, None]).flatten()[:n].view(shape).clone()


def unpacked(codes: torch.Tensor, scales: torch.Tensor, n: int, quant: Quantiser) -> torch.Tensor:
    """The ``n`` float32 values of ternary's or int2's packed ``codes`` and their blocks' ``scales``."""
    if quant.bits == 2:
        crumbs = ((codes.to(torch.int32)[:, None] >> CRUMB_SHIFTS) & 3).flatten()[:n]
        crumbs = torch.nn.functional.pad(crumbs, (0, (-n) % quant.block)).view(-1, quant.block)
        levels = scales.view(-1, 2)
        magnitude = torch.where((crumbs == 0) | (crumbs == 3), levels[:, 1:2], levels[:, 0:1])
        return (torch.where(crumbs < 2, -1.0, 1.0) * magnitude).flatten()[:n]
    q = ((codes.to(torch.int32)[:, None] // TRIT_WEIGHTS) % 3).flatten()[:n].float() - 1
    blocks = torch.nn.functional.pad(q, (0, (-n) % quant.block)).view(-1, quant.block)
    return (blocks * scales[:, None]).flatten()[:n]


def encode_delta(delta: StateDict, codec: str) -> dict[str, torch.Tensor]:
    """Every tensor of a float32 delta encoded (:func:`encode_tensor`)."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; choose one of {', '.join(CODECS)}")
    return {part: v for name, value in delta.items() for part, v in encode_tensor(name, value, codec).items()}


def iter_decoded(get: Callable[[str], torch.Tensor], codec: str,
                 shapes: dict[str, list[int]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float32 tensor) for each tensor of a delta, in name order, one at a time; ``get``
    returns a stored part by name (a dict's or a :class:`~tensorturn.store.tensorfile.TensorReader`'s)."""
    for name in sorted(shapes):
        parts = {part: get(part) for part in part_specs(name, shapes[name], codec)}
        yield name, decode_tensor(name, parts, codec, shapes[name])


def decode_delta(packed: dict[str, torch.Tensor], codec: str,
                 shapes: dict[str, list[int]]) -> StateDict:
    """Inverse of :func:`encode_delta`, back to float32 with the original shapes."""
    return dict(iter_decoded(packed.__getitem__, codec, shapes))


def delta_bytes(delta: StateDict, codec: str, extra: dict[str, str]) -> bytes:
    shapes = {k: list(v.shape) for k, v in delta.items()}
    meta = {"format": DELTA_FORMAT, "codec": codec, "shapes": json.dumps(shapes, sort_keys=True), **extra}
    return to_bytes(encode_delta(delta, codec), meta)


def delta_layout(meta: dict[str, str]) -> tuple[str, dict[str, list[int]]]:
    """(codec, shapes) of a delta or broadcast file, from its metadata; ValueError in one line
    for a file another TensorTurn version wrote."""
    if meta.get("format") not in (DELTA_FORMAT, BROADCAST_FORMAT):
        raise ValueError(f"a delta in format {meta.get('format')!r}, not {DELTA_FORMAT!r}: "
                         "written by another TensorTurn version (upgrade every agent)")
    return meta["codec"], json.loads(meta["shapes"])


def delta_from_bytes(data: bytes) -> tuple[StateDict, dict[str, str]]:
    meta = metadata_of(data)
    codec, shapes = delta_layout(meta)
    return decode_delta(from_bytes(data), codec, shapes), meta


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
