"""The ``tensorturn`` command. Thin: it parses options and calls the modules that do the work.

Commands that train nothing import neither torch nor Celery nor boto3 unless they need them, so
``--help``, ``runs``, ``status`` and every argument error answer at once.
"""

from __future__ import annotations

# first of all: a secret on the command line is hidden from `ps` before anything else loads
from tensorturn.cli import title  # isort: split

import faulthandler
import functools
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import click

from tensorturn import config
from tensorturn.errors import TensorTurnError

log = logging.getLogger("tensorturn")

BROKER_HELP = ("Redis URL of the pool (env TENSORTURN_BROKER_URL: prefer it, or --join-file; a password "
               "on a command line shows in `ps`).")


def pool_options(broker_help: str = BROKER_HELP, joins: bool = True,
                 flags: Callable[[config.Settings, str | None, dict[str, Any]], config.Settings] | None = None
                 ) -> Callable:
    """``--broker``, ``--store``, ``--join-file``, ``--allow-recipe`` and ``--debug``; TensorTurn
    errors become one line + exit code. A join file (or ``TENSORTURN_JOIN``) fills in the broker and store not
    given otherwise, the pool key, and the recipes its owner allows. ``joins=False``: the
    command makes the pool (``up``), so it reads no join, not even one the environment names —
    ``export TENSORTURN_JOIN_FILE=.tensorturn/join`` names the file ``up`` writes.
    ``flags(settings, broker, options)``: the settings with the command's own options applied
    (``agent``'s memory, cache and role).

    This is the one place a process's settings are set (:func:`tensorturn.config.use`): its
    environment and its command line, once, before the command does anything. Everything the
    command calls is passed what it needs beyond that (a recipe the user named: ``allow``)."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, broker: str | None, store: str | None, allow: tuple[str, ...],
                    debug: bool, join_file: str | None = None, **kwargs: Any):
            logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                                format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
            click.get_current_context().meta["debug"] = debug
            try:
                settings = config.current()  # the environment's
                joined = kwargs.pop("join", None)  # `agent --join`, when the command has it
                if joins and (joined is not None or join_file or settings.join):
                    from tensorturn.pool.coordinator import load_join

                    settings = load_join(joined or settings.join, join_file, settings)
                    broker = broker or settings.broker_url
                    store = store or settings.store_url
                if allow:
                    from tensorturn.trust import with_allowed

                    settings = with_allowed(settings, allow)
                store_url = config.normalize_store_url(store) if store else config.default_store_url()
                # this command's store is the process's (recipes over pushed datasets read it)
                settings = settings.with_(store_url=store_url)
                if flags is not None:
                    settings = flags(settings, broker or None, kwargs)
                config.use(settings)  # once, before any work
                return fn(*args, broker=broker or None, store=store_url, **kwargs)
            except TensorTurnError as exc:
                if debug:
                    raise
                fail(str(exc), exc.exit_code)

        join_file = click.option(
            "--join-file", "join_file", envvar="TENSORTURN_JOIN_FILE", metavar="PATH",
            help="The pool's join file from `tensorturn up` (broker, store, pool key); `-` reads "
                 "the join string from stdin.")
        for option in reversed([
            click.option("--broker", envvar="TENSORTURN_BROKER_URL", metavar="URL", help=broker_help),
            click.option("--store", envvar="TENSORTURN_STORE_URL", metavar="URL",
                         help="Object store: file:///dir, a directory, or s3://bucket/prefix "
                              "(env TENSORTURN_STORE_URL; default ./tensorturn-store)."),
            *([join_file] if joins else []),
            click.option("--allow-recipe", "allow", multiple=True, metavar="PATTERN",
                         help="Also import recipes matching this `module:attr` pattern (fnmatch, "
                              "e.g. 'myproject.recipes:*'; env TENSORTURN_ALLOW_RECIPES). Built-in "
                              "recipes are always allowed; a recipe is code. Repeatable."),
            click.option("--debug", is_flag=True, help="Show tracebacks and debug logs."),
        ]):
            wrapper = option(wrapper)
        return wrapper

    return decorate


def debug_option(fn: Callable) -> Callable:
    """``--debug`` for a command without :func:`pool_options` (which has its own): debug logs,
    and whatever tracebacks the command can show (:func:`debugging`)."""

    @click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
    @functools.wraps(fn)
    def wrapper(*args: Any, debug: bool, **kwargs: Any):
        logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        click.get_current_context().meta["debug"] = debug
        return fn(*args, **kwargs)

    return wrapper


def debugging() -> bool:
    """Whether the command at hand was given ``--debug``."""
    ctx = click.get_current_context(silent=True)
    return bool(ctx is not None and ctx.meta.get("debug"))


def fail(message: str, code: int) -> None:
    """One line on stderr (secrets masked), then exit ``code``."""
    click.echo(f"error: {config.mask_text(' '.join(message.split()))}", err=True)
    sys.exit(code)


def emit_json(doc: Any) -> None:
    """``doc`` on stdout as strict JSON, the one place every ``--json`` is printed: a NaN or
    infinite number (a diverged metric) is ``null``, never the bare ``NaN`` JSON parsers refuse."""
    click.echo(json.dumps(strict(doc), indent=2, sort_keys=True, default=str, allow_nan=False))


def strict(value: Any) -> Any:
    """``value`` with every non-finite float, at any depth, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def stop_on_signals() -> None:
    """Ctrl-C and SIGTERM (a service manager's stop) both end a foreground command cleanly.

    Set explicitly: a process started in the background by a non-interactive shell inherits
    SIGINT *ignored*, and Python then leaves it ignored, so Ctrl-C semantics would silently vanish.
    The stop the signal begins is bounded (:func:`watch_the_stop`).
    """
    from tensorturn.pool.embedded import kill_started  # imported now, not in a handler or a timer

    def interrupt(_signum, _frame):
        ignore_signals()  # once: a second Ctrl-C must not cut short the cleanup it starts...
        _interrupted.set()  # ...but a stuck one ends (the watch), and a lost one is raised again
        raise KeyboardInterrupt

    def unraisable(what: Any) -> None:
        if isinstance(what.exc_value, KeyboardInterrupt) and _interrupted.is_set():
            return  # raised in a destructor and lost there: raise_if_interrupted raises it again
        sys.__unraisablehook__(what)

    watch_the_stop(config.current().stop_limit_s, kill_started)
    sys.unraisablehook = unraisable  # no "Exception ignored ... Traceback" on the way out
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


_interrupted = threading.Event()  # set by the first Ctrl-C or SIGTERM (stop_on_signals)
_watching: list[threading.Thread] = []


def raise_if_interrupted() -> None:
    """KeyboardInterrupt again when a signal came and its KeyboardInterrupt was lost: raised
    while a destructor ran (a Redis client's ``__del__``), it is printed as "Exception ignored"
    and dropped, and the handler will not raise it twice — a command that waits calls this
    as it polls."""
    if _interrupted.is_set():
        raise KeyboardInterrupt


def watch_the_stop(limit_s: float, kill: Callable[[], None]) -> None:
    """From the first interruption on, give the stop ``limit_s`` seconds; past them, end this
    process whatever it waits on: ``kill`` (the local processes it started), every thread's
    stack to stderr (a stop that hangs is a bug to report), one line, exit 130. A daemon
    thread started now, not in the signal handler (starting a thread there could deadlock);
    a stop that ends in time exits as it would."""
    def watch() -> None:
        _interrupted.wait()
        time.sleep(limit_s)
        try:
            kill()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.write(f"error: stopping took more than {limit_s:g} s (TENSORTURN_STOP_LIMIT_S); "
                             "its local processes were killed. Please report the stacks above.\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - stderr closed or not a file: the exit matters more
            pass
        finally:
            os._exit(130)

    if not _watching:
        _watching.append(threading.Thread(target=watch, name="tt-stop-watch", daemon=True))
        _watching[0].start()


def ignore_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="tensorturn")
def cli() -> None:
    """TensorTurn: train one model on several machines you own.

    \b
    Fused mode shards the data and averages weights every H steps (DiLoCo) into one model.
    Ensemble mode trains diverse full models that vote.
    With no --broker, `tensorturn run` starts a private Redis and local agents on this machine.
    """


def run_in(environ: dict[str, str], args: list[str]) -> None:
    """Run the command ``args`` in this process as a process started with ``environ`` would
    (an embedded pool's agent, forked from its warm parent: :mod:`tensorturn.pool.warm`): its
    settings are read from that environment, not kept from the parent's — Celery's app's
    too, which the parent configured as it imported it (a forked agent gave its running task
    the parent's shutdown grace, not its own). Exits."""
    os.environ.clear()
    os.environ.update(environ)
    config.reload()
    if "tensorturn.pool.celery_app" in sys.modules:
        from tensorturn.pool.celery_app import app, settings_for

        app.conf.update(settings_for(config.current()))
    cli(args=args, prog_name="tensorturn")


def main() -> None:
    args = sys.argv[1:]
    sys.argv[:] = title.masked(sys.argv)  # what Celery shows in its process titles (args read above)
    cli(args=args, prog_name="tensorturn")


from tensorturn.cli import dashboard, data, distill, export, inspect, owner, pool, run, serve, track  # noqa: E402,F401 - each module adds its commands
