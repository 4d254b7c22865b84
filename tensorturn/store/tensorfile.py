"""safetensors files read and written one tensor at a time, for models too big to hold twice.

:func:`tensors.to_bytes` and :func:`tensors.from_bytes` hold a whole state in memory, and its
bytes beside it. The outer step of a big model instead reads each shard's file tensor by tensor
(:class:`TensorReader`: one ``readinto`` per tensor, no memory map — mapped pages would count in
the process's resident memory) and writes the new weights tensor by tensor (:class:`TensorWriter`).

The files are the very bytes ``to_bytes`` makes (a test checks it): the header is the canonical
JSON (sorted keys, 8-byte aligned), and the tensors come in the order safetensors itself writes
them, which depends on their dtypes and names only, so it is read off a one-element probe.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from io import BufferedReader, BufferedWriter
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

from tensorturn.store.tensors import (
    DELTA_FORMAT,
    StateDict,
    delta_layout,
    encode_tensor,
    iter_decoded,
    part_specs,
)

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
          "U8": torch.uint8, "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


def _raw(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes, without a copy when it is contiguous on the CPU."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    data: Any = flat.view(torch.uint8).numpy()
    return memoryview(data) if flat.numel() else memoryview(b"")


class TensorReader:
    """The tensors of a safetensors file, one at a time."""

    def __init__(self, path: Path | str):
        self.file: BufferedReader = open(path, "rb")  # noqa: SIM115 - closed by close() / the with block
        n = int.from_bytes(self.file.read(8), "little")
        if not 0 < n < 100 * 1024 ** 2:
            self.file.close()
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(self.file.read(n))
        self.base = 8 + n
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: dict[str, dict] = header

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.file.close()

    def names(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> list[int]:
        return list(self.entries[name]["shape"])

    def get(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        start, stop = entry["data_offsets"]
        out = torch.empty(stop - start, dtype=torch.uint8)
        self.file.seek(self.base + start)
        if stop > start:
            view, got = memoryview(out.numpy()), 0  # type: ignore[arg-type]
            while got < stop - start:
                n = self.file.readinto(view[got:])
                if not n:
                    raise ValueError(f"{self.file.name}: ends inside tensor {name!r}")
                got += n
        return out.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])

    def all(self) -> StateDict:
        return {name: self.get(name) for name in self.names()}


def write_order(specs: dict[str, tuple[torch.dtype, list[int]]]) -> list[str]:
    """The order safetensors writes these tensors in (it depends on dtype and name only)."""
    probe = st_save({name: torch.zeros(1, dtype=dtype) for name, (dtype, _) in specs.items()})
    n = int.from_bytes(probe[:8], "little")
    header = json.loads(probe[8:8 + n])
    header.pop("__metadata__", None)
    return sorted(header, key=lambda name: header[name]["data_offsets"][0])


class TensorWriter:
    """A safetensors file written tensor by tensor, byte for byte what :func:`tensors.to_bytes`
    makes of the same tensors and metadata: in :attr:`order` (:meth:`write`), or in any order
    (:meth:`put`: each tensor at its own offset, so a step that makes several files' tensors
    together writes each once, as it is made). :meth:`close` checks every tensor was written."""

    def __init__(self, path: Path | str, specs: dict[str, tuple[torch.dtype, list[int]]],
                 metadata: dict[str, str] | None = None):
        self.order = write_order(specs)
        self.offsets: dict[str, list[int]] = {}
        offset = 0
        for name in self.order:
            dtype, shape = specs[name]
            size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            self.offsets[name] = [offset, offset + size]
            offset += size
        self.specs, self.next = specs, 0
        self.written: set[str] = set()
        text = self._header(metadata)
        self.base = 8 + len(text)
        self.file: BufferedWriter = open(path, "wb")  # noqa: SIM115 - closed by close() / the with block
        self.file.write(len(text).to_bytes(8, "little") + text)

    def _header(self, metadata: dict[str, str] | None) -> bytes:
        header: dict = {name: {"dtype": NAMES[self.specs[name][0]], "shape": list(self.specs[name][1]),
                               "data_offsets": self.offsets[name]} for name in self.order}
        if metadata:
            header["__metadata__"] = metadata
        text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        return text + b" " * ((-len(text)) % 8)

    def __enter__(self) -> TensorWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next tensor (names must come in :attr:`order`)."""
        if self.next >= len(self.order) or name != self.order[self.next]:
            raise ValueError(f"tensor {name!r} out of order")
        self.put(name, tensor)
        self.next += 1

    def put(self, name: str, tensor: torch.Tensor) -> None:
        """Write tensor ``name`` at its place, whatever was written before."""
        if name not in self.specs or name in self.written:
            raise ValueError(f"tensor {name!r} is {'written already' if name in self.written else 'not in the file'}")
        dtype, shape = self.specs[name]
        if tensor.dtype != dtype or list(tensor.shape) != list(shape):
            raise ValueError(f"tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, "
                             f"not {dtype} {list(shape)}")
        self.file.seek(self.base + self.offsets[name][0])
        self.file.write(_raw(tensor))
        self.written.add(name)

    def set_metadata(self, metadata: dict[str, str]) -> None:
        """Replace the header's metadata with ``metadata`` of the same length once rendered (a
        figure known only once the tensors are made — another file's sha256 — written last)."""
        text = self._header(metadata)
        if len(text) + 8 != self.base:
            raise ValueError("the new metadata changes the header's length")
        self.file.seek(8)
        self.file.write(text)

    def close(self) -> None:
        if len(self.written) != len(self.order):
            raise ValueError(f"{len(self.order) - len(self.written)} tensors were never written")
        self.file.close()


def delta_tensors(reader: TensorReader) -> Iterator[tuple[str, torch.Tensor]]:
    """A pseudo-gradient or broadcast file's float32 tensors, one at a time, in name order: the
    values :func:`tensors.delta_from_bytes` gives, bit for bit."""
    codec, shapes = delta_layout(reader.metadata)
    return iter_decoded(reader.get, codec, shapes)


def write_delta(path: Path | str, delta: StateDict, codec: str, extra: dict[str, str],
                fmt: str = DELTA_FORMAT) -> None:
    """A pseudo-gradient file, byte for byte :func:`tensors.delta_bytes`'s, written tensor by
    tensor: each is encoded once as it is written, its parts at their places, so no second copy
    of the model is made."""
    shapes = {k: list(v.shape) for k, v in delta.items()}
    meta = {"format": fmt, "codec": codec, "shapes": json.dumps(shapes, sort_keys=True), **extra}
    write_encoded(path, shapes, codec, meta, delta.__getitem__)


def write_encoded(path: Path | str, shapes: dict[str, list[int]], codec: str, meta: dict[str, str],
                  value: Callable[[str], torch.Tensor]) -> None:
    """A delta file of the tensors ``value(name)`` gives (each computed and encoded once, its
    parts written at their places), encoded with ``codec``."""
    specs = {part: spec for name, shape in shapes.items() for part, spec in part_specs(name, shape, codec).items()}
    with TensorWriter(path, specs, meta) as out:
        for name in shapes:
            for part, tensor in encode_tensor(name, value(name), codec).items():
                out.put(part, tensor)
        out.close()
