"""The inference API's answer for a recipe's outputs (Open Inference Protocol, KServe V2).

It lives beside the task kinds, below ``serve``, because two layers send it: ``tensorturn serve``
answers with it, and ``check-recipe`` builds the very bytes a served model would send, to check
them before any run.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from typing import Any, NamedTuple

import numpy as np
import orjson

from tensorturn.recipes.kinds import Kind, Output

# each Open Inference Protocol datatype as numpy holds it, little-endian as the binary tensor data
# extension sends it (BYTES: Python objects, each sent as a 4-byte length and its bytes)
NUMPY_DTYPES = {"BOOL": "?", "UINT8": "u1", "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8",
                "INT8": "i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "FP16": "<f2",
                "FP32": "<f4", "FP64": "<f8", "BYTES": "O"}


class Prediction(NamedTuple):
    """A model's outputs for some rows, as served."""

    combined: np.ndarray    # float32 [rows, ...]: probabilities, or predicted values
    per_member: np.ndarray  # float32 [members, rows, ...]


def share(result: Prediction, start: int, stop: int) -> Prediction:
    """Rows ``start:stop`` of ``result``: one request's part of a batch."""
    return Prediction(result.combined[start:stop], result.per_member[:, start:stop])


def _tensor(name: str, datatype: str, data: np.ndarray) -> dict[str, Any]:
    data = np.ascontiguousarray(data)
    flat = data.reshape(-1)  # BYTES (class names) as a list of strings: orjson writes no object arrays
    return {"name": name, "datatype": datatype, "shape": list(data.shape),
            "data": flat.tolist() if flat.dtype == object else flat}


def served_outputs(pred: Prediction, members: list[dict] | None, kind: Kind,
                   classes: list[str] | None = None) -> list[Output]:
    """The outputs the recipe's kind serves (``label``, ``probabilities`` and ``class_name``
    where the recipe names its ``classes``; or ``prediction``), and each member's when asked:
    what the inference API answers and what an exported model's ``predict`` returns."""
    outputs = list(kind.served(pred.combined, classes))
    for entry, p in zip(members or [], pred.per_member):
        outputs.append(Output(kind.member_output(entry["member"]), "FP32", kind.member_values(p)))
    return outputs


def _raw(output: Output) -> bytes:
    """An output's values as the binary tensor data extension sends them."""
    data = np.ascontiguousarray(output.data).reshape(-1)
    if output.datatype == "BYTES":
        items = [v if isinstance(v, bytes) else str(v).encode() for v in data.tolist()]
        return b"".join(len(v).to_bytes(4, "little") + v for v in items)
    return data.astype(NUMPY_DTYPES[output.datatype], copy=False).tobytes()


def encode_outputs(name: str, version: str, request_id: str | None, outputs: list[Output],
                   binary: Collection[str] = ()) -> tuple[bytes, int | None]:
    """The Open Inference Protocol answer for ``outputs``: JSON, and the outputs named in
    ``binary`` as raw bytes after it (the binary tensor data extension: each such output says
    its ``binary_data_size``). Returns the body and the JSON part's length (the
    ``Inference-Header-Content-Length``), or None when the JSON is the whole body."""
    tensors, tail = [], []
    for o in outputs:
        if o.name in binary:
            raw = _raw(o)
            tensors.append({"name": o.name, "datatype": o.datatype, "shape": list(np.shape(o.data)),
                            "parameters": {"binary_data_size": len(raw)}})
            tail.append(raw)
        else:
            tensors.append(_tensor(o.name, o.datatype, o.data))
    head = orjson.dumps({"model_name": name, "model_version": version,
                         "id": request_id or str(uuid.uuid4()), "outputs": tensors},
                        option=orjson.OPT_SERIALIZE_NUMPY)
    return (b"".join([head, *tail]), len(head)) if tail else (head, None)


def encode_answer(name: str, version: str, request_id: str | None, pred: Prediction,
                  members: list[dict] | None, kind: Kind, classes: list[str] | None = None) -> bytes:
    """The Open Inference Protocol answer, all JSON: :func:`served_outputs`."""
    return encode_outputs(name, version, request_id, served_outputs(pred, members, kind, classes))[0]
