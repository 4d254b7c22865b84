"""Who may touch what, read from the source with ``ast`` (no import, no broker): the Redis
client is used only inside ``tensorturn/state/``, and every Redis key and queue name is built in
``tensorturn/layout.py``.

What counts as a direct use of the Redis client: a call of one of :data:`REDIS_METHODS` on

- a name among :data:`CLIENT_NAMES` (``r.hset(...)``, ``client.lrange(...)``, ``pipe.execute()``;
  not :data:`DICT_LIKE` methods there: ``r.get("round")`` is a dict's),
- an attribute among :data:`CLIENT_ATTRIBUTES` (``board.r.hget(...)``, ``self.client.pipeline()``),
- or what a client factory or a pipeline returns (``redis_client(url).hlen(...)``,
  ``check_broker(url).pipeline()``, ``x.pipeline().execute()``).

Passing a client along (``refuse(board.r, ...)``, ``TaskReporter(task, board.r, ...)``) is not a
use: the function it goes to is the state package's, or calls it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "tensorturn"
STATE = PACKAGE / "state"
LAYOUT = PACKAGE / "layout.py"

REDIS_METHODS = frozenset("""
    hset hget hgetall hmget hsetnx hdel hexists hincrby hincrbyfloat hkeys hvals hlen hscan
    zadd zrem zrange zrevrange zrangebyscore zscore zcard zincrby
    lpush rpush lpop rpop blpop brpop lrange lrem ltrim llen lindex
    sadd srem smembers sismember scard
    set get getset setnx mget mset incr incrby decr delete exists expire pexpire persist ttl pttl
    eval evalsha register_script pipeline execute scan scan_iter keys type publish
    ping flushdb flushall
""".split())
CLIENT_NAMES = frozenset({"r", "redis", "client", "pipe", "pipeline", "conn", "broker"})
CLIENT_ATTRIBUTES = frozenset({"r", "redis", "client", "pipe"})
CLIENT_FACTORIES = frozenset({"redis_client", "check_broker", "pipeline", "Redis", "from_url"})
DICT_LIKE = frozenset({"get", "keys"})  # on a bare name such as ``r`` these are a dict's (a round's)

# Modules (or folders, ending in "/") outside the state package allowed to use the client, each
# with its reason ({"modes/fused/": "being split; its uses move to tensorturn/state/"}, say).
# None today: kombu's own structures (leases, queued messages) are tensorturn/state/queues.py's.
ALLOWED_CLIENT_USE: dict[str, str] = {}
# Modules outside layout.py that may hold a string starting with "tt:" or "tt.", with the reason.
ALLOWED_KEY_STRINGS: dict[str, str] = {}


def modules(under: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in under.rglob("*.py") if "__pycache__" not in p.parts)


def name(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def allowed(path: Path, exceptions: dict[str, str]) -> bool:
    """Whether ``path`` is one of the ``exceptions``, or in one of its folders."""
    return any(name(path) == e or (e.endswith("/") and name(path).startswith(e)) for e in exceptions)


def _is_client(node: ast.expr, method: str) -> bool:
    """Whether ``node``, whose ``method`` is called, is by its name or how it was made a Redis
    client or pipeline."""
    if isinstance(node, ast.Name):
        return node.id in CLIENT_NAMES and method not in DICT_LIKE
    if isinstance(node, ast.Attribute):
        return node.attr in CLIENT_ATTRIBUTES
    if isinstance(node, ast.Call):
        f = node.func
        called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        return called in CLIENT_FACTORIES
    return False


def client_calls(source: str) -> list[str]:
    """``line: call`` for every direct use of the Redis client in ``source`` (a module's text)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in REDIS_METHODS and _is_client(node.func.value, node.func.attr)):
            out.append(f"{node.lineno}: {ast.unparse(node.func)}(...)")
    return out


def key_strings(source: str) -> list[str]:
    """``line: text`` for every string constant or f-string that starts with ``tt:`` or ``tt.``
    (a Redis key or queue name) in ``source``."""
    out = []
    tree = ast.parse(source)
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        head = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in parts:
            head = node.value
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            head = str(node.values[0].value)
        if head is not None and head.startswith(("tt:", "tt.")):
            out.append(f"{node.lineno}: {head[:40]!r}")
    return out


def test_the_detectors_find_what_they_should() -> None:
    """The detectors on a sample: a passed client is not a use, the rest is."""
    sample = ("def f(board, url):\n"
              "    refuse(board.r, 'w')\n"                # passed along: fine
              "    board.r.hset('k', 'f', 1)\n"           # 3
              "    redis_client(url).hlen('unacked')\n"   # 4
              "    pipe = board.r.pipeline()\n"           # 5
              "    pipe.execute()\n"                      # 6
              "    store.get('x')\n"                      # an object store: fine
              "    k = f'tt:run:{url}'\n"                 # a key: 8
              "    q = 'tt.fits.1MB'\n")                  # a queue: 9
    assert [c.split(":")[0] for c in client_calls(sample)] == ["3", "4", "5", "6"]
    assert [c.split(":")[0] for c in key_strings(sample)] == ["8", "9"]
    uses = ("from tensorturn.layout import RUN_INDEX as INDEX\n"
            "REFUSED = 'refused'\n"                      # not layout's: fine
            "x = (INDEX, layout.run_key('a'), REFUSED)\n")  # 3, 3
    assert redis_key_uses(uses) == ["3: RUN_INDEX", "3: run_key"]


def test_no_redis_client_use_outside_the_state_package() -> None:
    found = {name(p): calls for p in modules() if STATE not in p.parents
             and not allowed(p, ALLOWED_CLIENT_USE) and (calls := client_calls(p.read_text()))}
    assert not found, ("Redis client used outside tensorturn/state/ — add a method to a state "
                       f"class instead: {found}")


def test_the_allowed_client_uses_still_exist() -> None:
    """An exception that is no longer needed is taken off the list."""
    stale = [e for e in ALLOWED_CLIENT_USE
             if not any(client_calls(p.read_text()) for p in modules() if allowed(p, {e: ""}))]
    assert not stale, f"no longer use the Redis client (remove them from ALLOWED_CLIENT_USE): {stale}"


def test_every_redis_key_is_built_in_layout() -> None:
    found = {name(p): strings for p in modules() if p != LAYOUT
             and not allowed(p, ALLOWED_KEY_STRINGS) and (strings := key_strings(p.read_text()))}
    assert not found, f"Redis keys or queue names built outside tensorturn/layout.py: {found}"


# The builders of Redis keys in layout.py: only the state package reads or writes those keys.
REDIS_KEY_NAMES = frozenset({"run_key", "live_key", "worker_key", "slots_key", "stored_key",
                             "run_keys_pattern", "RUN_INDEX", "REFUSED", "REFUSED_TOTAL", "PRUNE_LOCK",
                             "UNACKED", "UNACKED_INDEX", "WORKER_PATTERN"})
ALLOWED_KEY_USE: dict[str, str] = {}  # as ALLOWED_CLIENT_USE


def redis_key_uses(source: str) -> list[str]:
    """``line: name`` for every use of a Redis key builder of layout.py (``layout.run_key``,
    ``RUN_INDEX`` imported by name, ...) in ``source``."""
    tree = ast.parse(source)
    imported = {alias.asname or alias.name: alias.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == "tensorturn.layout"
                for alias in node.names}
    out = []
    for node in ast.walk(tree):
        used = None
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "layout":
            used = node.attr
        elif isinstance(node, ast.Name) and node.id in imported:
            used = imported[node.id]
        if used in REDIS_KEY_NAMES:
            out.append(f"{node.lineno}: {used}")
    return out


def test_only_the_state_package_uses_redis_keys() -> None:
    found = {name(p): uses for p in modules() if STATE not in p.parents and p != LAYOUT
             and not allowed(p, ALLOWED_KEY_USE) and (uses := redis_key_uses(p.read_text()))}
    assert not found, f"Redis keys used outside tensorturn/state/ (add a state method): {found}"
