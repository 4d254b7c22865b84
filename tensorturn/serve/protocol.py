"""The inference API's wire format (Open Inference Protocol, KServe V2): a request body — JSON,
and any binary tensor data after it — parsed and validated into one float32 array (or a text
model's strings) and the outputs it asks for, errors as ``{"error": ...}``, and the OpenAPI text
of the routes. The answer's encoding is :mod:`tensorturn.recipes.answer` (``check-recipe`` sends it
too).

Parsing is strict and says what is wrong in one line: bodies come from anyone holding a token,
and a vague 400 costs the caller more than the check costs here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import orjson
from starlette.responses import Response

from tensorturn.recipes.answer import NUMPY_DTYPES
from tensorturn.serve.auth import AuthError

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


INFERENCE_HEADER = "Inference-Header-Content-Length"  # the binary extension: the JSON part's length
BINARY = "application/octet-stream"
INPUT_NAME = "input"  # the model's raw rows, as its metadata names them
TEXT_INPUT = "text"   # a text model's other input: one string a row
# float32 holds every whole number up to 2**24 exactly, and rounds some beyond it
EXACT_INTEGERS = 2 ** 24


@dataclass(frozen=True)
class Signature:
    """What requests to one model are checked against: its inputs (``input``: raw rows of
    ``input_shape``; a text model also ``text``), the outputs it can answer, the row limit."""

    input_shape: list[int]
    outputs: tuple[str, ...]
    input_datatype: str = "FP32"
    text: bool = False
    max_rows: int = 4096

    def inputs(self) -> list[dict[str, Any]]:
        """The inputs as the metadata lists them (a request sends one of them)."""
        found = [{"name": INPUT_NAME, "datatype": self.input_datatype, "shape": [-1, *self.input_shape]}]
        if self.text:
            found.append({"name": TEXT_INPUT, "datatype": "BYTES", "shape": [-1]})
        return found


class ParsedRequest(NamedTuple):
    x: np.ndarray | None        # float32, [rows, *input_shape]: the ``input`` tensor
    texts: list[str] | None     # the ``text`` tensor's strings, one a row
    members: bool
    id: str | None
    outputs: list[str] | None   # the outputs asked for, in order (None: the default ones)
    binary: dict[str, bool]     # an output asked for → whether it goes as binary data
    binary_default: bool        # ``binary_data_output``: the rest go as binary data

    def is_binary(self, output: str) -> bool:
        return self.binary.get(output, self.binary_default)


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
        if max(-low, high) > EXACT_INTEGERS:
            raise BadRequest(f"data holds {low if -low > high else high:g}: the model reads float32, "
                             f"which holds whole numbers exactly only up to ±{EXACT_INTEGERS:,}")
    elif datatype == "FP16" and float(np.abs(x).max()) > float(np.finfo(np.float16).max):
        raise BadRequest(f"data holds numbers beyond the FP16 range (±{float(np.finfo(np.float16).max):g})")


def _checked(x: np.ndarray, shape: list[int], datatype: str) -> np.ndarray:
    """float64 values ``x`` checked for ``datatype``, as float32 of ``shape``."""
    if x.size:
        if not np.isfinite(x).all():
            raise BadRequest("data contains non-finite values (NaN or Infinity)")
        if float(np.abs(x).max()) > FP32_MAX:
            raise BadRequest(f"data holds numbers beyond the FP32 range (±{FP32_MAX:.4g})")
        _check_datatype(x, datatype)
    return x.astype(np.float32).reshape(shape)


def _flat(data: Any, shape: list[int], values: str = "numbers") -> list[Any]:
    """``data`` (flat, or nested exactly as ``shape``) as a flat list, or BadRequest."""
    count = math.prod(shape)
    if not isinstance(data, list):
        raise BadRequest(f"data must be a list of {count} {values} for shape {shape}")
    level, nested = data, [len(data)]
    while level and type(level[0]) is list:
        if len(nested) >= len(shape):
            raise BadRequest(f"data is nested deeper than its shape {shape}")
        if set(map(type, level)) != {list} or len(lengths := set(map(len, level))) != 1:
            raise BadRequest("data is ragged: nested lists must all have the same length and "
                             f"hold only lists or only {values}")
        nested.append(lengths.pop())
        level = list(chain.from_iterable(level))
    if len(nested) > 1 and nested != shape:
        raise BadRequest(f"data is nested as {nested} but shape is {shape}")
    if len(level) != count:
        raise BadRequest(f"data must hold {count} {values} for shape {shape}, got {len(level)}")
    return level


def _to_array(data: Any, shape: list[int], datatype: str = "FP64") -> np.ndarray:
    """JSON ``data`` (flat, or nested exactly as ``shape``) as float32 of that shape, or BadRequest."""
    level = _flat(data, shape)
    allowed = {bool} if datatype == "BOOL" else {int, float}
    found = set(map(type, level))
    if not found <= allowed:
        names = ", ".join(sorted({"null" if t is type(None) else t.__name__ for t in found - allowed}))
        raise BadRequest(f"data must contain {'true or false' if datatype == 'BOOL' else 'numbers'} "
                         f"only (found {names})")
    try:
        x = np.array(level, dtype=np.float64)
    except (OverflowError, ValueError):
        raise BadRequest("data holds a number that is too large") from None
    return _checked(x, shape, datatype)


def _from_binary(raw: bytes, shape: list[int], datatype: str) -> np.ndarray:
    """Binary tensor data (little-endian, row-major) as float32 of ``shape``, or BadRequest."""
    dtype = np.dtype(NUMPY_DTYPES[datatype])
    size = math.prod(shape) * dtype.itemsize
    if len(raw) != size:
        raise BadRequest(f"binary data of {len(raw)} bytes for a {datatype} tensor of shape {shape}: "
                         f"it takes {size}")
    if datatype == "BOOL" and raw and max(raw) > 1:
        raise BadRequest("BOOL binary data holds a byte other than 0 or 1")
    return _checked(np.frombuffer(raw, dtype).astype(np.float64), shape, datatype)


def _strings(raw: bytes, count: int) -> list[bytes]:
    """BYTES binary data: ``count`` elements, each a 4-byte little-endian length and its bytes."""
    found: list[bytes] = []
    at = 0
    while at < len(raw) and len(found) < count:
        size = int.from_bytes(raw[at:at + 4], "little")
        if at + 4 + size > len(raw):
            raise BadRequest(f"BYTES binary data ends inside element {len(found)} (its length says "
                             f"{size} bytes)")
        found.append(raw[at + 4:at + 4 + size])
        at += 4 + size
    if len(found) != count or at != len(raw):
        raise BadRequest(f"BYTES binary data must hold {count} elements (each a 4-byte length and its "
                         f"bytes) and nothing more")
    return found


def _texts(spec: dict, payload: bytes | None, rows: int, shape: list[int]) -> list[str]:
    """The ``text`` tensor's strings, one a row: UTF-8, none empty."""
    if payload is not None:
        items: list[Any] = _strings(payload, rows)
    else:
        items = _flat(spec.get("data"), shape, "strings")
        if not all(isinstance(s, str) for s in items):
            raise BadRequest(f"input {TEXT_INPUT!r} holds strings: its data must be a list of {rows}")
    texts = []
    for i, s in enumerate(items):
        try:
            text = s.decode("utf-8") if isinstance(s, bytes) else s
        except UnicodeDecodeError:
            raise BadRequest(f"text {i} is not valid UTF-8") from None
        if not text:
            raise BadRequest(f"text {i} is empty: the model needs at least one character to go on")
        texts.append(text)
    return texts


def _flag(params: dict, key: str, where: str) -> bool | None:
    value = params.get(key)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"'{where}parameters.{key}' must be true or false")
    return value


def _parameters(spec: dict, where: str) -> dict:
    params = spec.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise BadRequest(f"'{where}parameters' must be a JSON object, e.g. {{\"members\": true}}")
    return params


def _requested(body: dict, sig: Signature) -> tuple[list[str] | None, dict[str, bool]]:
    """The outputs a request names (None: it names none) and which of them go as binary data."""
    asked = body.get("outputs")
    if asked is None:
        return None, {}
    if not isinstance(asked, list) or not all(isinstance(o, dict) for o in asked):
        raise BadRequest("'outputs' must be a list of objects, e.g. [{\"name\": \"label\"}]")
    names: list[str] = []
    binary: dict[str, bool] = {}
    for o in asked:
        name = o.get("name")
        if name not in sig.outputs:
            raise BadRequest(f"no output {str(name)[:64]!r} in this model: its outputs are "
                             f"{', '.join(map(repr, sig.outputs))}")
        if name in names:
            raise BadRequest(f"output {name!r} is asked for twice")
        names.append(name)
        where = f"outputs[{len(names) - 1}]."
        params = _parameters(o, where)
        if params.get("classification"):  # Triton's classification extension (class_count)
            raise BadRequest(f"{where}parameters.classification: the classification extension is not "
                             f"served; ask for 'label' and 'probabilities'")
        flag = _flag(params, "binary_data", where)
        if flag is not None:
            binary[name] = flag
    return names, binary


def split_body(raw: bytes, json_length: str | None) -> tuple[bytes, bytes]:
    """(the JSON part, the binary data after it): the ``Inference-Header-Content-Length``
    header, when sent, says where the JSON ends."""
    if json_length is None:
        return raw, b""
    if not json_length.isdigit() or not 0 < int(json_length) <= len(raw):
        raise BadRequest(f"{INFERENCE_HEADER} is {json_length[:32]!r}: it must be the length of the "
                         f"JSON part, 1 to {len(raw)} bytes of this body")
    return raw[:int(json_length)], raw[int(json_length):]


def parse_request(raw: bytes, sig: Signature, json_length: str | None = None) -> ParsedRequest:
    """A request body, parsed and validated (its one input raw, before preprocessing), with any
    binary tensor data after the JSON (``json_length``: the ``Inference-Header-Content-Length``)."""
    head, tail = split_body(raw, json_length)
    body = _loads(head)
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list) or not body["inputs"]:
        raise BadRequest("body must be a JSON object with a non-empty 'inputs' list")
    params = _parameters(body, "")
    members = bool(_flag(params, "members", ""))
    binary_default = bool(_flag(params, "binary_data_output", ""))
    request_id = body.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest("'id' must be a string")
    if request_id is not None and len(request_id) > MAX_ID_CHARS:
        raise BadRequest(f"'id' is {len(request_id):,} characters; at most {MAX_ID_CHARS} are "
                         f"echoed back")
    outputs, binary = _requested(body, sig)
    if len(body["inputs"]) != 1:
        raise BadRequest(f"expected exactly 1 input tensor, got {len(body['inputs'])}")
    spec = body["inputs"][0]
    if not isinstance(spec, dict):
        raise BadRequest("each input must be an object with name, shape, datatype and data")
    name, datatype, shape = spec.get("name"), spec.get("datatype"), spec.get("shape")
    if name != INPUT_NAME and not (sig.text and name == TEXT_INPUT):
        raise BadRequest(f"no input {str(name)[:64]!r} in this model: its inputs are "
                         + " or ".join(f"{i['name']!r} ({i['datatype']} {i['shape']})" for i in sig.inputs()))
    size = _parameters(spec, "inputs[0].").get("binary_data_size")
    if size is not None and (type(size) is not int or size < 0 or "data" in spec):
        raise BadRequest("'binary_data_size' must be a whole number of bytes, given instead of 'data'")
    if size is not None and size != len(tail):
        raise BadRequest(f"input {name!r} declares {size} bytes of binary data; {len(tail)} follow "
                         f"the JSON")
    if size is None and tail:
        raise BadRequest(f"{len(tail)} bytes follow the JSON, but no input declares binary_data_size")
    payload = tail if size is not None else None
    if (not isinstance(shape, list) or not shape
            or not all(type(d) is int and d > 0 for d in shape)):
        raise BadRequest(f"shape must be a list of positive integers, got {shape!r}")
    if shape[0] > sig.max_rows:
        raise BadRequest(f"{shape[0]} rows in one request; this server takes at most {sig.max_rows} "
                         f"(tensorturn serve --max-rows)", 413)
    if name == TEXT_INPUT:
        if datatype != "BYTES":
            raise BadRequest(f"input {TEXT_INPUT!r} holds strings: its datatype is BYTES, not {datatype!r}")
        if shape[1:] not in ([], [1]):
            raise BadRequest(f"input {TEXT_INPUT!r} has one string a row: shape [N] (or [N, 1]), got {shape}")
        texts = _texts(spec, payload, shape[0], shape)
        return ParsedRequest(None, texts, members, request_id, outputs, binary, binary_default)
    if not isinstance(datatype, str) or datatype not in NUMPY_DTYPES or datatype == "BYTES":
        also = f", or strings as input {TEXT_INPUT!r} (BYTES)" if sig.text else ""
        raise BadRequest(f"unsupported datatype {str(datatype)[:16]!r} for input {INPUT_NAME!r}: send "
                         f"numbers (this model's is {sig.input_datatype}){also}")
    if shape[1:] != sig.input_shape:
        raise BadRequest(f"shape {shape} does not fit this model: expected [N, "
                         f"{', '.join(map(str, sig.input_shape))}]")
    x = (_from_binary(payload, shape, datatype) if payload is not None
         else _to_array(spec.get("data"), shape, datatype))
    return ParsedRequest(x, None, members, request_id, outputs, binary, binary_default)


BEARER = "bearer"  # the OpenAPI security scheme every /v2/models route names
_ERROR = {"content": {JSON: {"schema": {"type": "object", "properties": {"error": {"type": "string"}}}}}}
_REFUSED = {
    "401": {"description": "missing or invalid bearer token", **_ERROR},
    "404": {"description": "no such model (or version) on this server", **_ERROR},
    "429": {"description": "too many failed authentications from this address", **_ERROR},
}


def model_openapi() -> dict[str, Any]:
    """A /v2/models route's OpenAPI text besides its answer: the bearer token, its refusals."""
    return {"security": [{BEARER: []}], "responses": dict(_REFUSED)}


def infer_openapi(sig: Signature, served: list[tuple[str, str, list[int]]]) -> dict[str, Any]:
    """The infer route's OpenAPI text: its request and answer schemas, an example, its errors."""
    row = [0.0] * math.prod(sig.input_shape)
    inputs = ", or ".join(f"{i['name']} ({i['datatype']} {['N', *i['shape'][1:]]})" for i in sig.inputs())
    flag = {"type": "object", "properties": {"binary_data": {
        "type": "boolean", "description": "answer this output as binary data after the JSON"}}}
    request_schema = {
        "type": "object", "required": ["inputs"],
        "properties": {
            "id": {"type": "string", "maxLength": MAX_ID_CHARS,
                   "description": "echoed back (a UUID when absent)"},
            "parameters": {"type": "object", "properties": {
                "members": {"type": "boolean", "description": "also return each ensemble member's "
                                                              "probabilities"},
                "binary_data_output": {"type": "boolean", "description": "answer every output as "
                                                                         "binary data after the JSON"}}},
            "inputs": {"type": "array", "minItems": 1, "maxItems": 1, "description": f"one of: {inputs}",
                       "items": {
                "type": "object", "required": ["name", "shape", "datatype"],
                "properties": {
                    "name": {"type": "string", "enum": [i["name"] for i in sig.inputs()]},
                    "shape": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                    "datatype": {"type": "string", "enum": sorted(NUMPY_DTYPES)},
                    "data": {"type": "array", "items": {},
                             "description": "the raw inputs, row-major: flat or nested as shape"},
                    "parameters": {"type": "object", "properties": {"binary_data_size": {
                        "type": "integer", "minimum": 0,
                        "description": "sent as binary data after the JSON instead of data "
                                       "(Inference-Header-Content-Length: the JSON's length)"}}},
                }}},
            "outputs": {"type": "array", "description": "the outputs to answer (default: all but "
                                                        "the members')", "items": {
                "type": "object", "required": ["name"], "properties": {
                    "name": {"type": "string", "enum": list(sig.outputs)}, "parameters": flag}}},
        }}
    output = {"type": "object", "properties": {
        "name": {"type": "string"}, "datatype": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "data": {"type": "array", "items": {"type": ["number", "string"]}},
        "parameters": {"type": "object", "properties": {"binary_data_size": {"type": "integer"}}}}}
    answer = {"type": "object", "properties": {
        "model_name": {"type": "string"}, "model_version": {"type": "string"},
        "id": {"type": "string"},
        "outputs": {"type": "array", "items": output,
                    "description": ", ".join(f"{n} ({t} {['N', *s[1:]]})" for n, t, s in served)}}}
    return {
        "security": [{BEARER: []}],
        "requestBody": {"required": True, "content": {
            JSON: {"schema": request_schema, "example": {
                "inputs": [{"name": INPUT_NAME, "shape": [1, *sig.input_shape], "datatype": sig.input_datatype,
                            "data": row}]}},
            BINARY: {"schema": {"type": "string", "format": "binary", "description": (
                f"the binary tensor data extension: the JSON request, then the tensors' bytes; "
                f"{INFERENCE_HEADER} says the JSON's length")}}}},
        "responses": {
            "200": {"description": "predictions", "content": {
                JSON: {"schema": answer},
                BINARY: {"schema": {"type": "string", "format": "binary", "description": (
                    f"when an output is asked for as binary data: the JSON answer, then its bytes; "
                    f"{INFERENCE_HEADER} says the JSON's length")}}}},
            "400": {"description": "the body is not a valid request for this model", **_ERROR},
            **_REFUSED,
            "413": {"description": "body or rows over the server's limit", **_ERROR},
        },
    }


def finish_openapi(schema: dict[str, Any]) -> dict[str, Any]:
    """The generated OpenAPI document, finished: the bearer scheme declared, and FastAPI's 422
    dropped (nothing here answers 422: a bad body is a 400, a bad path a 404)."""
    schema.setdefault("components", {}).setdefault("securitySchemes", {})[BEARER] = {
        "type": "http", "scheme": "bearer",
        "description": "a token from `tensorturn token create`, sent as `Authorization: Bearer <token>`"}
    for methods in schema.get("paths", {}).values():
        for operation in methods.values():
            operation.get("responses", {}).pop("422", None)
    for unused in ("HTTPValidationError", "ValidationError"):
        schema["components"].get("schemas", {}).pop(unused, None)
    if not schema["components"].get("schemas", True):
        del schema["components"]["schemas"]
    return schema
