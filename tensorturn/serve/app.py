"""The authenticated inference API for a run's result (Open Inference Protocol, KServe V2).

Routes: ``GET /v2/health/live`` and ``/v2/health/ready`` (open), ``GET /v2/models/{name}``
(metadata) and ``POST /v2/models/{name}/infer`` (bearer token). ``{name}`` is the run id or the
alias given to ``tensorturn serve --name``. Inputs are the recipe's raw inputs; the recipe's
preprocessing runs here. An ensemble applies its vote; ``"parameters": {"members": true}`` in
a request adds each member's probabilities. The OpenAPI page is at ``/docs``.

How a request is served, and why the event loop never waits for long:

* tokens: an in-memory set of digests refreshed in the background (``apiauth``): a valid token is
  one lookup; a wrong one waits out a tarpit with ``await asyncio.sleep`` (no thread held), and
  an address that keeps failing gets 429.
* body: read up to ``--max-body-mb`` (413 beyond), parsed with orjson and validated with numpy —
  inline when small, on a small bounded pool of threads when large; at most ``--max-rows`` rows.
* model: requests queue for one model thread that runs everything queued as one batch
  (``batching``); the loop is woken once per batch.
* errors: every failure is a JSON ``{"error": ...}`` answer, never a dropped connection, and a
  connection that does not send a whole request within ``--request-timeout`` is closed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

import numpy as np
import orjson
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from tensorturn.errors import TensorTurnError
from tensorturn.recipes.check import check_contract
from tensorturn.recipes.kinds import Kind
from tensorturn.recipes.result import Predictor, load_result
from tensorturn.serve import tokens
from tensorturn.serve.auth import Authenticator, AuthError, FailureCounter, TokenCache
from tensorturn.serve.batching import Batcher
from tensorturn.state.manifest import serving
from tensorturn.store.objects import Store

log = logging.getLogger(__name__)

NUMERIC = {"FP16", "FP32", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32"}
DEFAULT_MAX_BODY = 8 * 1024 * 1024
FP32_MAX = float(np.finfo(np.float32).max)
INLINE_BODY_BYTES = 64 * 1024     # larger bodies are parsed off the event loop
INLINE_OUTPUT_VALUES = 32 * 1024  # larger answers are encoded off the event loop
MAX_ID_CHARS = 256                # a request's id is echoed back: a label, not a payload
JSON = "application/json"


@dataclass
class ServeOptions:
    """What ``tensorturn serve`` can tune (the defaults are its defaults)."""

    max_body_bytes: int = DEFAULT_MAX_BODY
    max_rows: int = 4096              # rows in one request (more → 413)
    max_batch_rows: int = 1024        # rows in one model call
    batch_window_ms: float = 0.0      # wait this long for more requests to batch (0: never wait)
    model_threads: int = 1            # torch threads for the model
    request_timeout_s: float = 10.0   # a request's headers and body must arrive within this
    limit_concurrency: int | None = 1000  # connections + requests in flight; more → 503
    auth_tarpit_s: float = 0.5        # a wrong token's 401 comes after this long
    auth_failure_limit: int = 20      # failed authentications per address per minute; then 429
    token_refresh_s: float = 2.0      # the token list is re-read this often
    access_log: bool = False


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


class BadRequest(ApiError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(status, message)


class _Disconnected(Exception):
    pass


def error_response(status: int, message: str, headers: Mapping[str, str] | None = None) -> Response:
    return Response(orjson.dumps({"error": message}), status_code=status, headers=headers,
                    media_type=JSON)


def _auth_error_response(exc: AuthError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else {}
    if exc.retry_after is not None:
        headers["Retry-After"] = str(exc.retry_after)
    return error_response(exc.status, exc.message, headers)


# ---------------------------------------------------------------------------------------------
# parsing and validation


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


def _to_array(data: Any, shape: list[int]) -> np.ndarray:
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
    return ParsedRequest(_to_array(spec.get("data"), shape), members, request_id)


# ---------------------------------------------------------------------------------------------
# the model


class Prediction(NamedTuple):
    combined: np.ndarray    # float32 [rows, ...]: probabilities, or predicted values
    per_member: np.ndarray  # float32 [members, rows, ...]


def _share(result: Prediction, start: int, stop: int) -> Prediction:
    return Prediction(result.combined[start:stop], result.per_member[:, start:stop])


def _tensor(name: str, datatype: str, data: np.ndarray) -> dict[str, Any]:
    data = np.ascontiguousarray(data)
    flat = data.reshape(-1)  # BYTES (class names) as a list of strings: orjson writes no object arrays
    return {"name": name, "datatype": datatype, "shape": list(data.shape),
            "data": flat.tolist() if flat.dtype == object else flat}


def encode_answer(name: str, version: str, request_id: str | None, pred: Prediction,
                  members: list[dict] | None, kind: Kind, classes: list[str] | None = None) -> bytes:
    """The Open Inference Protocol answer: the outputs the recipe's kind serves (``label``,
    ``probabilities`` and ``class_name`` where the recipe names its ``classes``; or
    ``prediction``), and each member's when asked."""
    outputs = [_tensor(o.name, o.datatype, o.data) for o in kind.served(pred.combined, classes)]
    for entry, p in zip(members or [], pred.per_member):
        outputs.append(_tensor(kind.member_output(entry["member"]), "FP32", p))
    return orjson.dumps({"model_name": name, "model_version": version,
                         "id": request_id or str(uuid.uuid4()), "outputs": outputs},
                        option=orjson.OPT_SERIALIZE_NUMPY)


# ---------------------------------------------------------------------------------------------
# the app


def _infer_openapi(input_shape: list[int], served: list[tuple[str, str, list[int]]]) -> dict[str, Any]:
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


def check_finite(predictor: Predictor, run_id: str) -> None:
    """Refuse a model with a NaN or infinite weight: it would answer every request with
    ``null`` probabilities (or garbage) while looking healthy."""
    for n, model in enumerate(predictor.models):
        tensors = chain(model.named_parameters(), model.named_buffers())
        bad = next((name for name, t in tensors
                    if t.is_floating_point() and not bool(torch.isfinite(t).all())), None)
        if bad is not None:
            where = f"member {predictor.members[n]['member']}'s " if predictor.members else ""
            raise TensorTurnError(f"run {run_id} is not served: {where}weight {bad} holds NaN or "
                                  f"infinite values (the run diverged)")


def create_app(store: Store, run_id: str, alias: str | None = None,
               max_body_bytes: int | None = None, options: ServeOptions | None = None) -> FastAPI:
    opts = options or ServeOptions()
    if max_body_bytes is not None:
        opts.max_body_bytes = max_body_bytes
    predictor, manifest = load_result(store, run_id)
    check_finite(predictor, run_id)
    recipe = predictor.recipe
    check_contract(manifest["recipe"], recipe, f"run {run_id} is not served", data=False)
    input_shape = recipe.input_shape()
    names = {run_id} | ({alias} if alias else set())
    version = manifest["model_sha256"][:12]
    members_meta = predictor.members

    kind = recipe.kind

    def run_model(x: np.ndarray) -> Prediction:
        with torch.inference_mode():
            combined, per_member = predictor.predict(recipe.preprocess(torch.from_numpy(x)))
            return Prediction(combined.float().numpy(), per_member.float().numpy())

    probe = run_model(np.zeros([1, *input_shape], np.float32))
    classes = recipe.classes
    served = [(o.name, o.datatype, [-1, *np.asarray(o.data).shape[1:]])
              for o in kind.served(probe.combined, classes)]
    batcher: Batcher[Prediction, Prediction] = Batcher(
        run_model, _share, max_rows=opts.max_batch_rows, window_s=opts.batch_window_ms / 1000,
        thread_init=lambda: torch.set_num_threads(opts.model_threads))
    cache = TokenCache(lambda: tokens.active_digests(store), refresh_s=opts.token_refresh_s)
    cache.load_now()
    auth = Authenticator(cache, tarpit_s=opts.auth_tarpit_s,
                         failures=FailureCounter(limit=opts.auth_failure_limit))
    heavy = ThreadPoolExecutor(2, thread_name_prefix="tensorturn-parse")  # big bodies / answers
    heavy_slots = asyncio.Semaphore(2)  # waiters queue on the loop, not in the pool

    async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        async with heavy_slots:
            return await asyncio.get_running_loop().run_in_executor(heavy, fn, *args)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        batcher.start(asyncio.get_running_loop())
        cache.start()
        try:
            yield
        finally:
            await cache.stop()
            batcher.stop()
            heavy.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="TensorTurn inference API", lifespan=lifespan,
                  description=f"Run {run_id} ({manifest['mode']}, recipe {manifest['recipe']}). "
                              "Open Inference Protocol (KServe V2). Send `Authorization: Bearer "
                              "<token>` (from `tensorturn token create`) on every /v2/models route.")
    app.state.batcher, app.state.tokens, app.state.options = batcher, cache, opts

    @app.exception_handler(StarletteHTTPException)
    async def _http_errors(_request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_errors(_request: Request, exc: RequestValidationError) -> Response:
        return error_response(422, f"invalid request: {exc.errors()}")

    @app.exception_handler(AuthError)
    async def _auth_errors(_request: Request, exc: AuthError) -> Response:
        return _auth_error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> Response:
        log.error("unexpected error", exc_info=exc)
        return error_response(500, "internal error (logged on the server)")

    async def authorize(request: Request) -> None:
        if auth.valid_now(request.headers.get("authorization")):
            return
        client = request.client.host if request.client else None
        await auth.check(request.headers.get("authorization"), client)

    def model_named(name: str) -> None:
        if name not in names:
            raise ApiError(404, f"no model {name!r} here; this server serves {sorted(names)}")

    @app.get("/v2/health/live", tags=["health"])
    async def live() -> dict:
        return {"live": True}

    @app.get("/v2/health/ready", tags=["health"])
    async def ready() -> dict:
        return {"ready": True}

    @app.get("/v2/models/{name}", tags=["models"])
    async def metadata(name: str, request: Request) -> Any:
        await authorize(request)
        if name not in names:
            return error_response(404, f"no model {name!r} here; this server serves "
                                       f"{sorted(names)}")
        return {
            "name": name, "versions": [version], "platform": "tensorturn",
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, *input_shape]}],
            "outputs": [{"name": n, "datatype": t, "shape": s} for n, t, s in served],
            "parameters": {"mode": manifest["mode"], "recipe": manifest["recipe"], "task": kind.name,
                           "run_id": run_id, "vote": predictor.vote,
                           "members": [m["member"] for m in members_meta],
                           "model_sha256": manifest["model_sha256"],
                           "limits": {"max_rows": opts.max_rows,
                                      "max_body_bytes": opts.max_body_bytes},
                           "metrics": manifest.get("metrics", {})},
        }

    async def infer_or_raise(name: str, request: Request) -> Response:
        await authorize(request)
        model_named(name)
        raw = await _read_body(request, opts.max_body_bytes)
        if len(raw) <= INLINE_BODY_BYTES:
            parsed = parse_request(raw, input_shape, opts.max_rows)
        else:
            parsed = await off_loop(parse_request, raw, input_shape, opts.max_rows)
        wrong = recipe.check_input(parsed.x)
        if wrong:
            raise BadRequest(wrong)
        pred = await batcher.submit(parsed.x)
        wanted = members_meta if parsed.members else None
        values = pred.combined.size * (1 + (len(wanted) if wanted else 0))
        if values <= INLINE_OUTPUT_VALUES:
            content = encode_answer(name, version, parsed.id, pred, wanted, kind, classes)
        else:
            content = await off_loop(encode_answer, name, version, parsed.id, pred, wanted, kind, classes)
        return Response(content, media_type=JSON)

    @app.post("/v2/models/{name}/infer", tags=["models"], response_class=Response,
              openapi_extra=_infer_openapi(input_shape, served))
    async def infer(name: str, request: Request) -> Response:
        """Predictions for the rows in `inputs[0].data` (the Open Inference Protocol)."""
        try:
            return await infer_or_raise(name, request)
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.headers)
        except AuthError as exc:
            return _auth_error_response(exc)
        except _Disconnected:
            return Response(status_code=400)  # nobody is left to read it
        except Exception:  # noqa: BLE001 - answer, and keep the connection usable
            log.exception("unexpected error serving an inference request")
            return error_response(500, "internal error (logged on the server)")

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than ``limit`` bytes before reading them all."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"request body of {int(declared)} bytes exceeds the limit of {limit}", 413)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise BadRequest(f"request body exceeds the limit of {limit} bytes", 413)
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# ---------------------------------------------------------------------------------------------
# the server


class _KeepConnection:
    """The outermost ASGI layer: an exception that escaped the app after its (JSON) 500 answer
    was sent is logged and swallowed here, so uvicorn keeps the connection open; Starlette's
    ServerErrorMiddleware re-raises, and uvicorn would close it."""

    def __init__(self, app: Callable[..., Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def send_tracked(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception:  # noqa: BLE001
            if started:  # the app's exception handler answered (and logged) it
                return
            log.exception("unexpected error")
            body = orjson.dumps({"error": "internal error (logged on the server)"})
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", JSON.encode()),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})


def timed_protocol(request_timeout_s: float, max_header_bytes: int = 64 * 1024) -> type:
    """uvicorn's httptools protocol, plus: a request's headers and body must arrive within
    ``request_timeout_s`` of the connection opening (or of the request's first byte, on a kept-
    alive connection), and its headers within ``max_header_bytes``; else the connection is
    closed. (uvicorn's own ``timeout_keep_alive`` covers only idle kept-alive connections.)"""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class TimedHttpToolsProtocol(HttpToolsProtocol):
        _deadline: asyncio.TimerHandle | None = None
        _in_headers = True
        _header_bytes = 0

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(request_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.logger.debug("closing a connection whose request did not arrive in time")
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._in_headers:
                self._header_bytes += len(data)
            super().data_received(data)
            if self._in_headers and self._header_bytes > max_header_bytes \
                    and not self.transport.is_closing():
                self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                                     b"content-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_headers, self._header_bytes = True, 0
            self._arm()

        def on_headers_complete(self) -> None:
            self._in_headers = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._disarm()
            super().on_message_complete()

    return TimedHttpToolsProtocol


def _banner(host: str, port: int, names: list[str]) -> str:
    url = f"http://{host}:{port}"
    models = ", ".join(names)
    return (f"TensorTurn API ready at {url} (OpenAPI page: {url}/docs)\n"
            f"  model(s): {models} → POST {url}/v2/models/{names[0]}/infer\n"
            f"  token:    tensorturn token create --name NAME (same --store / --join-file), then "
            f"send 'Authorization: Bearer <token>'\n")


def run_server(store: Store, run_id: str, host: str, port: int, alias: str | None,
               max_body_bytes: int, options: ServeOptions | None = None) -> None:
    import uvicorn

    opts = options or ServeOptions()
    opts.max_body_bytes = max_body_bytes
    app = create_app(store, run_id, alias, options=opts)
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    try:
        http: Any = timed_protocol(opts.request_timeout_s)
    except ImportError:
        log.warning("httptools is not installed (pip install 'uvicorn[standard]'): no request "
                    "timeout, and slower")
        http = "h11"
    config = uvicorn.Config(_KeepConnection(app), host=host, port=port, loop=loop, http=http,
                            log_level="info", server_header=False, access_log=opts.access_log,
                            limit_concurrency=opts.limit_concurrency, timeout_keep_alive=5,
                            timeout_graceful_shutdown=5, lifespan="on")
    banner = _banner(host, port, [alias, run_id] if alias else [run_id])

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and not self.should_exit:
                print(banner, end="", file=sys.stderr, flush=True)

    with serving(store, run_id, f"{host}:{port}"):  # `tensorturn runs rm` refuses a served run
        Server(config).run()
