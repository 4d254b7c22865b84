"""The authenticated inference API for a run's result (Open Inference Protocol, KServe V2).

Routes: ``GET /v2`` (server metadata), ``GET /v2/health/live`` and ``/v2/health/ready`` (open);
``GET /v2/models/{name}`` (metadata), ``GET /v2/models/{name}/ready`` and ``POST
/v2/models/{name}/infer``, each also under ``/v2/models/{name}/versions/{version}`` (bearer
token). ``{name}`` is the run id or the alias given to ``tensorturn serve --name``; the one
version is the model file's sha256, cut to 12. Inputs are the recipe's raw inputs (``input``;
a text model also takes strings, ``text``); the recipe's preprocessing runs here. An ensemble
applies its vote, and answers its members' outputs when asked for by name (or all of them with
``"parameters": {"members": true}``). Any input or output may travel as binary data after the
JSON (the binary tensor data extension: the official clients' default). The OpenAPI page is at
``/docs``, served with no CDN.

How a request is served, and why the event loop never waits for long:

* tokens: an in-memory set of digests refreshed in the background (``auth``): a valid token is
  one lookup; a wrong one waits out a tarpit with ``await asyncio.sleep`` (no thread held), and
  an address that keeps failing gets 429.
* body: read up to ``--max-body-mb`` (413 beyond), parsed with orjson and validated with numpy
  (``protocol``) — inline when small, on a small bounded pool of threads when large; at most
  ``--max-rows`` rows.
* model: requests queue for one model thread that runs everything queued as one batch
  (``batching``); the loop is woken once per batch.
* errors: every failure is a JSON ``{"error": ...}`` answer, never a dropped connection, and a
  connection that does not send a whole request within ``--request-timeout`` is closed
  (``server``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from tensorturn import __version__
from tensorturn.errors import TensorTurnError
from tensorturn.predictor import Predictor, load_result
from tensorturn.recipes.answer import NUMPY_DTYPES, Prediction, encode_outputs, served_outputs, share
from tensorturn.recipes.contract import check_contract
from tensorturn.serve import tokens
from tensorturn.serve.auth import Authenticator, AuthError, FailureCounter, TokenCache
from tensorturn.serve.batching import Batcher
from tensorturn.serve.protocol import (
    BINARY,
    INFERENCE_HEADER,
    JSON,
    ApiError,
    BadRequest,
    ParsedRequest,
    Signature,
    auth_error_response,
    error_response,
    finish_openapi,
    infer_openapi,
    model_openapi,
    parse_request,
)
from tensorturn.store.objects import Store

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY = 8 * 1024 * 1024
INLINE_BODY_BYTES = 64 * 1024     # larger bodies are parsed off the event loop
INLINE_OUTPUT_VALUES = 32 * 1024  # larger answers are encoded off the event loop


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
    # reverse proxies whose X-Forwarded-For is believed (none: the header is ignored, so a client
    # cannot dodge the failed-authentication limit with a new address in each request)
    trusted_proxies: tuple[str, ...] = ()


class _Disconnected(Exception):
    pass


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


class ServedModel:
    """A run's result, checked and ready to answer: refused before the server listens when its
    signature, weights or recipe contract are wrong, and probed once so the outputs it serves
    are known for the metadata and the OpenAPI page."""

    def __init__(self, store: Store, run_id: str, alias: str | None, max_rows: int = ServeOptions.max_rows):
        self.predictor, self.manifest = load_result(store, run_id)
        check_finite(self.predictor, run_id)
        self.recipe = self.predictor.recipe
        check_contract(self.manifest["recipe"], self.recipe, f"run {run_id} is not served", data=False,
                       model=self.predictor.models[0])
        self.run_id, self.kind, self.classes = run_id, self.recipe.kind, self.recipe.classes
        self.input_shape = self.recipe.input_shape()
        self.names = {run_id} | ({alias} if alias else set())
        self.version = self.manifest["model_sha256"][:12]
        probe = self.run(np.zeros([1, *self.input_shape], np.float32))
        members = self.predictor.members or None
        # every output it answers: the members' only when asked for (by name, or all of them)
        self.served = [(o.name, o.datatype, [-1, *np.asarray(o.data).shape[1:]])
                       for o in served_outputs(probe, members, self.kind, self.classes)]
        self.member_outputs = {self.kind.member_output(m["member"]) for m in self.predictor.members}
        declared = self.recipe.input_dtype
        # a text recipe (charlm and its byte-level kin) encodes a string into its token ids
        self.encode = getattr(self.recipe, "encode", None) if self.kind.name == "language_model" else None
        self.signature = Signature(self.input_shape, tuple(n for n, _, _ in self.served),
                                   declared if declared in NUMPY_DTYPES else "FP32", callable(self.encode),
                                   max_rows)

    def run(self, x: np.ndarray) -> Prediction:
        """The model on raw rows ``x`` (the recipe preprocesses them), as served
        (:meth:`Predictor.serve_rows`: an exported model's ``predict`` runs the same)."""
        return self.predictor.serve_rows(x)

    def check_name(self, name: str, version: str | None = None) -> None:
        """404 unless this server serves a model called ``name`` (the run id or its alias), and
        ``version`` (when given) is its version."""
        if name not in self.names:
            raise ApiError(404, f"no model {name!r} here; this server serves {sorted(self.names)}")
        if version is not None and version != self.version:
            raise ApiError(404, f"model {name!r} has no version {version[:64]!r}; its version is "
                                f"{self.version!r}")

    def windows(self, texts: list[str]) -> list[np.ndarray]:
        """Each text as the token ids the model reads: its last ``input_shape`` tokens (a
        language model predicts what follows its window)."""
        assert self.encode is not None
        context = self.input_shape[-1]
        rows = []
        for i, text in enumerate(texts):
            try:
                ids = self.encode(text)
            except ValueError as exc:
                raise BadRequest(f"text {i}: {exc}") from None
            rows.append(np.asarray(ids, dtype=np.float32)[-context:])
        return rows

    def metadata(self, name: str, opts: ServeOptions) -> dict[str, Any]:
        """``GET /v2/models/{name}``: the inputs and outputs, the run, the limits, the metrics."""
        manifest = self.manifest
        return {
            "name": name, "versions": [self.version], "platform": "tensorturn",
            "inputs": self.signature.inputs(),
            "outputs": [{"name": n, "datatype": t, "shape": s} for n, t, s in self.served],
            "parameters": {"mode": manifest["mode"], "recipe": manifest["recipe"],
                           "task": self.kind.name, "run_id": self.run_id, "vote": self.predictor.vote,
                           "members": [m["member"] for m in self.predictor.members],
                           "member_outputs": sorted(self.member_outputs),
                           "one_input_of": [i["name"] for i in self.signature.inputs()],
                           "model_sha256": manifest["model_sha256"],
                           "limits": {"max_rows": opts.max_rows,
                                      "max_body_bytes": opts.max_body_bytes},
                           "metrics": manifest.get("metrics", {})},
        }


class Inference:
    """What answering a request takes besides the model: the token check, the batcher that runs
    the model on its own thread, and two threads for bodies and answers too large to handle on
    the event loop."""

    def __init__(self, store: Store, model: ServedModel, opts: ServeOptions):
        self.model, self.opts = model, opts
        self.batcher: Batcher[Prediction, Prediction] = Batcher(
            model.run, share, max_rows=opts.max_batch_rows, window_s=opts.batch_window_ms / 1000,
            thread_init=lambda: torch.set_num_threads(opts.model_threads))
        self.tokens = TokenCache(lambda: tokens.active_digests(store), refresh_s=opts.token_refresh_s)
        self.tokens.load_now()
        self.auth = Authenticator(self.tokens, tarpit_s=opts.auth_tarpit_s,
                                  failures=FailureCounter(limit=opts.auth_failure_limit))
        self.heavy = ThreadPoolExecutor(2, thread_name_prefix="tensorturn-parse")
        self.heavy_slots = asyncio.Semaphore(2)  # waiters queue on the loop, not in the pool

    @asynccontextmanager
    async def lifespan(self, _app: FastAPI) -> AsyncIterator[None]:
        self.batcher.start(asyncio.get_running_loop())
        self.tokens.start()
        try:
            yield
        finally:
            await self.tokens.stop()
            self.batcher.stop()
            self.heavy.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        async with self.heavy_slots:
            return await asyncio.get_running_loop().run_in_executor(self.heavy, fn, *args)

    async def authorize(self, request: Request) -> None:
        if self.auth.valid_now(request.headers.get("authorization")):
            return
        client = request.client.host if request.client else None
        await self.auth.check(request.headers.get("authorization"), client)

    async def infer(self, name: str, request: Request, version: str | None = None) -> Response:
        """One request's answer, or ApiError / AuthError / _Disconnected."""
        model, opts = self.model, self.opts
        await self.authorize(request)
        model.check_name(name, version)
        raw = await _read_body(request, opts.max_body_bytes)
        args = (raw, model.signature, request.headers.get(INFERENCE_HEADER))
        parsed: ParsedRequest = (parse_request(*args) if len(raw) <= INLINE_BODY_BYTES
                                 else await self.off_loop(parse_request, *args))
        if parsed.x is None:
            pred = await self.run_windows(model.windows(parsed.texts or []))
        else:
            wrong = model.recipe.check_input(parsed.x)
            if wrong:
                raise BadRequest(wrong)
            pred = await self.batcher.submit(parsed.x)
        asked = parsed.outputs
        members = parsed.members or bool(asked and model.member_outputs.intersection(asked))
        outputs = served_outputs(pred, model.predictor.members if members else None, model.kind,
                                 model.classes)
        if asked is not None:
            by_name = {o.name: o for o in outputs}
            outputs = [by_name[n] for n in asked]
        binary = {o.name for o in outputs if parsed.is_binary(o.name)}
        encode = (name, model.version, parsed.id, outputs, binary)
        if sum(np.size(o.data) for o in outputs) <= INLINE_OUTPUT_VALUES:
            content, json_length = encode_outputs(*encode)
        else:
            content, json_length = await self.off_loop(encode_outputs, *encode)
        if json_length is None:
            return Response(content, media_type=JSON)
        return Response(content, media_type=BINARY, headers={INFERENCE_HEADER: str(json_length)})

    async def run_windows(self, rows: list[np.ndarray]) -> Prediction:
        """The model on token windows of different lengths (texts): one batch submission per
        length (a batch stacks rows of one shape), the answers put back in order."""
        by_length: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            by_length.setdefault(len(row), []).append(i)
        parts = await asyncio.gather(*(self.batcher.submit(np.stack([rows[i] for i in group]))
                                       for group in by_length.values()))
        if len(parts) == 1:
            return parts[0]
        back = np.argsort(np.concatenate(list(by_length.values())))
        return Prediction(np.concatenate([p.combined for p in parts])[back],
                          np.concatenate([p.per_member for p in parts], axis=1)[:, back])


def _error_handlers(app: FastAPI) -> None:
    """Every failure outside the infer route as a JSON ``{"error": ...}`` answer."""

    @app.exception_handler(StarletteHTTPException)
    async def _http_errors(_request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_errors(_request: Request, exc: RequestValidationError) -> Response:
        return error_response(422, f"invalid request: {exc.errors()}")

    @app.exception_handler(ApiError)
    async def _api_errors(_request: Request, exc: ApiError) -> Response:
        return error_response(exc.status, exc.message, exc.headers)

    @app.exception_handler(AuthError)
    async def _auth_errors(_request: Request, exc: AuthError) -> Response:
        return auth_error_response(exc)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> Response:
        log.error("unexpected error", exc_info=exc)
        return error_response(500, "internal error (logged on the server)")


def create_app(store: Store, run_id: str, alias: str | None = None,
               max_body_bytes: int | None = None, options: ServeOptions | None = None) -> FastAPI:
    """The API for ``run_id`` (also called ``alias``); TensorTurnError when it is not servable."""
    opts = options or ServeOptions()
    if max_body_bytes is not None:
        opts.max_body_bytes = max_body_bytes
    model = ServedModel(store, run_id, alias, opts.max_rows)
    inference = Inference(store, model, opts)
    manifest = model.manifest
    # FastAPIOffline: FastAPI whose /docs and /redoc load their scripts from this server, not a CDN
    app = FastAPIOffline(title="TensorTurn inference API", version=__version__, lifespan=inference.lifespan,
                         description=f"Run {run_id} ({manifest['mode']}, recipe {manifest['recipe']}). "
                                     "Open Inference Protocol (KServe V2), with its binary tensor data "
                                     "extension. Send `Authorization: Bearer <token>` (from `tensorturn "
                                     "token create`) on every /v2/models route.")
    app.state.batcher, app.state.tokens, app.state.options = inference.batcher, inference.tokens, opts
    _error_handlers(app)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = finish_openapi(get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/v2", tags=["server"])
    async def server_metadata() -> dict:
        """The server's name, version and protocol extensions."""
        return {"name": "tensorturn", "version": __version__, "extensions": ["binary_tensor_data"]}

    @app.get("/v2/health/live", tags=["health"])
    async def live() -> dict:
        return {"live": True}

    @app.get("/v2/health/ready", tags=["health"])
    async def ready() -> dict:
        return {"ready": True}

    for prefix in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        _model_routes(app, prefix, model, inference)
    return app


def _model_routes(app: FastAPI, prefix: str, model: ServedModel, inference: Inference) -> None:
    """Metadata, readiness and inference under ``prefix``: a model, or a version of it (read
    from the path, so that the routes without one take no ``version`` query parameter)."""
    opts = inference.opts
    version = ({"parameters": [{"name": "version", "in": "path", "required": True, "schema": {"type": "string"},
                                "description": "the model's version (its metadata lists it)"}]}
               if "{version}" in prefix else {})

    @app.get(prefix, tags=["models"], openapi_extra={**model_openapi(), **version})
    async def metadata(name: str, request: Request) -> Any:
        """The model's inputs, outputs and versions, and what run it is."""
        await inference.authorize(request)
        model.check_name(name, request.path_params.get("version"))
        return model.metadata(name, opts)

    @app.get(f"{prefix}/ready", tags=["models"], openapi_extra={**model_openapi(), **version})
    async def model_ready(name: str, request: Request) -> Any:
        """200 once the model answers (it is loaded before the server listens)."""
        await inference.authorize(request)
        model.check_name(name, request.path_params.get("version"))
        return {"name": name, "ready": True}

    @app.post(f"{prefix}/infer", tags=["models"], response_class=Response,
              openapi_extra={**infer_openapi(model.signature, model.served), **version})
    async def infer(name: str, request: Request) -> Response:
        """Predictions for the rows of the request's one input (the Open Inference Protocol)."""
        try:
            return await inference.infer(name, request, request.path_params.get("version"))
        except ApiError as exc:
            return error_response(exc.status, exc.message, exc.headers)
        except AuthError as exc:
            return auth_error_response(exc)
        except _Disconnected:
            return Response(status_code=400)  # nobody is left to read it
        except Exception:  # noqa: BLE001 - answer, and keep the connection usable
            log.exception("unexpected error serving an inference request")
            return error_response(500, "internal error (logged on the server)")


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
