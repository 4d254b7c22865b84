"""The pool key: what proves that a run spec, a task, a manifest or an API token came from the
pool's owner, and the recipe allowlist: what code a machine agrees to import.

Who can do what (docs/trust.md):

* The **Redis password** lets a machine talk to the broker. Without the pool key, what it queues
  is refused unread: every task message carries an HMAC of its arguments under the pool key.
* The **pool key** (32 random bytes, ``.tensorturn/pool-key`` or ``TENSORTURN_POOL_KEY`` or the
  join file) signs specs, task messages, manifests and token records. It is never stored in the
  object store and never sent through the broker.
* **Store write access** can spoil a run's weights but cannot make a machine import code or mint
  an API token: a spec, a manifest or a token record that is not signed is refused.
* Even a correctly signed spec can only name a built-in recipe or one the machine itself allows
  (``--allow-recipe`` / ``TENSORTURN_ALLOW_RECIPES``): a recipe is code, and each machine decides
  what code it runs.

Signatures are HMAC-SHA256 over a purpose (``spec``, ``task``, ...) and the canonical JSON of the
document, so a signature for one kind of document never passes for another.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from tensorturn import config
from tensorturn.errors import SpecError, TensorTurnError

KEY_PREFIX = "ttk1."
KEY_BYTES = 32
DEFAULT_KEY_FILE = Path(".tensorturn") / "pool-key"
SIGNATURE = "signature"


class UntrustedError(TensorTurnError):
    """A document or message that is not signed by this pool's key, or code not allowed here."""

    exit_code = 2


class PoolKey:
    """The pool's signing key."""

    def __init__(self, secret: bytes):
        if len(secret) < 16:
            raise SpecError("the pool key is too short (it should be 32 random bytes)")
        self._secret = secret

    @classmethod
    def generate(cls) -> "PoolKey":
        return cls(secrets.token_bytes(KEY_BYTES))

    @classmethod
    def from_text(cls, text: str) -> "PoolKey":
        text = text.strip()
        if not text.startswith(KEY_PREFIX):
            raise SpecError("invalid pool key: it should start with 'ttk1.' "
                            "(copy .tensorturn/pool-key from the coordinator)")
        body = text[len(KEY_PREFIX):]
        try:  # strict: a character outside the alphabet is damage, not something to skip
            secret = base64.b64decode(body + "=" * (-len(body) % 4), altchars=b"-_", validate=True)
        except ValueError:
            raise SpecError("invalid pool key: it is damaged or incomplete") from None
        if len(secret) != KEY_BYTES:
            raise SpecError(f"invalid pool key: it holds {len(secret)} bytes, not {KEY_BYTES} (make one with "
                            f"`python -c \"from tensorturn.trust import PoolKey; "
                            f"print(PoolKey.generate().text())\"`)")
        return cls(secret)

    def text(self) -> str:
        return KEY_PREFIX + base64.urlsafe_b64encode(self._secret).decode().rstrip("=")

    def __repr__(self) -> str:  # never the secret
        return f"PoolKey(id={self.key_id})"

    @property
    def key_id(self) -> str:
        """A short public name for the key (to tell two keys apart in an error message)."""
        return hashlib.sha256(b"tensorturn key id" + self._secret).hexdigest()[:8]

    def sign(self, purpose: str, doc: Any) -> str:
        message = purpose.encode() + b"\n" + canonical(doc)
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def verify(self, purpose: str, doc: Any, signature: Any) -> bool:
        """Whether ``signature`` is this key's for ``doc`` (compared as bytes: any string a
        stranger sends is just wrong, never an error)."""
        return isinstance(signature, str) and hmac.compare_digest(
            self.sign(purpose, doc).encode(), signature.encode("utf-8", "replace"))

    def sign_doc(self, purpose: str, doc: dict[str, Any]) -> dict[str, Any]:
        """``doc`` with a ``signature`` field over everything else in it."""
        body = {k: v for k, v in doc.items() if k != SIGNATURE}
        return {**body, SIGNATURE: self.sign(purpose, body)}

    def check_doc(self, purpose: str, doc: Any, what: str) -> dict[str, Any]:
        """``doc`` without its signature, or UntrustedError naming ``what``."""
        if not isinstance(doc, dict):
            raise UntrustedError(f"{what} is not a JSON object")
        body = {k: v for k, v in doc.items() if k != SIGNATURE}
        if SIGNATURE not in doc:
            raise UntrustedError(f"{what} is not signed (written by an older TensorTurn, or by "
                                 f"someone without the pool key); refused")
        if not self.verify(purpose, body, doc[SIGNATURE]):
            raise UntrustedError(f"{what} is not signed by this pool's key (key {self.key_id}); "
                                 f"refused")
        return body


def canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


# ---- where the key comes from ------------------------------------------------------------------

def write_secret(path: Path, text: str) -> None:
    """Create ``path`` holding ``text``, readable by its owner only from the first byte on
    (``O_EXCL``: an existing file is an error, never silently replaced); parents made 0700."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def replace_secret(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a new 0600 file renamed over it."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    write_secret(tmp, text)
    os.replace(tmp, path)


def key_file(settings: config.Settings | None = None) -> Path:
    settings = settings or config.current()
    return Path(settings.pool_key_file).expanduser() if settings.pool_key_file else DEFAULT_KEY_FILE


def find_key(settings: config.Settings | None = None) -> PoolKey | None:
    """The pool key from ``TENSORTURN_POOL_KEY``, else the key file; None when there is none."""
    settings = settings or config.current()
    if settings.pool_key:
        return _parsed(settings.pool_key)
    path = key_file(settings)
    try:
        return _parsed(path.read_text())
    except FileNotFoundError:
        return None


@lru_cache(maxsize=4)
def _parsed(text: str) -> PoolKey:
    return PoolKey.from_text(text)


def pool_key(settings: config.Settings | None = None) -> PoolKey:
    """The pool key, or one clear error saying where to get it."""
    key = find_key(settings)
    if key is None:
        raise UntrustedError(
            f"no pool key: pass --join-file JOIN (from `tensorturn up`), set TENSORTURN_POOL_KEY, "
            f"or put the coordinator's key file at {key_file(settings)}")
    return key


def pool_key_or_create(settings: config.Settings | None = None) -> PoolKey:
    """The pool key, made (and kept in the key file) when this machine has none: an embedded
    pool, or a coordinator started for the first time."""
    key = find_key(settings)
    if key is not None:
        return key
    key = PoolKey.generate()
    try:
        write_secret(key_file(settings), key.text() + "\n")
    except FileExistsError:  # made meanwhile by another process: that one is the key
        return pool_key(settings)
    return key


# ---- which recipes this machine imports --------------------------------------------------------
#
# A recipe outside the built-ins is named ``package.module:Class``: dotted Python identifiers, one
# colon, one identifier. A pattern has the same two halves, matched separately and never across
# the colon or a dot: each dotted part of the module is matched by the pattern's part at its place
# (shell wildcards ``*``, ``?``, ``[...]`` within that one part), except that a part ``**`` stands
# for any number of parts, none included; the attribute is matched by the pattern's attribute.
# So ``mymod:*`` allows the classes of ``mymod`` only, ``team.recipes.*:*`` those of the modules
# directly inside ``team.recipes``, ``team.**:*`` those of ``team`` and any module below it, and a
# pattern without a colon (``pkg.*``) allows nothing. A name of any other shape is refused.

def allowed_patterns(settings: config.Settings | None = None) -> tuple[str, ...]:
    settings = settings or config.current()
    return tuple(p.strip() for p in (settings.allow_recipes or "").split(",") if p.strip())


def with_allowed(settings: config.Settings, patterns: Iterable[str]) -> config.Settings:
    """``settings`` allowing ``patterns`` too."""
    merged = dict.fromkeys([*allowed_patterns(settings), *(p.strip() for p in patterns)])
    return settings.with_(allow_recipes=",".join(merged) or None)


def recipe_parts(name: str) -> tuple[list[str], str] | None:
    """The module's dotted parts and the attribute of ``package.module:Class``; None for a name
    of any other shape (two colons, an empty part, a wildcard, a space...)."""
    module, colon, attr = name.partition(":")
    parts = module.split(".")
    if not colon or not attr.isidentifier() or not all(p.isidentifier() for p in parts):
        return None
    return parts, attr


def pattern_allows(pattern: str, name: str) -> bool:
    """Whether allowlist ``pattern`` covers the recipe ``name`` (the rules above)."""
    parts = recipe_parts(name)
    module_pattern, colon, attr_pattern = pattern.partition(":")
    if parts is None or not colon:
        return False
    module, attr = parts
    return _parts_match(module_pattern.split("."), module) and fnmatch.fnmatchcase(attr, attr_pattern)


def _parts_match(patterns: list[str], parts: list[str]) -> bool:
    if not patterns:
        return not parts
    first, rest = patterns[0], patterns[1:]
    if first == "**":
        return any(_parts_match(rest, parts[i:]) for i in range(len(parts) + 1))
    return bool(parts) and fnmatch.fnmatchcase(parts[0], first) and _parts_match(rest, parts[1:])


def check_recipe_allowed(name: str, builtin: Iterable[str],
                         settings: config.Settings | None = None) -> None:
    """UntrustedError unless ``name`` is built in or matches a pattern this machine allows;
    decided on the name alone, before anything is imported."""
    if name in builtin:
        return
    if any(pattern_allows(p, name) for p in allowed_patterns(settings)):
        return
    raise UntrustedError(
        f"recipe {name!r} is not allowed on this machine: only built-in recipes and those "
        f"allowed with --allow-recipe 'package.module:Class' patterns (or TENSORTURN_ALLOW_RECIPES) "
        f"are imported")
