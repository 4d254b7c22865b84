"""Configuration: every ``TENSORTURN_*`` variable, read once into one frozen :class:`Settings`.

:data:`VARIABLES` is the one list of variables (the README's table is checked against it). S3 is
boto3's own ``AWS_*`` environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``), so MinIO, R2 and B2 need nothing TensorTurn-specific.

:func:`current` is the process's settings, read from the environment the first time it is asked
for; code that starts other processes (the embedded pool, agents) passes values down through
:meth:`Settings.environ` rather than re-reading variables of its own.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

DEFAULT_STORE_DIR = "tensorturn-store"


# Every variable, with what it does: the README's table is this one (`python -m tensorturn.config`).
# The name of a variable is TENSORTURN_ and its Settings field in capitals; defaults are the fields'.
# Only what a user would set: the test and benchmark emulations (a step's time, a slower machine,
# a battery sensor) are hooks the tooling installs (tensorturn.testbed_hooks), not settings.
_DOCS = """
broker_url            Redis URL of the pool; unset, `run` starts a private embedded pool
store_url             object store: `file:///dir`, a directory or `s3://bucket/prefix` (default `./tensorturn-store`)
join                  the join string from `tensorturn up` (prefer `--join-file`; never put it on a command line)
join_file             a file holding that join string (`tensorturn up` writes `.tensorturn/join`)
pool_key              the pool key that signs runs, tasks, manifests and tokens (`ttk1.…`; usually from the join file)
pool_key_file         where the pool key is kept; `run` and `up` make it if missing (default `.tensorturn/pool-key`)
allow_recipes         comma-separated `module:attr` patterns of other recipes this machine may import (`--allow-recipe`)
visibility_timeout_s  seconds an unrefreshed task lease lasts before the task goes back to the queue
shutdown_grace_s      seconds a stopping agent gives its running task before requeueing it
stop_limit_s          seconds a command stopping on Ctrl-C or SIGTERM may take before it kills what it started and exits
heartbeat_s           seconds between an agent's telemetry heartbeats (offline after 3 missed)
store_retries         retries of a failing store call, with exponential backoff, before it is an error
store_backoff_s       the first of those backoffs; it doubles each time (at most 8 s)
part_mb               S3 objects over 4 parts move in parts of this many MiB, each retried on its own (min 5)
stall_s               seconds without progress after which `status` and `run` say a run looks stalled and why
run_ttl_s             seconds a finished run's Redis keys are kept; then `status`, `runs`, `report` read its manifest
agent_ttl_s           seconds a stopped or silent agent stays listed (offline); then it is forgotten, its queue too
device                force a torch device: `cpu`, `cuda:1`, `mps`
cache_dir             where an agent keeps dataset chunks (default: the user's cache, `~/.cache/tensorturn/chunks`)
cache_gb              the most disk the chunk cache may use; least recently used chunks go first (`agent --cache-gb`)
device_memory_gb      cap on the device memory an agent offers to the pool (`agent --memory-gb`)
loglevel              an agent's Celery log level
hours                 the local hours an agent may work, e.g. `22:00-08:00` (comma-separated ranges; `agent --hours`)
pause_on_battery      1: an agent pauses while its machine runs on battery (`agent --pause-on-battery`)
pause_busy_percent    an agent pauses while other processes use over this % of the CPU; 0: never (`--pause-when-busy`)
pause_gpu_shared      1: an agent pauses while another process uses its GPU (`agent --pause-when-gpu-shared`)
max_upload_mbit       an agent's cap on its uploads to the store, Mbit/s; 0: none (`agent --max-upload-mbit`)
max_download_mbit     an agent's cap on its downloads from the store, Mbit/s; 0: none (`agent --max-download-mbit`)
data_cap_gb           GB an agent may move per `day`, `week` or `month` (`200/month`), then it pauses (`--data-cap-gb`)
agent_pool            how an agent runs tasks: `prefork` (Linux's default) or `threads` (elsewhere; `agent --pool`)
role                  what an agent takes: `train`, `outer` (outer steps, beside the store) or `both` (`agent --role`)
quick_end_s           seconds a fused round may take to end (last two shards → θ) and queue the next ahead; 0: never
serve_run             the run the `Procfile`'s `api` line serves (read by the Procfile, not by TensorTurn)
"""


@dataclass(frozen=True)
class Variable:
    env: str
    field: str
    default: Any
    doc: str


# numeric settings that may be 0 (the others must be more): no retries, no grace, no cache
MAY_BE_ZERO = {"store_retries", "store_backoff_s", "shutdown_grace_s", "cache_gb", "quick_end_s",
               "pause_on_battery", "pause_busy_percent", "pause_gpu_shared", "max_upload_mbit",
               "max_download_mbit"}


@dataclass(frozen=True)
class Settings:
    """Every setting TensorTurn reads from the environment (``TENSORTURN_<FIELD>``)."""

    broker_url: str | None = None
    store_url: str | None = None
    join: str | None = None
    join_file: str | None = None
    pool_key: str | None = None
    pool_key_file: str | None = None
    allow_recipes: str | None = None
    # 4 s, refreshed every second (requeue p95 ≤ 5 s, BENCHMARKS.md §5). The refreshes are
    # hedged (tensorturn.pool.lease): one queued behind a saturated uplink's drops does not hold
    # up the next, which is what made 4 s unsafe on 1 Mbit/s links before
    visibility_timeout_s: int = 4
    shutdown_grace_s: float = 5.0
    stop_limit_s: float = 120.0
    heartbeat_s: float = 3.0
    store_retries: int = 6
    store_backoff_s: float = 0.5
    part_mb: float = 16.0
    stall_s: float = 120.0
    run_ttl_s: float = 7 * 24 * 3600.0
    agent_ttl_s: float = 24 * 3600.0
    device: str | None = None
    cache_dir: str | None = None
    cache_gb: float = 4.0
    device_memory_gb: float | None = None
    loglevel: str = "INFO"
    hours: str | None = None
    pause_on_battery: int = 0
    pause_busy_percent: float = 0.0
    pause_gpu_shared: int = 0
    max_upload_mbit: float = 0.0
    max_download_mbit: float = 0.0
    data_cap_gb: str | None = None
    agent_pool: str | None = None
    role: str = "train"
    quick_end_s: float = 1.0
    serve_run: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "Settings":
        """Read every variable; a malformed number is one clear error naming the variable."""
        from tensorturn.errors import SpecError

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
            number = values[var.field]
            if isinstance(number, (int, float)):
                low = 0 if var.field in MAY_BE_ZERO else None
                if not math.isfinite(number) or number < 0 or (low is None and number == 0):
                    bound = "≥ 0" if low == 0 else "> 0"
                    raise SpecError(f"{var.env} must be a finite number {bound} (got {raw!r})")
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


def _variables() -> tuple[Variable, ...]:
    defaults = {f.name: f.default for f in fields(Settings)}
    out = []
    for line in _DOCS.strip().splitlines():
        name, doc = line.split(maxsplit=1)
        out.append(Variable(f"TENSORTURN_{name.upper()}", name, defaults[name], doc))
    return tuple(out)


VARIABLES: tuple[Variable, ...] = _variables()


def markdown_table() -> str:
    """The variables as the README's table."""
    rows = ["| variable | default | what it does |", "|---|---|---|"]
    rows += [f"| `{v.env}` | {'—' if v.default is None else f'`{v.default}`'} | {v.doc} |"
             for v in VARIABLES]
    return "\n".join(rows)


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
    """The URL with any password replaced by ``***``, safe to print or log (:func:`mask_text`)."""
    if not url:
        return str(url)
    return mask_text(url)


# What follows a URL's ``scheme://``, up to the next whitespace: a password may hold any other
# character, so where its URL ends is decided by :func:`_mask_userinfo`, not here. (Matched from
# the ``://`` back, never from each letter that could start a scheme: that takes quadratic time
# on a text like "a.a.a…", and logs of a megabyte are masked.)
_AFTER_SCHEME = re.compile(r"(?<=[A-Za-z0-9+.-]://)\S+")
# A query parameter that holds a secret (redis-py takes ``?password=``; presigned URLs carry
# ``X-Amz-Signature``): its name, or a name ending in ``_name``/``-name``/``.name``.
_SECRET_PARAM = re.compile(r"(?i)([?&](?:[\w.-]*[_.-])?(?:password|passwd|pass|pwd|secret|token|key|signature|sig)=)"
                           r"[^&\s]*")
_KEY_IN_TEXT = re.compile(r"\b(tt1|ttk1)\.[A-Za-z0-9_\-]{8,}")  # join strings, pool keys


def _mask_userinfo(match: re.Match) -> str:
    """``user:***@host...`` (after ``scheme://``): the password masked up to the ``@`` that ends it.

    urlsplit (and so redis-py) ends the host part at the first ``/``, ``?`` or ``#`` and takes
    its *last* ``@`` as the end of the password, so ``:p@ss@host`` is the password ``p@ss``.
    A password holding ``/``, ``?`` or ``#`` unencoded misleads urlsplit, yet is a secret all
    the same: where the part before the first of those holds a ``:`` (a password follows, or a
    port), the password runs to the last ``@`` of the whole URL — at worst a URL with a port and
    an ``@`` in its path is masked more than needed, never less."""
    rest = match.group(0)
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    at = rest.rfind("@") if ":" in authority else authority.rfind("@")
    if at < 0:
        return rest
    user, colon, _ = rest[:at].partition(":")
    return f"{user}:***{rest[at:]}" if colon else f"***{rest[at:]}"


def mask_text(text: str) -> str:
    """Mask the secrets inside a free-form message (exceptions quote URLs, and a recipe may quote
    anything): every URL's password, secret query parameters, join strings and pool keys."""
    text = _AFTER_SCHEME.sub(_mask_userinfo, text)
    return _KEY_IN_TEXT.sub(r"\1.***", _SECRET_PARAM.sub(r"\1***", text))


# A field whose name says it holds a secret (``password``, ``api_token``, ``pool_key``,
# ``aws_secret_access_key``, ``sig``): a word of its name, the words split at ``_``, ``-`` or ``.``
# (so ``tokens_per_step`` or ``design`` are not).
_SECRET_NAME = re.compile(r"(?i)(?:^|[_.\-])(?:password|passwd|pwd|secret|token|signature|sig|credentials?|apikey"
                          r"|(?:api|pool|access|private|auth)[_.\-]?key)(?:$|[_.\-])")


def secret_name(name: object) -> bool:
    """Whether a field called ``name`` holds a secret by its name."""
    return bool(_SECRET_NAME.search(str(name)))


def public(value: Any) -> Any:
    """``value`` (JSON-like) safe to show, log or write into a file that leaves the machine:
    every string masked (:func:`mask_text`) and the value of every field named like a secret
    (:func:`secret_name`) replaced by ``***`` — for a user's recipe options, a run's settings."""
    if isinstance(value, str):
        return mask_text(value)
    if isinstance(value, dict):
        return {k: "***" if secret_name(k) else public(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [public(v) for v in value]
    return value


if __name__ == "__main__":
    print(markdown_table())
