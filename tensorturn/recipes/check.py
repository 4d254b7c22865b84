"""``tensorturn check-recipe``: the recipe's checks (:func:`tensorturn.recipes.contract.check`) in
a process of their own, each step within a limit.

The child (:func:`in_child`) tells its parent each step it starts; a step still running after its
limit (``--hook-timeout``, :data:`HOOK_TIMEOUT_S`) is killed with the process — a recipe's loop is
stopped wherever it is, in Python or in C, whatever it catches — and named in one line
(:class:`~tensorturn.recipes.contract.CheckFailed`).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from typing import Any

from tensorturn import platforms
from tensorturn.recipes.contract import CheckFailed, check, tell_steps

# what one step may take, by default (`check-recipe --hook-timeout`): room for a first download
# of a dataset in raw_data, and for gpt2-small's training steps (165 s on 2 CPU cores shared with
# other work; 3 optimizer steps are one step); a loop is named after it
HOOK_TIMEOUT_S = 300.0
START_TIMEOUT_S = 120.0  # what a check's process may take to start (Python, torch) at the least


# ---- the check in a process of its own, each step within a limit ---------------------------------

def check_in_child(name: str, options: dict[str, Any] | None = None,
                   hook_timeout: float = HOOK_TIMEOUT_S, debug: bool = False,
                   allow: Collection[str] = ()) -> dict[str, Any]:
    """:func:`check` in a child process started as agents are (``python -P``: recipes from
    ``PYTHONPATH`` and installed packages; this process's settings in its environment, so the
    same store, allowing the recipe names in ``allow`` too), each step within ``hook_timeout``
    seconds: one late is killed, with the process group, and CheckFailed names it. The recipe's
    prints go to stderr."""
    import glob

    from tensorturn import config, trust

    settings = config.current()
    if allow:
        settings = trust.with_allowed(settings, [glob.escape(n) for n in allow])
    request = json.dumps({"recipe": name, "options": options or {}, "debug": debug})
    read_end, write_end = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, "-P", "-c", "from tensorturn.recipes.check import in_child; in_child()",
             str(write_end), request],
            env={**os.environ, **settings.environ()}, pass_fds=(write_end,),
            stdin=subprocess.PIPE, stdout=2, **platforms.new_group())
    finally:
        os.close(write_end)
    try:
        return _answer(read_end, child, hook_timeout)
    finally:
        os.close(read_end)
        _end(child)


def _answer(fd: int, child: subprocess.Popen, hook_timeout: float) -> dict[str, Any]:
    """Read the child's messages until its answer, each step within ``hook_timeout`` seconds."""
    step, limit, pending = "start", max(hook_timeout, START_TIMEOUT_S), b""  # starting is no hook
    deadline = time.monotonic() + limit
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise CheckFailed(f"{step}: still running after {limit:g} s (the limit per hook, "
                              f"--hook-timeout); stopped")
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            child.wait()
            raise CheckFailed(f"{step}: the check's process ended ({_how(child.returncode)}) "
                              f"without an answer")
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "step" in message:
                step, limit = message["step"], hook_timeout
                deadline = time.monotonic() + limit
            elif "failed" in message:
                raise CheckFailed(message["failed"], message.get("where"), message.get("trace"))
            else:
                return message["found"]


def _how(returncode: int | None) -> str:
    if returncode is None or returncode >= 0:
        return f"exit status {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def _end(child: subprocess.Popen) -> None:
    """Kill the child's whole group (a recipe's own workers included) unless it is gone."""
    if child.poll() is None:
        platforms.kill_group(child)
    child.wait()
    if child.stdin:
        child.stdin.close()


def in_child() -> None:
    """The child's side: ``check`` with every step told to the parent (one JSON line each on
    the pipe ``argv[1]``), then the findings or the failure. It ends with its parent (stdin
    closes), so a parent killed meanwhile leaves no loop running."""
    from tensorturn.tracebacks import root_cause, tail, user_site

    channel = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    request = json.loads(sys.argv[2])
    logging.basicConfig(level=logging.DEBUG if request["debug"] else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    threading.Thread(target=_end_with_parent, daemon=True).start()

    current = "start"

    def tell(message: dict[str, Any]) -> None:
        channel.write(json.dumps(message, default=str) + "\n")

    def started(step: str) -> None:
        nonlocal current
        current = step
        tell({"step": step})

    tell_steps(started)
    try:
        found = check(request["recipe"], request["options"])
    except Exception as exc:  # noqa: BLE001 - anything the recipe raised outside a named step, too
        message = str(exc) if isinstance(exc, CheckFailed) else (
            f"{current}: {type(exc).__name__}: {' '.join(str(exc).split())}")
        trace = tail(exc) if root_cause(exc) is not exc or not isinstance(exc, CheckFailed) else None
        answer: dict[str, Any] = {"failed": message, "where": user_site(exc), "trace": trace}
    else:
        answer = {"found": found}
    sys.stdout.flush()  # the recipe's prints, before the parent ends this process
    tell(answer)


def _end_with_parent() -> None:
    sys.stdin.buffer.read()  # returns when the parent is gone (it never writes)
    os._exit(1)
