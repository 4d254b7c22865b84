"""The inference API's wire format (Open Inference Protocol, KServe V2): a request body parsed
and validated into one float32 array, errors as ``{"error": ...}``, and the OpenAPI text of the
infer route. The answer's encoding is :mod:`tensorturn.recipes.answer` (``check-recipe`` sends it
too).

Parsing is strict and says what is wrong in one line: bodies come from anyone holding a token,
and a vague 400 costs the caller more than the check costs here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import orjson
from starlette.responses import Response

from tensorturn.serve.auth import AuthError

NUMERIC = {"FP16", "FP32", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32"}
FP32_MAX = float(np.finfo(np.float32).max)
MAX_ID_CHARS = 256                # a request's id is echoed back: a label, not a payload
JSON = "application/json"


class ApiError(Exception):
    """A request refused with ``status`` and one line saying why (an ``{"error": ...}`` answer)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


class BadRequest(ApiError):
    """A body that is not a valid request for this model (400, or 413 when over a limit)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(status, message)


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    """Every failure's answer: ``{"error": message}`` as JSON."""
    return Response(orjson.dumps({"error": message}), status_code=status, headers=headers,
                    media_type=JSON)


def auth_error_response(exc: AuthError) -> Response:
    """A refused token's answer: 401 names the scheme, 429 says when to come back."""
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    return error_response(exc.status, exc.message, headers)


class ParsedRequest(NamedTuple):
    x: np.ndarray          # float32, [rows, *input_shape]
    members: bool
    id: str | None


def _loads(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        reason = str(exc)
    if b"NaN" in raw or b"Infinity" in raw:
        raise BadRequest("body is not valid JSON: it holds NaN or Infinity (non-finite values are "
                         "not accepted)")
    if "infinity when parsed as double" in reason:
        raise BadRequest("body is not valid JSON for this API: a number in it is too large")
    raise BadRequest(f"body is not valid JSON: {reason}")


INPUT_NAME = "input"  # the model's one input, as its metadata names it


def _check_datatype(x: np.ndarray, datatype: str) -> None:
    """BadRequest unless every value of ``x`` is one ``datatype`` can hold: a whole number in
    range for the integer types (INT8 300, INT8 2.5 and UINT8 -7 are not INT8 or UINT8 values),
    in range for FP16."""
    if not x.size:
        return
    if datatype.startswith(("INT", "UINT")):
        limits = np.iinfo(np.dtype(datatype.lower()))
        if not bool((x == np.floor(x)).all()):
            raise BadRequest(f"data holds a fraction, which is no {datatype} value (declare FP32)")
        low, high = float(x.min()), float(x.max())
        if low < limits.min or high > limits.max:
            raise BadRequest(f"data holds {low if low < limits.min else high:g}, outside {datatype}'s range "
                             f"{limits.min}..{limits.max}")
    elif datatype == "FP16" and float(np.abs(x).max()) > float(np.finfo(np.float16).max):
        raise BadRequest(f"data holds numbers beyond the FP16 range (±{float(np.finfo(np.float16).max):g})")


def _to_array(data: Any, shape: list[int], datatype: str = "FP64") -> np.ndarray:
    """``data`` (flat, or nested exactly as ``shape``) as float32 of that shape, or BadRequest."""
    count = math.prod(shape)
    if not isinstance(data, list):
        raise BadRequest(f"data must be a list of {count} numbers for shape {shape}")
    level, nested = data, [len(data)]
    while level and type(level[0]) is list:
        if len(nested) >= len(shape):
            raise BadRequest(f"data is nested deeper than its shape {shape}")
        if set(map(type, level)) != {list} or len(lengths := set(map(len, level))) != 1:
            raise BadRequest("data is ragged: nested lists must all have the same length and "
                             "hold only lists or only numbers")
        nested.append(lengths.pop())
        level = list(chain.from_iterable(level))
    if len(nested) > 1 and nested != shape:
        raise BadRequest(f"data is nested as {nested} but shape is {shape}")
    if len(level) != count:
        raise BadRequest(f"data must hold {count} numbers for shape {shape}, got {len(level)}")
    found = set(map(type, level))
    if not found <= {int, float}:
        names = ", ".join(sorted({"null" if t is type(None) else t.__name__
                                  for t in found - {int, float}}))
        raise BadRequest(f"data must contain numbers only (found {names})")
    try:
        x = np.array(level, dtype=np.float64)
    except (OverflowError, ValueError):
        raise BadRequest("data holds a number that is too large") from None
    if x.size:
        if not np.isfinite(x).all():
            raise BadRequest("data contains non-finite values (NaN or Infinity)")
        if float(np.abs(x).max()) > FP32_MAX:
            raise BadRequest(f"data holds numbers beyond the FP32 range (±{FP32_MAX:.4g})")
        _check_datatype(x, datatype)
    return x.astype(np.float32).reshape(shape)


def parse_request(raw: bytes, input_shape: list[int], max_rows: int) -> ParsedRequest:
    """A request body, parsed and validated (the one input tensor raw, before preprocessing)."""
    body = _loads(raw)
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list) or not body["inputs"]:
        raise BadRequest("body must be a JSON object with a non-empty 'inputs' list")
    params = body.get("parameters")
    members = False
    if params is not None:
        if not isinstance(params, dict):
            raise BadRequest("'parameters' must be a JSON object, e.g. {\"members\": true}")
        wanted = params.get("members")
        if wanted is not None and not isinstance(wanted, bool):
            raise BadRequest("'parameters.members' must be true or false")
        members = bool(wanted)
    request_id = body.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest("'id' must be a string")
    if request_id is not None and len(request_id) > MAX_ID_CHARS:
        raise BadRequest(f"'id' is {len(request_id):,} characters; at most {MAX_ID_CHARS} are "
                         f"echoed back")
    if len(body["inputs"]) != 1:
        raise BadRequest(f"expected exactly 1 input tensor, got {len(body['inputs'])}")
    spec = body["inputs"][0]
    if not isinstance(spec, dict):
        raise BadRequest("each input must be an object with name, shape, datatype and data")
    datatype, shape = spec.get("datatype"), spec.get("shape")
    if spec.get("name") != INPUT_NAME:
        raise BadRequest(f"input {str(spec.get('name'))[:64]!r} is not this model's: its input is named "
                         f"{INPUT_NAME!r} (GET /v2/models/<name> lists it)")
    if not isinstance(datatype, str) or datatype not in NUMERIC:
        raise BadRequest(f"unsupported datatype {datatype!r}: use a numeric type such as FP32")
    if (not isinstance(shape, list) or not shape
            or not all(type(d) is int and d > 0 for d in shape)):
        raise BadRequest(f"shape must be a list of positive integers, got {shape!r}")
    if shape[1:] != input_shape:
        raise BadRequest(f"shape {shape} does not fit this model: expected [N, "
                         f"{', '.join(map(str, input_shape))}]")
    if shape[0] > max_rows:
        raise BadRequest(f"{shape[0]} rows in one request; this server takes at most {max_rows} "
                         f"(tensorturn serve --max-rows)", 413)
    return ParsedRequest(_to_array(spec.get("data"), shape, datatype), members, request_id)


def infer_openapi(input_shape: list[int], served: list[tuple[str, str, list[int]]]) -> dict[str, Any]:
    """The infer route's OpenAPI text: its request and answer schemas, an example, its errors."""
    row = [0.0] * math.prod(input_shape)
    request_schema = {
        "type": "object", "required": ["inputs"],
        "properties": {
            "id": {"type": "string", "maxLength": MAX_ID_CHARS,
                   "description": "echoed back (a UUID when absent)"},
            "parameters": {"type": "object", "properties": {"members": {
                "type": "boolean", "description": "also return each ensemble member's "
                                                  "probabilities"}}},
            "inputs": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
                "type": "object", "required": ["name", "shape", "datatype", "data"],
                "properties": {
                    "name": {"type": "string"},
                    "shape": {"type": "array", "items": {"type": "integer", "minimum": 1},
                              "description": f"[N, {', '.join(map(str, input_shape))}]"},
                    "datatype": {"type": "string", "enum": sorted(NUMERIC)},
                    "data": {"type": "array", "items": {},
                             "description": "the raw inputs, row-major: flat or nested as shape"},
                }}}}}
    output = {"type": "object", "properties": {
        "name": {"type": "string"}, "datatype": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "data": {"type": "array", "items": {"type": ["number", "string"]}}}}
    answer = {"type": "object", "properties": {
        "model_name": {"type": "string"}, "model_version": {"type": "string"},
        "id": {"type": "string"},
        "outputs": {"type": "array", "items": output,
                    "description": ", ".join(f"{n} ({t} {['N', *s[1:]]})" for n, t, s in served)
                                   + ", and each member's when asked"}}}
    error = {"content": {JSON: {"schema": {"type": "object", "properties": {
        "error": {"type": "string"}}}}}}
    return {
        "requestBody": {"required": True, "content": {JSON: {"schema": request_schema, "example": {
            "inputs": [{"name": "input", "shape": [1, *input_shape], "datatype": "FP32",
                        "data": row}]}}}},
        "responses": {
            "200": {"description": "predictions", "content": {JSON: {"schema": answer}}},
            "400": {"description": "the body is not a valid request for this model", **error},
            "401": {"description": "missing or invalid bearer token", **error},
            "404": {"description": "no such model on this server", **error},
            "413": {"description": "body or rows over the server's limit", **error},
            "429": {"description": "too many failed authentications from this address", **error},
        },
    }
