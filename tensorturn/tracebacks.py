"""Tracebacks a user can read: the frames of *their* code, bounded, secrets masked.

A failed attempt keeps :func:`tail` of its exception with its record (so ``status --debug``
shows it from any machine, and from the manifest once the pool is gone), and ``check-recipe``
names :func:`user_site` — the user's file and line — of the failure it reports. Frames inside
the Python library, installed packages (torch) and TensorTurn's own machinery are where an
error *surfaces*, seldom where it was made: they are kept only at the very end (where it was
raised), and the runs of them in between are summarised in one line.
"""

from __future__ import annotations

import inspect
import os
import sys
import sysconfig
import traceback
from pathlib import Path

from tensorturn.config import mask_text

MAX_FRAMES = 8        # frames kept in a tail
LAST_FRAMES = 3       # of them, the innermost whatever their origin: where it was raised
MAX_CHARS = 4096      # a tail's size at most, masked
MAX_LINE = 240        # a source line or message line at most

_PACKAGE = Path(__file__).resolve().parent
_RECIPES = _PACKAGE / "recipes"
_STDLIB = Path(sysconfig.get_paths()["stdlib"]).resolve()
_RECIPE = "tensorturn.recipes.base.Recipe"  # (named, not imported: recipes import this module)
# a pool key or join string quoted in a message (they are not URLs, so mask_text leaves them)
def origin(filename: str) -> str:
    """Whose code a frame is: ``user``, ``recipes`` (a built-in recipe), ``tensorturn``, or the
    installed package's (``torch``) or ``python``'s name."""
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return "python"
    path = Path(os.path.abspath(filename))
    parts = path.parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            rest = parts[parts.index(marker) + 1:]
            return rest[0].removesuffix(".py") if rest else marker
    if path.is_relative_to(_RECIPES):
        return "recipes"
    if path.is_relative_to(_PACKAGE):
        return "tensorturn"
    if path.is_relative_to(_STDLIB):
        return "python"
    return "user"


def root_cause(exc: BaseException) -> BaseException:
    """The exception that started it: ``raise … from exc`` links followed, and the implicit
    link of a TensorTurn error raised while handling another (a wrapper of the user's)."""
    from tensorturn.errors import TensorTurnError

    seen = {id(exc)}
    while True:
        nxt = exc.__cause__
        if nxt is None and isinstance(exc, TensorTurnError) and not exc.__suppress_context__:
            nxt = exc.__context__
        if nxt is None or id(nxt) in seen:
            return exc
        seen.add(id(nxt))
        exc = nxt


def _frames(exc: BaseException) -> list[traceback.FrameSummary]:
    return list(traceback.extract_tb(exc.__traceback__))


def user_site(exc: BaseException) -> str | None:
    """``file:line in function`` of the innermost frame of the user's own code (their file
    relative to the working directory when it is under it), or None when there is none."""
    frames = [f for f in _frames(root_cause(exc)) if origin(f.filename) == "user"]
    if not frames:
        return _model_site(root_cause(exc))
    f = frames[-1]
    return f"{_shown(f.filename)}:{f.lineno} in {f.name}"


def _shown(filename: str) -> str:
    """A user's file, relative to the working directory when it is under it."""
    path = Path(os.path.abspath(filename))
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return path.name


def _model_site(exc: BaseException) -> str | None:
    """For a failure inside torch with no frame of the user's on the way (a layer of an
    ``nn.Sequential`` the recipe built, run by a built-in hook): the recipe's ``model`` that built
    it, and the layer that raised — read from the frames' ``self``."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    layer, recipe = None, None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        me = frame.f_locals.get("self")
        if isinstance(me, torch.nn.Module) and frame.f_code.co_name == "forward":
            layer = me  # the innermost last
        elif any(f"{c.__module__}.{c.__qualname__}" == _RECIPE for c in type(me).__mro__):
            recipe = me
    build = getattr(type(recipe), "model", None) if recipe is not None else None
    try:
        filename, line = inspect.getsourcefile(build), inspect.getsourcelines(build)[1]  # type: ignore[arg-type]
    except (TypeError, OSError):
        return None
    if filename is None or origin(filename) != "user":
        return None
    what = f"{_clip(repr(layer).splitlines()[0].rstrip('('))} of " if layer is not None else ""
    return f"{what}the model built at {_shown(filename)}:{line} in model"


def _clip(text: str) -> str:
    return text if len(text) <= MAX_LINE else text[:MAX_LINE - 1] + "…"


def tail(exc: BaseException, max_frames: int = MAX_FRAMES, max_chars: int = MAX_CHARS) -> str:
    """The root cause's traceback in Python's layout, bounded: the user's (and built-in
    recipes') innermost frames and the last few, the frames between summarised, at most
    ``max_chars`` characters, secrets masked."""
    exc = root_cause(exc)
    frames = _frames(exc)
    origins = [origin(f.filename) for f in frames]
    last = set(range(max(0, len(frames) - LAST_FRAMES), len(frames)))
    theirs = [i for i, o in enumerate(origins) if o in ("user", "recipes") and i not in last]
    room = max_frames - len(last)
    keep = sorted(last | set(theirs[-room:] if room > 0 else []))
    message = " ".join(traceback.format_exception_only(type(exc), exc)[-1].split())
    end = mask_text(_clip(message))
    while True:
        lines = [f"Traceback (most recent call last; {len(keep)} of {len(frames)} frames):"]
        previous = -1
        for i in keep:
            if i > previous + 1:
                lines.append(f"  ... {_skipped(origins[previous + 1:i])}")
            f = frames[i]
            lines.append(f'  File "{f.filename}", line {f.lineno}, in {f.name}')
            if f.line:
                lines.append(f"    {_clip(f.line.strip())}")
            previous = i
        text = mask_text("\n".join(lines)) + "\n" + end
        if len(text) <= max_chars or not keep:
            return text[-max_chars:] if len(text) > max_chars else text
        keep = keep[1:]  # the outermost kept frame goes first


def _skipped(origins: list[str]) -> str:
    names = list(dict.fromkeys(o for o in origins))
    return f"{len(origins)} frame{'s' if len(origins) != 1 else ''} in {', '.join(names)}"


def failed_attempts(attempts: list[dict], most: int = 5) -> list[str]:
    """Lines showing the tracebacks of a run's failed attempts: the last one of each task, the
    most recent last, a traceback already shown named rather than repeated."""
    last: dict[str, dict] = {}
    for a in sorted(attempts, key=lambda a: a.get("finished_at") or 0):
        if str(a.get("outcome", "")).startswith("failed") and a.get("traceback"):
            last.pop(a["task"], None)  # re-inserted: the order is that of each task's last failure
            last[a["task"]] = a
    shown = list(last.values())
    lines = []
    if len(shown) > most:
        lines.append(f"{len(shown) - most} more task(s) failed before these; `status --json` "
                     f"holds every attempt's traceback")
        shown = shown[-most:]
    seen: dict[str, str] = {}
    for a in shown:
        name = f"{a['task']} attempt {a['attempt']} on {a.get('worker') or '?'}"
        if a["traceback"] in seen:
            lines.append(f"{name} failed the same way as {seen[a['traceback']]}")
            continue
        seen[a["traceback"]] = name
        lines.append(f"{name} failed:")
        lines.extend(f"  {line}" for line in a["traceback"].splitlines())
    return lines
