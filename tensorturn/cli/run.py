"""``tensorturn run`` and ``resume``: queue work, follow it with a progress bar, print the result."""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import click

from .. import config
from ..errors import SpecError
from ..spec import FINISHED
from . import cli, emit_json, ignore_signals, pool_options, stop_on_signals


class RunProgress:
    """Live progress on stderr: a bar on a terminal, one line per finished unit otherwise.
    What a unit is (a round, a member's segment) is the mode's to say."""

    def __init__(self, doc: dict[str, Any], quiet: bool = False):
        from ..modes import get_mode

        self.mode = get_mode(doc["mode"])
        self.quiet, self.lines_seen, self.info, self.note = quiet, set(), "", None
        _, self.total, _ = self.mode.progress(doc)
        self.bar = None
        if sys.stderr.isatty() and not quiet:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                TextColumn("{task.completed}/{task.total} " + self.mode.unit),
                                TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                                console=Console(stderr=True), transient=False)
            self.task = self.bar.add_task("queued", total=self.total, info="")
            self.bar.start()

    def __call__(self, doc: dict[str, Any]) -> None:
        done, self.total, events = self.mode.progress(doc)
        for key, line in events:
            if key in self.lines_seen:
                continue
            self.lines_seen.add(key)
            self.info = line
            self._say(line)
        if doc.get("note") != self.note:  # a stalled run says why, once per change
            self.note = doc.get("note")
            if self.note:
                self._say(f"warning: {self.note}")
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=self.total, description=doc["state"],
                            info=self.info)

    def _say(self, line: str) -> None:
        if self.bar is not None:
            self.bar.console.print(line, highlight=False)
        elif not self.quiet:
            click.echo(line, err=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def parse_recipe_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values are JSON when they parse as JSON, else plain strings."""
    import json

    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--recipe-option needs KEY=VALUE (got {pair!r})")
        try:
            options[key.strip()] = json.loads(value)
        except ValueError:
            options[key.strip()] = value
    return options


def print_result(doc: dict[str, Any], as_json: bool) -> None:
    """The run's outcome on stdout (JSON, or a few lines); a note on stderr; exit 1 if failed."""
    if as_json:
        emit_json(doc)
    else:
        click.echo(f"run {doc['run_id']}: {doc['state']}")
        if doc.get("error"):
            click.echo(f"  error: {doc['error']}")
        for k, v in sorted((doc.get("metrics") or {}).items()):
            click.echo(f"  {k}: {v:.4f}" if isinstance(v, float) else f"  {k}: {v}")
        if doc.get("model_uri"):
            click.echo(f"  model: {doc['model_uri']}")
            click.echo(f"  sha256: {doc['model_sha256']}")
    if doc.get("note"):
        click.echo(f"warning: {doc['note']}", err=True)
    if doc["state"] == "failed":
        click.echo(f"error: {config.mask_text(doc.get('error') or 'the run failed')}", err=True)
        sys.exit(1)


# Options of one mode default to None here: only what the user gave reaches the spec, so an
# option of the other mode is refused by name, and defaults live in the mode's options class.
@cli.command()
@click.option("--mode", type=click.Choice(["fused", "ensemble"]), default="fused", show_default=True,
              help="fused: shard the data, average weights every H steps into one model. "
                   "ensemble: diverse full models that vote.")
@click.option("--recipe", required=True, metavar="NAME|module:attr",
              help="What to train: a built-in recipe (digits-mlp, charlm) or package.module:attr "
                   "importable on every machine.")
@click.option("--recipe-option", "recipe_options", multiple=True, metavar="KEY=VALUE",
              help="An option for the recipe (repeatable), e.g. --recipe-option data=book.txt. "
                   "Values are parsed as JSON when they can be (numbers, lists), else strings.")
@click.option("--rounds", type=int, default=None, help="Fused: outer rounds [default: 8].")
@click.option("--sync-every", "sync_every", type=int, default=None,
              help="Fused: inner steps per shard between weight averages (H) [default: 25].")
@click.option("--shards", type=int, default=None,
              help="Fused: virtual replicas per round [default: 8]; more shards than machines "
                   "lets faster machines take more. The math depends on this, not on the machines.")
@click.option("--outer", type=click.Choice(["nesterov", "sgd"]), default=None,
              help="Fused outer optimizer: nesterov (DiLoCo, the default) or sgd (with "
                   "--outer-lr 1: FedAvg).")
@click.option("--outer-lr", type=float, default=None,
              help="Fused: outer learning rate [default: 0.7 for nesterov, 1.0 for sgd].")
@click.option("--outer-momentum", type=float, default=None, help="Fused [default: 0.9].")
@click.option("--codec", type=click.Choice(["fp32", "fp16", "int8"]), default=None,
              help="Fused: encoding of what travels between rounds — pseudo-gradients up and "
                   "weight updates down [default: fp32; int8: ~3.9× fewer bytes, with error "
                   "feedback on the download].")
@click.option("--members", type=int, default=None,
              help="Ensemble: models to train, at least 2 [default: one per online machine].")
@click.option("--min-members", type=int, default=None,
              help="Ensemble: the run fails if fewer members finish [default: 1].")
@click.option("--vote", type=click.Choice(["soft", "hard"]), default=None,
              help="Ensemble: soft = mean probability (the default), hard = majority.")
@click.option("--segments", type=int, default=None,
              help="Ensemble: checkpointed segments per member (a lost machine costs one) "
                   "[default: 3].")
@click.option("--segment-steps", type=int, default=None,
              help="Ensemble: optimizer steps per segment [default: 400].")
@click.option("--bootstrap/--no-bootstrap", default=None,
              help="Ensemble: train each member on its own bootstrap sample [default: on].")
@click.option("--diversity", type=click.Choice(["full", "seed"]), default=None,
              help="Ensemble: full = seed + a draw from the recipe's config space (the default); "
                   "seed = seed only.")
@click.option("--deadline", type=float, default=None,
              help="Ensemble: seconds after submission; members still training then drop out.")
@click.option("--lr", type=float, default=None, help="Inner learning rate [default: the recipe's].")
@click.option("--batch-size", type=int, default=None, help="[default: the recipe's]")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads-per-task", type=int, default=1, show_default=True,
              help="CPU torch threads per task; CPU results depend on it.")
@click.option("--max-attempts", type=int, default=3, show_default=True,
              help="Attempts per task before the run fails (or an ensemble member drops).")
@click.option("--local-workers", type=int, default=2, show_default=True,
              help="Embedded pool only: agent processes to start on this machine.")
@click.option("--detach", is_flag=True, help="Queue the run and return at once (needs --broker).")
@click.option("--timeout", "timeout_s", type=float, default=None,
              help="Stop waiting after this many seconds (the run goes on).")
@click.option("--json", "as_json", is_flag=True, help="Print the run as one JSON object on stdout.")
@pool_options("Redis URL of the pool (env TENSORTURN_BROKER_URL). Without it, `run` starts a "
              "private embedded pool on this machine.")
def run(broker, store, mode, recipe, recipe_options, seed, lr, batch_size, threads_per_task,
        max_attempts, local_workers, detach, timeout_s, as_json, **mode_options):
    """Train a model on the pool and print the result.

    \b
    Examples (no setup; a private pool on this machine):
      tensorturn run --mode fused --recipe digits-mlp --local-workers 3 --json
      tensorturn run --mode ensemble --recipe digits-mlp --members 4 --local-workers 2
    """
    from .. import client
    from ..spec import RunSpec

    given = {k: v for k, v in mode_options.items() if v is not None}
    spec = RunSpec.create(mode, recipe, store, recipe_options=parse_recipe_options(recipe_options),
                          seed=seed, lr=lr, batch_size=batch_size,
                          threads_per_task=threads_per_task, max_attempts=max_attempts, **given)
    client.validate(spec)  # before anything starts or anything heavy is imported
    if broker is None and (local_workers is None or local_workers < 1):
        raise SpecError(f"--local-workers must be a whole number ≥ 1 (got {local_workers})")
    if detach and broker is None:
        raise SpecError("--detach needs a pool (--broker): an embedded pool stops when `run` exits")
    if broker:
        doc = client.submit(spec, broker)
        if not detach:
            click.echo(f"run {spec.run_id} queued on {config.mask_url(broker)}", err=True)
            doc = follow(broker, spec.run_id, timeout_s)
    else:
        doc = embedded(spec.run_id, store, local_workers, timeout_s,
                       lambda broker_url: client.submit(spec, broker_url))
    print_result(doc, as_json)


def follow(broker: str, run_id: str, timeout_s: float | None) -> dict[str, Any]:
    """Wait for the run with a progress display; returns its last description."""
    from .. import client
    from ..board import RunBoard
    from ..broker import check_broker

    progress = RunProgress(RunBoard(check_broker(broker)).describe(run_id))
    try:
        return client.wait(broker, run_id, on_update=progress, timeout_s=timeout_s)
    finally:
        progress.close()


def embedded(run_id: str, store_url: str, local_workers: int, timeout_s: float | None,
             start: Callable[[str], Any]) -> dict[str, Any]:
    """Start a private pool, call ``start(broker_url)``, follow the run, stop the pool."""
    from ..board import RunBoard
    from ..broker import check_broker
    from ..local import LocalPool
    from ..manifest import write_manifest
    from ..store import open_store

    click.echo(f"starting an embedded pool: redis-server + {local_workers} local agents; "
               f"store {config.mask_url(store_url)}", err=True)
    t0 = time.monotonic()
    stop_on_signals()  # SIGTERM too: the pool's processes must not outlive this command
    queued = False
    try:
        with LocalPool(local_workers, store_url) as pool:
            click.echo(f"pool ready in {time.monotonic() - t0:.1f}s; run {run_id}", err=True)
            board = RunBoard(check_broker(pool.broker_url))
            try:
                start(pool.broker_url)
                doc = follow(pool.broker_url, run_id, timeout_s)
            except KeyboardInterrupt:
                queued = board.exists(run_id)
                if queued:
                    board.fail(run_id, f"interrupted; the embedded pool was stopped. "
                                       f"Continue with: tensorturn resume {run_id}")
                    write_manifest(open_store(store_url), board, run_id)
                raise
            if doc["state"] not in FINISHED:
                board.fail(run_id, f"did not finish within --timeout {timeout_s}s; "
                                   f"continue with: tensorturn resume {run_id}")
            # the manifest must hold the final state before this pool (and its Redis) goes away
            doc = write_manifest(open_store(store_url), board, run_id)
            ignore_signals()  # the run is over: let the pool stop whatever arrives now
    except KeyboardInterrupt:
        if queued:
            click.echo(f"error: interrupted; the embedded pool was stopped and the finished work "
                       f"is in the store. Continue with: tensorturn resume {run_id}", err=True)
        else:
            click.echo(f"error: interrupted before run {run_id} was queued; nothing to resume",
                       err=True)
        sys.exit(130)
    return doc


@cli.command()
@click.argument("run_id")
@click.option("--local-workers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Embedded pool only: agent processes to start on this machine.")
@click.option("--detach", is_flag=True, help="Queue the remaining work and return (needs --broker).")
@click.option("--timeout", "timeout_s", type=float, default=None,
              help="Stop waiting after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the run as one JSON object on stdout.")
@pool_options("Redis URL of the pool (env TENSORTURN_BROKER_URL). Without it, `resume` starts a "
              "private embedded pool on this machine.")
def resume(broker, store, run_id, local_workers, detach, timeout_s, as_json):
    """Continue a run from the last complete round or checkpoints in the store.

    For a run whose chain was lost (Redis lost its data, the embedded pool was stopped) or that
    failed and whose cause is fixed: every task gets a fresh allowance of attempts. Needs only
    the store (and a pool, or --local-workers).
    """
    from .. import client

    if detach and broker is None:
        raise SpecError("--detach needs a pool (--broker): an embedded pool stops when `resume` exits")
    client.describe(run_id, None, store)  # an unknown run is refused before any pool starts

    def start(broker_url: str) -> None:
        _, what = client.resume(run_id, broker_url, store)
        click.echo(f"run {run_id}: {what}", err=True)

    if broker:
        start(broker)
        doc = (client.describe(run_id, broker, store) if detach
               else follow(broker, run_id, timeout_s))
    else:
        doc = embedded(run_id, store, local_workers, timeout_s, start)
    print_result(doc, as_json)
