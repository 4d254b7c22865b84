"""The dashboard's HTTP server: one page (``page.html``, HTML + JS, with uPlot vendored beside it
for the curves: nothing is fetched from the internet) that polls two JSON routes.

Routes: ``GET /`` the page; ``GET /static/...`` uPlot; ``GET /api/pool`` machines, runs and
served models; ``GET /api/runs/{run_id}`` one run; ``GET /health`` (open).

* Polling, not server-sent events: the JSON routes sit behind the same bearer-token check as the
  inference API when the server is bound beyond this machine, and a browser's ``EventSource``
  cannot send an ``Authorization`` header; ``fetch`` can.
* The page and uPlot hold no data and are open; the JSON routes need a token
  (``tensorturn token create``) unless the server listens on a loopback address only.
* Each view is computed at most once per refresh interval however many pages poll it, on a
  thread (the broker and the store are read with blocking clients), never on the event loop.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import ipaddress
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.staticfiles import StaticFiles

from tensorturn import config
from tensorturn.dashboard.view import pool_view, run_view, served_models
from tensorturn.errors import BrokerError, NotFound, SpecError, StoreError
from tensorturn.serve import tokens
from tensorturn.serve.auth import Authenticator, AuthError, FailureCounter, TokenCache
from tensorturn.serve.server import listening, server_class
from tensorturn.store.objects import open_store

log = logging.getLogger(__name__)

DEFAULT_PORT = 8265  # Ray's dashboard's port: where a Ray user looks first
SERVED_EVERY_S = 15.0  # served models are listed in the store less often (a server marks itself every 30 s)


@dataclass
class DashboardOptions:
    """What ``tensorturn dashboard`` can tune (the defaults are its defaults)."""

    refresh_s: float = 2.0        # the page polls this often; each view is computed at most this often
    runs_shown: int = 30          # the newest runs listed
    require_token: bool = False   # the JSON routes need a bearer token (set when bound beyond loopback)
    auth_tarpit_s: float = 0.5
    auth_failure_limit: int = 20
    # the Host names answered (any when empty): bound to loopback, the loopback names only, so a
    # page of another site that a DNS rebinding points at 127.0.0.1 reads nothing (400)
    allowed_hosts: tuple[str, ...] = ()


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")


def is_loopback(host: str) -> bool:
    """Whether ``host`` is an address (or name) only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Every:
    """A value computed on a thread at most once every ``period_s`` per key; callers that come
    while it is computed wait for that computation instead of starting their own."""

    def __init__(self, period_s: float):
        self.period_s = period_s
        self._done: dict[str, tuple[float, Any]] = {}
        self._pending: dict[str, asyncio.Future] = {}

    async def get(self, key: str, compute: Callable[[], Any]) -> Any:
        done = self._done.get(key)
        if done is not None and time.monotonic() - done[0] < self.period_s:
            return done[1]
        pending = self._pending.get(key)
        if pending is None:
            pending = self._pending[key] = asyncio.ensure_future(self._compute(key, compute))
        return await asyncio.shield(pending)

    async def _compute(self, key: str, compute: Callable[[], Any]) -> Any:
        try:
            began = time.monotonic()
            value = await asyncio.to_thread(compute)
            if len(self._done) > 256:  # runs looked at long ago
                self._done.clear()
            self._done[key] = (began, value)
            return value
        finally:
            self._pending.pop(key, None)


def security_headers(html: str) -> dict[str, str]:
    """Headers of every answer: never framed (clickjacking), nothing loaded from elsewhere, and
    only the page's own inline script run (by its hash)."""
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    hashes = " ".join("'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'"
                      for s in scripts)
    return {"X-Frame-Options": "DENY", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
            "Content-Security-Policy": f"default-src 'self'; script-src 'self' {hashes}; style-src 'self' "
                                       f"'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
                                       f"frame-ancestors 'none'; base-uri 'none'; form-action 'self'"}


def page_html(refresh_s: float) -> str:
    """The page, with its poll interval."""
    text = resources.files("tensorturn.dashboard").joinpath("page.html").read_text(encoding="utf-8")
    return text.replace("__REFRESH_MS__", str(int(refresh_s * 1000)))


def create_app(broker_url: str | None, store_url: str, options: DashboardOptions | None = None) -> FastAPI:
    """The dashboard of the pool at ``broker_url`` (None: the store's runs only) and ``store_url``."""
    opts = options or DashboardOptions()
    views = Every(opts.refresh_s)
    served = Every(SERVED_EVERY_S)
    auth: Authenticator | None = None
    cache: TokenCache | None = None
    if opts.require_token:
        store = open_store(store_url)
        cache = TokenCache(lambda: tokens.active_digests(store))
        cache.load_now()  # an unreadable store fails here, before the server listens
        auth = Authenticator(cache, tarpit_s=opts.auth_tarpit_s,
                             failures=FailureCounter(limit=opts.auth_failure_limit))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        if cache is not None:
            cache.start()
        try:
            yield
        finally:
            if cache is not None:
                await cache.stop()

    app = FastAPI(title="TensorTurn dashboard", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    html = page_html(opts.refresh_s)
    secure = security_headers(html)

    @app.middleware("http")
    async def headers(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        response = await call_next(request)
        response.headers.update(secure)
        return response

    if opts.allowed_hosts:  # (added last: it runs first, before anything is read)
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(opts.allowed_hosts), www_redirect=False)
    static = resources.files("tensorturn.dashboard").joinpath("static")
    app.mount("/static", StaticFiles(directory=str(static)), name="static")

    def answer(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        return JSONResponse({"error": config.mask_text(message)}, status_code=status, headers=headers)

    async def guarded(request: Request, view: Callable[[], Awaitable[Any]]) -> Response:
        """The view's JSON, after the token check when one is required; errors as JSON."""
        if auth is not None:
            try:
                client = request.client.host if request.client else None
                await auth.check(request.headers.get("authorization"), client)
            except AuthError as exc:
                headers = {"WWW-Authenticate": "Bearer"}
                if exc.retry_after:
                    headers["Retry-After"] = str(exc.retry_after)
                return answer(exc.status, exc.message, headers)
        try:
            return JSONResponse(await view(), headers={"Cache-Control": "no-store"})
        except NotFound as exc:
            return answer(404, str(exc))
        except SpecError as exc:
            return answer(400, str(exc))
        except (BrokerError, StoreError) as exc:
            return answer(503, str(exc))
        except Exception:  # noqa: BLE001 - the page shows the line and keeps polling
            log.exception("the dashboard could not build a view")
            return answer(500, "internal error (logged on the server)")

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(html, headers={"Cache-Control": "no-store"})

    @app.get("/health")
    async def health() -> dict:
        return {"live": True}

    @app.get("/api/pool")
    async def pool(request: Request) -> Response:
        async def view() -> Any:
            doc = await views.get("pool", lambda: pool_view(broker_url, store_url, opts.runs_shown))
            finished = [r["run_id"] for r in doc["runs"] if r.get("state") == "succeeded"]
            doc = {**doc, "served": await served.get(
                "served", lambda: _served_or_nothing(store_url, finished))}
            return doc

        return await guarded(request, view)

    @app.get("/api/runs/{run_id}")
    async def run(run_id: str, request: Request) -> Response:
        return await guarded(request, lambda: views.get(f"run:{run_id}",
                                                        lambda: run_view(run_id, broker_url, store_url)))

    return app


def _served_or_nothing(store_url: str, run_ids: list[str]) -> list[dict[str, Any]]:
    try:
        return served_models(store_url, run_ids)
    except StoreError as exc:
        log.warning("could not list the served models: %s", exc)
        return []


def run_dashboard(broker_url: str | None, store_url: str, host: str, port: int,
                  options: DashboardOptions | None = None) -> None:
    """Serve the dashboard on ``host:port`` until stopped (``tensorturn dashboard``)."""
    import uvicorn

    opts = options or DashboardOptions()
    opts.require_token = not is_loopback(host)
    if not opts.require_token:
        opts.allowed_hosts = (*LOOPBACK_NAMES, f"[{host}]" if ":" in host else host)
    app = create_app(broker_url, store_url, opts)
    shown = f"[{host}]" if ":" in host else host
    url = f"http://{shown}:{port}"
    pool = config.mask_url(broker_url) if broker_url else "none (runs from the store only)"
    banner = f"TensorTurn dashboard at {url}  (pool {pool}, store {config.mask_url(store_url)})\n"
    if opts.require_token:
        none_yet = not tokens.active_digests(open_store(store_url))
        banner += ("  bound beyond this machine: the page asks for an API token"
                   + (" (none exists yet)" if none_yet else "")
                   + ": tensorturn token create --name NAME (same --store / --join-file)\n")
    # (proxy_headers off: no client names its own address for the failed-token limit)
    uconfig = uvicorn.Config(app, host=host, port=port, log_level="warning", server_header=False,
                             access_log=False, timeout_graceful_shutdown=2, lifespan="on", proxy_headers=False)

    sock = listening(host, port, "the dashboard", "another dashboard")
    server_class(banner)(uconfig).run(sockets=[sock])
