"""What the run commands print: a run's outcome on stdout (``--json``: one object), its progress
and the launch's news on stderr, and the exit code a failed, cancelled or interrupted run gives."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from tensorturn import config
from tensorturn.cli import debugging, emit_json, ignore_signals, raise_if_interrupted, stop_on_signals
from tensorturn.spec import RunState

if TYPE_CHECKING:  # imported when a command runs: `--help` and argument errors load no Redis client
    from tensorturn.runs.display import RunProgress
    from tensorturn.runs.launch import Observer


def say(line: str) -> None:
    click.echo(line, err=True)


class Terminal:
    """A launch as this command shows it (a :class:`tensorturn.runs.launch.Observer`): its lines
    on stderr, a run's progress (:class:`RunProgress`), and SIGTERM, like Ctrl-C, stopping an
    embedded pool."""

    def __init__(self) -> None:
        self.progress: "RunProgress | None" = None

    def say(self, line: str) -> None:
        say(line)

    def watch(self, doc: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
        from tensorturn.runs.display import RunProgress

        self.progress = progress = RunProgress(doc, say=say)

        def update(later: dict[str, Any]) -> None:
            raise_if_interrupted()  # the interruption a destructor swallowed, if one did
            progress(later)
        return update

    def unwatch(self) -> None:
        if self.progress is not None:
            self.progress.close()
            self.progress = None

    def guard(self) -> None:
        stop_on_signals()  # SIGTERM too: the pool's processes must not outlive this command

    def unguard(self) -> None:
        ignore_signals()  # the runs are over: let the pool stop whatever arrives now


def launched(call: Callable[["Observer"], Any]) -> Any:
    """``call(observer)``'s answer; an interrupted launch says what became of its run, exit 130."""
    from tensorturn.runs.launch import Interrupted

    try:
        return call(Terminal())
    except Interrupted as exc:
        click.echo(f"error: {exc}" if exc.stopped else str(exc), err=True)
        sys.exit(130)


def print_result(doc: dict[str, Any], as_json: bool, exit_on_failure: bool = True,
                 finished_only: bool = False, details: list[str] | None = None) -> None:
    """The run's outcome on stdout (JSON, or a few lines, then ``details``); a note on stderr;
    exit 1 if failed (and, with ``finished_only`` — a command that waited for a result — if
    cancelled)."""
    from tensorturn.runs.display import result_lines, shown

    doc = shown(doc)  # (a secret recipe option masked, whatever prints it)
    if as_json:
        emit_json(doc)
    else:
        for line in [*result_lines(doc), *(details or [])]:
            click.echo(line)
    if doc.get("note"):
        click.echo(f"warning: {doc['note']}", err=True)
    if debugging() and not as_json:  # where each failed task broke, as its agent recorded it
        from tensorturn.tracebacks import failed_attempts

        for line in failed_attempts(doc.get("attempts") or []):
            click.echo(line, err=True)
    if doc["state"] == RunState.FAILED and exit_on_failure:
        logs = f" (agent logs: {doc['agent_logs']})" if doc.get("agent_logs") else ""
        click.echo(f"error: {config.mask_text(doc.get('error') or 'the run failed')}{logs}", err=True)
        sys.exit(1)
    if doc["state"] == RunState.CANCELLED and exit_on_failure and finished_only:
        click.echo(f"error: run {doc['run_id']} was cancelled; `tensorturn resume {doc['run_id']}` "
                   f"continues it", err=True)
        sys.exit(1)


def print_results(docs: list[dict[str, Any]], as_json: bool) -> None:
    """The outcome of one run, or of an ensemble and the student distilled from it (``--merge
    distill``): with ``--json`` one object, the student's, holding the ensemble's as ``ensemble``."""
    from tensorturn.runs.display import as_one

    if len(docs) == 1 or as_json:
        print_result(as_one(docs), as_json, finished_only=True)
        return
    for doc in docs[:-1]:
        print_result(doc, False, exit_on_failure=False)
    print_result(docs[-1], False, finished_only=True)


def can_ask() -> bool:
    """Whether a person can answer a question here (stdin is a terminal)."""
    return sys.stdin.isatty()
