"""The authenticated inference API for a run's result (Open Inference Protocol, KServe V2).

Routes: ``GET /v2/health/live`` and ``/v2/health/ready`` (open), ``GET /v2/models/{name}``
(metadata) and ``POST /v2/models/{name}/infer`` (bearer token). ``{name}`` is the run id or the
alias given to ``tensorturn serve --name``. Inputs are the recipe's raw inputs; the recipe's
preprocessing runs here. An ensemble applies its vote; ``"parameters": {"members": true}`` in
a request adds each member's probabilities. The OpenAPI page is at ``/docs``.
"""

from __future__ import annotations

import logging
import math
import uuid
from typing import Any

import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import layout
from .artifact import Predictor
from .errors import TensorTurnError
from .store import ObjectMissing, Store, sha256_hex
from .tokens import TokenChecker

log = logging.getLogger(__name__)

NUMERIC = {"FP16", "FP32", "FP64", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32"}
DEFAULT_MAX_BODY = 8 * 1024 * 1024


class BadRequest(HTTPException):
    def __init__(self, detail: str, status: int = 400):
        super().__init__(status_code=status, detail=detail)


def load_result(store: Store, run_id: str) -> tuple[Predictor, dict[str, Any]]:
    """The run's final artifact from the store, checked against the manifest's sha256."""
    try:
        manifest = store.get_json(layout.key("manifest", run_id))
    except ObjectMissing:
        raise TensorTurnError(f"no run {run_id!r} in the store (see `tensorturn runs`)") from None
    if manifest.get("state") != "succeeded" or not manifest.get("model_uri"):
        raise TensorTurnError(f"run {run_id} has no model to serve (state {manifest.get('state')})")
    final = "final_ensemble" if manifest["mode"] == "ensemble" else "final_model"
    data = store.get_bytes(layout.key(final, run_id))
    if sha256_hex(data) != manifest["model_sha256"]:
        raise TensorTurnError(f"run {run_id}: the model file does not match its recorded sha256")
    return Predictor.from_bytes(data), manifest


def _flatten(data: Any) -> list:
    if isinstance(data, list) and data and isinstance(data[0], list):
        return [x for row in data for x in _flatten(row)]
    return data


def parse_input(body: Any, input_shape: list[int]) -> torch.Tensor:
    """The request's one input tensor, validated, as float32 (raw, before preprocessing)."""
    if not isinstance(body, dict) or not isinstance(body.get("inputs"), list) or not body["inputs"]:
        raise BadRequest("body must be a JSON object with a non-empty 'inputs' list")
    if len(body["inputs"]) != 1:
        raise BadRequest(f"expected exactly 1 input tensor, got {len(body['inputs'])}")
    spec = body["inputs"][0]
    if not isinstance(spec, dict):
        raise BadRequest("each input must be an object with name, shape, datatype and data")
    datatype, shape, data = spec.get("datatype"), spec.get("shape"), spec.get("data")
    if datatype not in NUMERIC:
        raise BadRequest(f"unsupported datatype {datatype!r}: use a numeric type such as FP32")
    if (not isinstance(shape, list) or not shape
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise BadRequest(f"shape must be a list of positive integers, got {shape!r}")
    if shape[1:] != input_shape:
        raise BadRequest(f"shape {shape} does not fit this model: expected [N, "
                         f"{', '.join(map(str, input_shape))}]")
    flat = _flatten(data) if isinstance(data, list) else None
    if flat is None or len(flat) != math.prod(shape):
        raise BadRequest(f"data must hold {math.prod(shape)} numbers for shape {shape}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
        raise BadRequest("data must contain numbers only")
    x = torch.tensor(flat, dtype=torch.float64)
    if not bool(torch.isfinite(x).all()):
        raise BadRequest("data contains non-finite values (NaN or Infinity)")
    return x.view(shape).float()


def create_app(store: Store, run_id: str, alias: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY) -> FastAPI:
    predictor, manifest = load_result(store, run_id)
    recipe = predictor.recipe
    input_shape = recipe.input_shape()
    names = {run_id} | ({alias} if alias else set())
    check_token = TokenChecker(store)
    with torch.no_grad():
        n_classes = int(predictor.member_probabilities(
            recipe.preprocess(torch.zeros([1, *input_shape]))).shape[-1])

    app = FastAPI(title="TensorTurn inference API",
                  description=f"Run {run_id} ({manifest['mode']}, recipe {manifest['recipe']}). "
                              "Open Inference Protocol (KServe V2). Send `Authorization: Bearer "
                              "<token>` (from `tensorturn token create`) on every /v2/models route.")

    @app.exception_handler(StarletteHTTPException)
    async def _errors(_request: Request, exc: StarletteHTTPException):
        headers = {"WWW-Authenticate": "Bearer"} if exc.status_code == 401 else None
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=headers)

    def authorize(request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not check_token(token.strip()):
            raise HTTPException(401, "missing or invalid bearer token")

    def model_named(name: str) -> None:
        if name not in names:
            raise HTTPException(404, f"no model {name!r} here; this server serves {sorted(names)}")

    @app.get("/v2/health/live", tags=["health"])
    def live() -> dict:
        return {"live": True}

    @app.get("/v2/health/ready", tags=["health"])
    def ready() -> dict:
        return {"ready": True}

    @app.get("/v2/models/{name}", tags=["models"])
    def metadata(name: str, request: Request) -> dict:
        authorize(request)
        model_named(name)
        return {
            "name": name, "versions": [manifest["model_sha256"][:12]], "platform": "tensorturn",
            "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, *input_shape]}],
            "outputs": [{"name": "label", "datatype": "INT64", "shape": [-1]},
                        {"name": "probabilities", "datatype": "FP32", "shape": [-1, n_classes]}],
            "parameters": {"mode": manifest["mode"], "recipe": manifest["recipe"],
                           "run_id": run_id, "vote": predictor.vote,
                           "members": [m["member"] for m in predictor.members],
                           "model_sha256": manifest["model_sha256"],
                           "metrics": manifest.get("metrics", {})},
        }

    @app.post("/v2/models/{name}/infer", tags=["models"])
    async def infer(name: str, request: Request) -> dict:
        await run_in_threadpool(authorize, request)  # it may read the store, or wait on a miss
        model_named(name)
        body = await _read_json(request, max_body_bytes)
        x = parse_input(body, input_shape)
        with torch.no_grad():
            labels, probs, per_member = predictor.predict(recipe.preprocess(x))
        rows = int(x.shape[0])
        outputs = [
            {"name": "label", "datatype": "INT64", "shape": [rows], "data": labels.tolist()},
            {"name": "probabilities", "datatype": "FP32", "shape": [rows, n_classes],
             "data": probs.flatten().tolist()},
        ]
        wants_members = bool((body.get("parameters") or {}).get("members"))
        if wants_members and predictor.members:
            for entry, p in zip(predictor.members, per_member):
                outputs.append({"name": f"member_{entry['member']}_probabilities",
                                "datatype": "FP32", "shape": [rows, n_classes],
                                "data": p.flatten().tolist()})
        return {"model_name": name, "model_version": manifest["model_sha256"][:12],
                "id": body.get("id") or str(uuid.uuid4()), "outputs": outputs}

    return app


async def _read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refusing more than ``limit`` bytes before reading them all."""
    import json

    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise BadRequest(f"request body of {int(declared)} bytes exceeds the limit of {limit}", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(f"request body exceeds the limit of {limit} bytes", 413)
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        raise BadRequest("body is not valid JSON") from None


def run_server(store: Store, run_id: str, host: str, port: int, alias: str | None,
               max_body_bytes: int) -> None:
    import uvicorn

    app = create_app(store, run_id, alias, max_body_bytes)
    uvicorn.run(app, host=host, port=port, log_level="info", server_header=False)
