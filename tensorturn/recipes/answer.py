"""The inference API's answer for a recipe's outputs (Open Inference Protocol, KServe V2).

It lives beside the task kinds, below ``serve``, because two layers send it: ``tensorturn serve``
answers with it, and ``check-recipe`` builds the very bytes a served model would send, to check
them before any run.
"""

from __future__ import annotations

import uuid
from typing import Any, NamedTuple

import numpy as np
import orjson

from tensorturn.recipes.kinds import Kind, Output


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
        outputs.append(Output(kind.member_output(entry["member"]), "FP32", p))
    return outputs


def encode_answer(name: str, version: str, request_id: str | None, pred: Prediction,
                  members: list[dict] | None, kind: Kind, classes: list[str] | None = None) -> bytes:
    """The Open Inference Protocol answer: :func:`served_outputs` as JSON."""
    outputs = [_tensor(o.name, o.datatype, o.data) for o in served_outputs(pred, members, kind, classes)]
    return orjson.dumps({"model_name": name, "model_version": version,
                         "id": request_id or str(uuid.uuid4()), "outputs": outputs},
                        option=orjson.OPT_SERIALIZE_NUMPY)
