"""Running the inference API: uvicorn with a per-request deadline, a connection kept open after
an unexpected error, the ready banner, and the run marked as served while it runs; a port in
use one line (:func:`listening`), and a stop by Ctrl-C or SIGTERM a clean end, exit 0
(:func:`server_class`; the dashboard runs the same way).

uvicorn's own ``timeout_keep_alive`` covers only idle kept-alive connections, so a client that
opens a connection and trickles its request would hold it forever: :func:`timed_protocol` closes
a connection whose request did not arrive within ``--request-timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import orjson

from tensorturn.errors import TensorTurnError
from tensorturn.serve.app import ServeOptions, create_app
from tensorturn.serve.protocol import JSON
from tensorturn.state.manifest import serving
from tensorturn.store.objects import Store

log = logging.getLogger(__name__)


class KeepConnection:
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
    """Serve ``run_id`` on ``host:port`` until stopped (``tensorturn serve``)."""
    import uvicorn

    opts = options or ServeOptions()
    opts.max_body_bytes = max_body_bytes
    app = create_app(store, run_id, alias, options=opts)  # a model it will not serve is refused first
    sock = listening(host, port, "the API", "another server")
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
    config = uvicorn.Config(KeepConnection(app), host=host, port=port, loop=loop, http=http,
                            log_level="info", server_header=False, access_log=opts.access_log,
                            limit_concurrency=opts.limit_concurrency, timeout_keep_alive=5,
                            timeout_graceful_shutdown=5, lifespan="on",
                            proxy_headers=bool(opts.trusted_proxies),
                            forwarded_allow_ips=list(opts.trusted_proxies) or None)
    server = server_class(_banner(host, port, [alias, run_id] if alias else [run_id]))
    with serving(store, run_id, f"{host}:{port}"):  # `tensorturn runs rm` refuses a served run
        server(config).run(sockets=[sock])


def server_class(banner: str) -> Any:
    """uvicorn's Server, printing ``banner`` once it listens, whose stop by a signal (Ctrl-C,
    SIGTERM: a service manager's stop) ends the command normally, exit 0 — uvicorn raises the
    signal again once it has shut down, and the command would exit 1 ("Aborted!") or 143."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and not self.should_exit:
                print(banner, end="", file=sys.stderr, flush=True)

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                getattr(self, "_captured_signals", []).clear()  # (uvicorn's list of signals to raise again)

    return Server


def listening(host: str, port: int, what: str, hint: str) -> socket.socket:
    """A socket bound to ``host:port`` for ``what``, or one clear line why not (a port in use,
    say: ``hint`` names what may hold it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise TensorTurnError(f"{what} cannot listen on {host}:{port}: {exc.strerror or exc} "
                              f"({hint}? pass --port)") from exc
    sock.listen(128)
    return sock
