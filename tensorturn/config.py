"""Configuration: every ``TENSORTURN_*`` variable, read once into one frozen :class:`Settings`.

:data:`VARIABLES` is the one list of variables (the README's table is checked against it). S3 is
boto3's own ``AWS_*`` environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``), so MinIO, R2 and B2 need nothing TensorTurn-specific.

:func:`current` is the process's settings, read from the environment the first time it is asked
for; code that starts other processes (the embedded pool, agents) passes values down through
:meth:`Settings.environ` rather than re-reading variables of its own.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Mapping
from urllib.parse import urlsplit, urlunsplit

DEFAULT_STORE_DIR = "tensorturn-store"


@dataclass(frozen=True)
class Variable:
    env: str
    field: str
    default: Any
    doc: str


VARIABLES: tuple[Variable, ...] = (
    Variable("TENSORTURN_BROKER_URL", "broker_url", None,
             "Redis URL of the pool; unset: `run` starts a private embedded pool"),
    Variable("TENSORTURN_STORE_URL", "store_url", None,
             "object store: `file:///dir`, a directory or `s3://bucket/prefix` "
             "(default `./tensorturn-store`)"),
    Variable("TENSORTURN_JOIN", "join", None, "the join string of `tensorturn up`, for `agent`"),
    Variable("TENSORTURN_VISIBILITY_TIMEOUT_S", "visibility_timeout_s", 20,
             "seconds an unrefreshed task lease lasts before the task is requeued"),
    Variable("TENSORTURN_SHUTDOWN_GRACE_S", "shutdown_grace_s", 5.0,
             "seconds a stopping agent gives its running task before requeueing it"),
    Variable("TENSORTURN_HEARTBEAT_S", "heartbeat_s", 3.0,
             "seconds between an agent's telemetry heartbeats (offline after 3 missed)"),
    Variable("TENSORTURN_STORE_RETRIES", "store_retries", 6,
             "retries of a failing store call (exponential backoff) before it is an error"),
    Variable("TENSORTURN_STORE_BACKOFF_S", "store_backoff_s", 0.5,
             "first backoff of those retries; it doubles each time"),
    Variable("TENSORTURN_STALL_S", "stall_s", 120.0,
             "seconds without progress after which `status`/`run` say a run looks stalled"),
    Variable("TENSORTURN_DEVICE", "device", None, "force a torch device (`cpu`, `cuda:1`, `mps`)"),
    Variable("TENSORTURN_DEVICE_MEMORY_GB", "device_memory_gb", None,
             "cap on the device memory an agent offers (`agent --memory-gb`)"),
    Variable("TENSORTURN_LOGLEVEL", "loglevel", "INFO", "an agent's Celery log level"),
    Variable("TENSORTURN_SLOWDOWN", "slowdown", 1.0,
             "benchmarks/tests only: train this many times slower (emulates a slow machine)"),
    Variable("TENSORTURN_SERVE_RUN", "serve_run", None,
             "the run `Procfile`'s `api` line serves (read by the Procfile, not the code)"),
)


@dataclass(frozen=True)
class Settings:
    """Every setting TensorTurn reads from the environment; see :data:`VARIABLES`."""

    broker_url: str | None = None
    store_url: str | None = None
    join: str | None = None
    visibility_timeout_s: int = 20
    shutdown_grace_s: float = 5.0
    heartbeat_s: float = 3.0
    store_retries: int = 6
    store_backoff_s: float = 0.5
    stall_s: float = 120.0
    device: str | None = None
    device_memory_gb: float | None = None
    loglevel: str = "INFO"
    slowdown: float = 1.0
    serve_run: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Read every variable; a malformed number is one clear error naming the variable."""
        from .errors import SpecError

        environ = os.environ if environ is None else environ
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for var in VARIABLES:
            raw = environ.get(var.env)
            if raw is None or raw == "":
                continue
            kind = types[var.field]
            try:
                if kind.startswith("int"):
                    values[var.field] = int(raw)
                elif kind.startswith("float"):
                    values[var.field] = float(raw)
                else:
                    values[var.field] = raw
            except ValueError:
                raise SpecError(f"{var.env} must be a number (got {raw!r})") from None
        return cls(**values)

    @property
    def lease_refresh_s(self) -> float:
        """How often an agent refreshes its running tasks' leases: four times per timeout."""
        return max(1.0, self.visibility_timeout_s / 4)

    def resolved_store_url(self) -> str:
        return normalize_store_url(self.store_url) if self.store_url else default_store_url()

    def with_(self, **changes: Any) -> "Settings":
        return replace(self, **changes)

    def environ(self) -> dict[str, str]:
        """These settings as ``TENSORTURN_*`` variables, for a child process."""
        out = {}
        for var in VARIABLES:
            value = getattr(self, var.field)
            if value is not None and value != var.default:
                out[var.env] = str(value)
        return out


_current: Settings | None = None


def current() -> Settings:
    """This process's settings, read from the environment once."""
    global _current
    if _current is None:
        _current = Settings.from_env()
    return _current


def use(settings: Settings) -> Settings:
    """Make ``settings`` this process's (a command that was given values on its command line)."""
    global _current
    _current = settings
    return _current


def reload() -> Settings:
    """Read the environment again (tests, and a CLI that was handed new values)."""
    global _current
    _current = Settings.from_env()
    return _current


def default_store_url() -> str:
    return Path(DEFAULT_STORE_DIR).resolve().as_uri()


def normalize_store_url(url: str) -> str:
    """Accept a bare path as a file store; ``file://`` and ``s3://`` URLs pass through."""
    if "://" not in url:
        return Path(url).expanduser().resolve().as_uri()
    return url


def mask_url(url: str | None) -> str:
    """The URL with any password replaced by ``***``, safe to print or log."""
    if not url:
        return str(url)
    parts = urlsplit(url)
    if parts.password is None and "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0]
    netloc = f"{user}:***@{hostport}" if parts.password is not None else f"***@{hostport}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


_SECRET_IN_TEXT = re.compile(r"(\w+://[^:/@\s]*:)([^@\s]+)(@)")


def mask_text(text: str) -> str:
    """Mask passwords of every URL inside a free-form message (exceptions quote URLs)."""
    return _SECRET_IN_TEXT.sub(r"\1***\3", text)
