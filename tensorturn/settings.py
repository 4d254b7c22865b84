"""Configuration from the environment.

TensorTurn reads two URLs of its own; everything S3 is boto3's standard ``AWS_*`` environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``), so
MinIO, R2 and B2 work without TensorTurn-specific settings.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

BROKER_ENV = "TENSORTURN_BROKER_URL"
STORE_ENV = "TENSORTURN_STORE_URL"
DEFAULT_STORE_DIR = "tensorturn-store"

# Redis keys of TensorTurn's own state all start with this, apart from Celery's and kombu's keys.
KEY_PREFIX = "tt:"


def broker_url() -> str | None:
    """The pool's Redis URL, or None when no pool is configured (the embedded default)."""
    return os.environ.get(BROKER_ENV) or None


def store_url() -> str:
    """The object store URL; a ``tensorturn-store`` directory in the working directory by default."""
    url = os.environ.get(STORE_ENV)
    if url:
        return normalize_store_url(url)
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
