"""The coordinator (``tensorturn up``): a Redis for the pool, a store, and the file to join it
(:class:`Coordinator` sets them up; the command prints how to use them and waits).

The join string carries the broker URL (with its password), the store URL, the pool key, the
recipes the owner allows beyond the built-in ones and, for an ``s3://`` store, the S3 endpoint
and keys from the coordinator's environment. It is a secret: anyone holding it can queue work on
the pool. It travels in a file (``--join-file``) or on stdin (``--join -``), never on a command
line, where ``ps`` and shell history would show it.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorturn import config, trust
from tensorturn.errors import TensorTurnError
from tensorturn.pool.embedded import PortInUse, RedisServer

JOIN_PREFIX = "tt1."
AWS_KEYS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN")


def make_join(broker_url: str, store_url: str, key: str | None = None, allow: tuple[str, ...] = (),
              env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    doc: dict[str, Any] = {"broker": broker_url, "store": store_url}
    if key:
        doc["key"] = key
    if allow:
        doc["allow"] = list(allow)
    if store_url.startswith("s3://"):
        doc["aws"] = {k: env[k] for k in AWS_KEYS if env.get(k)}
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return JOIN_PREFIX + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def parse_join(join: str) -> dict[str, Any]:
    """The broker, store (and S3 settings) in a join string; one clear error if it is not one."""
    join = join.strip()
    if not join.startswith(JOIN_PREFIX):
        raise TensorTurnError("invalid join string: it should start with 'tt1.' "
                              "(copy the whole line `tensorturn up` printed)")
    body = join[len(JOIN_PREFIX):]
    try:
        doc = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
        if not isinstance(doc, dict) or not isinstance(doc.get("broker"), str):
            raise ValueError("no broker")
    except (ValueError, UnicodeDecodeError):
        raise TensorTurnError("invalid join string: it is damaged or incomplete "
                              "(copy the whole line `tensorturn up` printed)") from None
    return doc


def apply_join(doc: dict[str, Any], settings: config.Settings) -> config.Settings:
    """Put the join string's S3 settings into this process's environment (boto3 reads them
    there); ``settings`` with its broker, store, pool key and allowed recipes."""
    for k, v in (doc.get("aws") or {}).items():
        if k in AWS_KEYS:
            os.environ[k] = v
    changes: dict[str, Any] = {"broker_url": doc["broker"]}
    if doc.get("store"):
        changes["store_url"] = doc["store"]
    if doc.get("key"):
        changes["pool_key"] = doc["key"]
    joined = settings.with_(**changes)
    return trust.with_allowed(joined, doc.get("allow") or ())


def read_join(value: str | None, path: str | None) -> str | None:
    """The join string from ``--join`` (``-``: read it from stdin) or ``--join-file``
    (``-``: stdin too); None when neither is given."""
    if path == "-" or value == "-":
        if sys.stdin.isatty():
            import click

            return click.prompt("Paste the join string (hidden)", hide_input=True, err=True)
        return sys.stdin.readline().strip()
    if path:
        try:
            return Path(path).expanduser().read_text().strip()
        except OSError as exc:
            raise TensorTurnError(f"cannot read the join file {path}: {exc.strerror}") from None
    return value


def load_join(value: str | None, path: str | None, settings: config.Settings) -> config.Settings:
    """``settings`` with the pool a join string describes, when one is given."""
    text = read_join(value, path)
    return apply_join(parse_join(text), settings) if text else settings


def advertised_host() -> str:
    """This machine's address as other machines on the network would dial it (a best guess)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # TEST-NET: no packet is sent for a UDP connect
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


@dataclass
class CoordinatorConfig:
    """Kept in ``<dir>/coordinator.json`` (mode 600) so the password survives restarts."""

    password: str
    port: int

    @classmethod
    def load_or_create(cls, directory: Path, port: int) -> "CoordinatorConfig":
        path = directory / "coordinator.json"
        if path.exists():
            data = json.loads(path.read_text())
            return cls(password=data["password"], port=port or data["port"])
        cfg = cls(password=secrets.token_urlsafe(24), port=port or 6379)
        trust.write_secret(path, json.dumps({"password": cfg.password, "port": cfg.port}))
        return cfg

    def save(self, directory: Path) -> None:
        trust.replace_secret(directory / "coordinator.json",
                             json.dumps({"password": self.password, "port": self.port}))


class Coordinator:
    """The pool's coordinator kept in ``directory`` (mode 700): a Redis on ``bind`` with AOF on and
    no eviction, its password and port in ``coordinator.json``, the pool key in ``pool-key``, and
    — once :meth:`start` has it answering — the broker URL in ``broker-url`` and the join string
    (broker, store, pool key, the recipes this machine allows every agent) in ``join``.

    Made ready (the store checked, the pool key made on first use) before anything starts;
    nothing is written beyond that until the Redis answers, so a failed start leaves any join
    file an earlier coordinator wrote here as it was."""

    def __init__(self, directory: str | Path, store_url: str, port: int | None = None,
                 bind: str = "0.0.0.0", advertise: str | None = None,
                 settings: config.Settings | None = None):
        from tensorturn.store.objects import open_store

        settings = settings or config.current()
        self.home = Path(directory).resolve()
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.store_url, self.bind, self.advertise, self.settings = store_url, bind, advertise, settings
        self.cfg = CoordinatorConfig.load_or_create(self.home, port or 0)
        self.key = trust.pool_key_or_create(settings.with_(pool_key_file=str(self.home / "pool-key")))
        open_store(store_url).check()
        self.server = RedisServer(self.home / "redis", port=self.cfg.port, appendonly=True,
                                  password=self.cfg.password, bind=bind)
        self.broker_url = ""

    @property
    def port(self) -> int:
        return self.cfg.port

    @property
    def join_file(self) -> Path:
        return self.home / "join"

    def start(self) -> None:
        """Start the Redis; once it answers, keep its port for next time and write the broker
        URL and the join file (before anyone is told to read them)."""
        try:
            self.server.start()
        except PortInUse as exc:
            raise PortInUse(f"{exc}: stop it, or start the coordinator on another port with "
                            f"--port PORT") from None
        self.cfg.save(self.home)  # the port that worked is the default next time
        host = self.advertise or (advertised_host() if self.bind == "0.0.0.0" else self.bind)
        self.broker_url = f"redis://default:{self.cfg.password}@{host}:{self.cfg.port}/0"  # as redis-cli takes it
        join = make_join(self.broker_url, self.store_url, self.key.text(),
                         trust.allowed_patterns(self.settings))  # --allow-recipe
        trust.replace_secret(self.home / "broker-url", self.broker_url + "\n")
        trust.replace_secret(self.join_file, join + "\n")

    def wait(self) -> None:
        """Until the Redis exits (an error: it should run until stopped)."""
        assert self.server.proc is not None  # started
        self.server.proc.wait()
        raise TensorTurnError(f"redis-server exited (log: {self.home / 'redis' / 'redis.log'})")

    def stop(self) -> None:
        self.server.stop()
