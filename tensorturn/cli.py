"""The ``tensorturn`` command. Thin: it parses options and calls the modules that do the work."""

from __future__ import annotations

import functools
import json
import logging
import signal
import sys
import time
from typing import Any

import click

from . import settings
from .errors import TensorTurnError

log = logging.getLogger("tensorturn")


# ---- shared options and error handling --------------------------------------------------------

def pool_options(fn):
    """``--broker``, ``--store`` and ``--debug`` on every command."""

    @click.option("--broker", envvar=settings.BROKER_ENV, metavar="URL",
                  help="Redis URL of the pool (env TENSORTURN_BROKER_URL). Without it, `run` "
                       "starts a private embedded pool.")
    @click.option("--store", envvar=settings.STORE_ENV, metavar="URL",
                  help="Object store: file:///dir, a directory, or s3://bucket/prefix "
                       "(env TENSORTURN_STORE_URL; default ./tensorturn-store).")
    @click.option("--debug", is_flag=True, help="Show tracebacks and debug logs.")
    @functools.wraps(fn)
    def wrapper(*args, broker, store, debug, **kwargs):
        logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING,
                            format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
        ctx = click.get_current_context()
        ctx.meta["debug"] = debug
        store_url = settings.normalize_store_url(store) if store else settings.store_url()
        try:
            return fn(*args, broker=broker or None, store=store_url, **kwargs)
        except TensorTurnError as exc:
            if debug:
                raise
            click.echo(f"error: {settings.mask_text(str(exc))}", err=True)
            sys.exit(exc.exit_code)

    return wrapper


def emit_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2, sort_keys=True, default=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="tensorturn")
def cli() -> None:
    """TensorTurn: train one model on several machines you own.

    \b
    Fused mode shards the data and averages weights every H steps (DiLoCo) into one model.
    Ensemble mode trains diverse full models that vote.
    With no --broker, `tensorturn run` starts a private Redis and local agents on this machine.
    """


# ---- run --------------------------------------------------------------------------------------

class RunProgress:
    """Live progress on stderr: a bar on a terminal, one line per finished unit otherwise.

    Units are rounds (fused) or member segments (ensemble).
    """

    def __init__(self, spec: dict[str, Any], quiet: bool = False):
        self.fused = spec["mode"] == "fused"
        members = spec.get("members") or 0
        self.total = spec["rounds"] if self.fused else members * spec["segments"]
        self.quiet, self.lines_seen, self.info = quiet, set(), ""
        self.bar = None
        if sys.stderr.isatty() and not quiet:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            unit = "rounds" if self.fused else "segments"
            self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                TextColumn("{task.completed}/{task.total} " + unit),
                                TimeElapsedColumn(), TextColumn("{task.fields[info]}"),
                                console=Console(stderr=True), transient=False)
            self.task = self.bar.add_task("queued", total=self.total, info="")
            self.bar.start()

    def _events(self, doc: dict[str, Any]) -> tuple[int, list[tuple[str, str]]]:
        if self.fused:
            events = []
            for r in doc.get("rounds", []):
                info = f"loss {r['loss']:.4f}  val_loss {r['val_loss']:.4f}"
                if r.get("val_accuracy") is not None:
                    info += f"  val_acc {r['val_accuracy']:.3f}"
                events.append((f"r{r['round']}", f"round {r['round'] + 1}/{self.total}  {info}"))
            return len(events), events
        done, events = 0, []
        for m in doc.get("members", []):
            done += m.get("segments_done", 0)
            if m["state"] == "succeeded":
                acc = m["metrics"].get("test_accuracy")
                events.append((f"m{m['member']}", f"member {m['member']} succeeded"
                               + (f"  test_acc {acc:.3f}" if acc is not None else "")))
            elif m["state"] == "dropped":
                events.append((f"m{m['member']}", f"member {m['member']} dropped: {m['reason']}"))
        return done, events

    def __call__(self, doc: dict[str, Any]) -> None:
        done, events = self._events(doc)
        for key, line in events:
            if key in self.lines_seen:
                continue
            self.lines_seen.add(key)
            self.info = line
            if self.bar is None and not self.quiet:
                click.echo(line, err=True)
        if self.bar is not None:
            self.bar.update(self.task, completed=done, description=doc["state"], info=self.info)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def parse_recipe_options(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values are JSON when they parse as JSON, else plain strings."""
    from .errors import SpecError

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
    if as_json:
        emit_json(doc)
        return
    click.echo(f"run {doc['run_id']}: {doc['state']}")
    if doc.get("error"):
        click.echo(f"  error: {doc['error']}")
    for k, v in sorted((doc.get("metrics") or {}).items()):
        click.echo(f"  {k}: {v:.4f}" if isinstance(v, float) else f"  {k}: {v}")
    if doc.get("model_uri"):
        click.echo(f"  model: {doc['model_uri']}")
        click.echo(f"  sha256: {doc['model_sha256']}")


@cli.command()
@click.option("--mode", type=click.Choice(["fused", "ensemble"]), default="fused", show_default=True,
              help="fused: shard the data, average weights every H steps into one model. "
                   "ensemble: diverse full models that vote.")
@click.option("--recipe", required=True, metavar="NAME|module:attr",
              help="What to train: a built-in recipe (digits-mlp) or package.module:attr "
                   "importable on every machine.")
@click.option("--recipe-option", "recipe_options", multiple=True, metavar="KEY=VALUE",
              help="An option for the recipe (repeatable), e.g. --recipe-option data=book.txt. "
                   "Values are parsed as JSON when they can be (numbers, lists), else strings.")
@click.option("--rounds", type=int, default=8, show_default=True, help="Fused: outer rounds.")
@click.option("--sync-every", "sync_every", type=int, default=25, show_default=True,
              help="Fused: inner steps per shard between weight averages (H).")
@click.option("--shards", type=int, default=8, show_default=True,
              help="Fused: virtual replicas per round; more shards than machines lets faster "
                   "machines take more. The math depends on this, not on the machines.")
@click.option("--outer", type=click.Choice(["nesterov", "sgd"]), default="nesterov", show_default=True,
              help="Fused outer optimizer: nesterov (DiLoCo) or sgd (with --outer-lr 1: FedAvg).")
@click.option("--outer-lr", type=float, default=None,
              help="Outer learning rate [default: 0.7 for nesterov, 1.0 for sgd].")
@click.option("--outer-momentum", type=float, default=0.9, show_default=True)
@click.option("--codec", type=click.Choice(["fp32", "fp16", "int8"]), default="fp32", show_default=True,
              help="Fused: encoding of what travels between rounds — pseudo-gradients up and "
                   "weight updates down (int8: ~3.9× fewer bytes than fp32, with error feedback "
                   "on the download).")
@click.option("--members", type=int, default=None,
              help="Ensemble: models to train [default: one per online machine, at least 2].")
@click.option("--min-members", type=int, default=1, show_default=True,
              help="Ensemble: the run fails if fewer members finish.")
@click.option("--vote", type=click.Choice(["soft", "hard"]), default="soft", show_default=True,
              help="Ensemble: soft = mean probability, hard = majority of top classes.")
@click.option("--segments", type=int, default=3, show_default=True,
              help="Ensemble: checkpointed segments per member (a lost machine costs one).")
@click.option("--segment-steps", type=int, default=400, show_default=True,
              help="Ensemble: optimizer steps per segment.")
@click.option("--bootstrap/--no-bootstrap", default=True, show_default=True,
              help="Ensemble: train each member on its own bootstrap sample of the data.")
@click.option("--diversity", type=click.Choice(["full", "seed"]), default="full", show_default=True,
              help="Ensemble: full = seed + a draw from the recipe's config space; seed = seed only.")
@click.option("--deadline", type=float, default=None,
              help="Ensemble: seconds after submission; members still training then drop out.")
@click.option("--lr", type=float, default=None, help="Inner learning rate [default: the recipe's].")
@click.option("--batch-size", type=int, default=None, help="[default: the recipe's]")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads-per-task", type=int, default=1, show_default=True,
              help="CPU torch threads per task; CPU results depend on it.")
@click.option("--max-attempts", type=int, default=3, show_default=True,
              help="Attempts per task before the run fails.")
@click.option("--local-workers", type=int, default=2, show_default=True,
              help="Embedded pool only: agent processes to start on this machine.")
@click.option("--detach", is_flag=True, help="Queue the run and return at once (needs --broker).")
@click.option("--timeout", "timeout_s", type=float, default=None,
              help="Stop waiting after this many seconds (the run goes on).")
@click.option("--json", "as_json", is_flag=True, help="Print the run as one JSON object on stdout.")
@pool_options
def run(broker, store, mode, recipe, recipe_options, rounds, sync_every, shards, outer, outer_lr, outer_momentum,
        codec, members, min_members, vote, segments, segment_steps, bootstrap, diversity, deadline,
        lr, batch_size, seed, threads_per_task, max_attempts, local_workers, detach, timeout_s,
        as_json):
    """Train a model on the pool and print the result.

    \b
    Examples (no setup; a private pool on this machine):
      tensorturn run --mode fused --recipe digits-mlp --local-workers 3 --json
      tensorturn run --mode ensemble --recipe digits-mlp --members 4 --local-workers 2
    """
    from .errors import SpecError
    from .recipes import resolve
    from .runs import RunSpec

    spec = RunSpec(mode=mode, recipe=recipe, store_url=store, seed=seed, rounds=rounds,
                   recipe_options=parse_recipe_options(recipe_options),
                   sync_every=sync_every, shards=shards, outer=outer, outer_lr=outer_lr,
                   outer_momentum=outer_momentum, codec=codec, members=members,
                   min_members=min_members, vote=vote, segments=segments,
                   segment_steps=segment_steps, bootstrap=bootstrap, diversity=diversity,
                   deadline=deadline, lr=lr, batch_size=batch_size,
                   threads_per_task=threads_per_task, max_attempts=max_attempts)
    spec.validate()
    resolve(spec.recipe, spec.recipe_options)  # fail fast, before anything starts
    if broker is None and (local_workers is None or local_workers < 1):
        raise SpecError(f"--local-workers must be a whole number ≥ 1 (got {local_workers})")
    if detach and broker is None:
        raise SpecError("--detach needs a pool (--broker): an embedded pool stops when `run` exits")

    if broker:
        doc = _run_on(broker, spec, detach, timeout_s, as_json)
    else:
        doc = _run_embedded(spec, local_workers, timeout_s, as_json)
    print_result(doc, as_json)
    if doc["state"] == "failed":
        sys.exit(1)


def _run_on(broker: str, spec, detach: bool, timeout_s, as_json: bool) -> dict:
    from . import client

    doc = client.submit(spec, broker)
    if detach:
        return doc
    click.echo(f"run {spec.run_id} queued on {settings.mask_url(broker)}", err=True)
    return _follow(broker, spec.run_id, timeout_s)


def _follow(broker: str, run_id: str, timeout_s) -> dict:
    from . import client
    from .runs import RunBoard, check_broker

    spec_doc = RunBoard(check_broker(broker)).describe(run_id)["spec"]
    progress = RunProgress(spec_doc)
    try:
        return client.wait(broker, run_id, on_update=progress, timeout_s=timeout_s)
    finally:
        progress.close()


def _embedded(run_id: str, store_url: str, local_workers: int, timeout_s, start) -> dict:
    """Start a private pool, call ``start(broker_url)``, follow the run, stop the pool."""
    from .local import LocalPool
    from .runs import RunBoard, check_broker, write_manifest
    from .store import open_store

    click.echo(f"starting an embedded pool: redis-server + {local_workers} local agents; "
               f"store {settings.mask_url(store_url)}", err=True)
    t0 = time.monotonic()
    _stop_on_signals()  # SIGTERM too: the pool's processes must not outlive this command
    queued = False
    try:
        with LocalPool(local_workers, store_url) as pool:
            click.echo(f"pool ready in {time.monotonic() - t0:.1f}s; run {run_id}", err=True)
            board = RunBoard(check_broker(pool.broker_url))
            try:
                start(pool.broker_url)
                doc = _follow(pool.broker_url, run_id, timeout_s)
            except KeyboardInterrupt:
                queued = board.exists(run_id)
                if queued:
                    board.fail(run_id, f"interrupted; the embedded pool was stopped. "
                                       f"Continue with: tensorturn resume {run_id}")
                    write_manifest(open_store(store_url), board, run_id)
                raise
            if doc["state"] not in ("succeeded", "failed"):
                board.fail(run_id, f"did not finish within --timeout {timeout_s}s; "
                                   f"continue with: tensorturn resume {run_id}")
            # the manifest must hold the final state before this pool (and its Redis) goes away
            doc = write_manifest(open_store(store_url), board, run_id)
            _ignore_signals()  # the run is over: let the pool stop whatever arrives now
    except KeyboardInterrupt:
        if queued:
            click.echo(f"error: interrupted; the embedded pool was stopped and the finished work "
                       f"is in the store. Continue with: tensorturn resume {run_id}", err=True)
        else:
            click.echo(f"error: interrupted before run {run_id} was queued; nothing to resume",
                       err=True)
        sys.exit(130)
    return doc


def _run_embedded(spec, local_workers: int, timeout_s, as_json: bool) -> dict:
    from . import client

    return _embedded(spec.run_id, spec.store_url, local_workers, timeout_s,
                     lambda broker: client.submit(spec, broker))


@cli.command()
@click.argument("run_id")
@click.option("--local-workers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Embedded pool only: agent processes to start on this machine.")
@click.option("--detach", is_flag=True, help="Queue the remaining work and return (needs --broker).")
@click.option("--timeout", "timeout_s", type=float, default=None,
              help="Stop waiting after this many seconds.")
@click.option("--json", "as_json", is_flag=True, help="Print the run as one JSON object on stdout.")
@pool_options
def resume(broker, store, run_id, local_workers, detach, timeout_s, as_json):
    """Continue a run from the last complete round or checkpoints in the store.

    For a run whose chain was lost: Redis lost its data, the embedded pool was stopped, or the
    run failed and its cause is fixed. Needs only the store (and a pool, or --local-workers).
    """
    from . import client
    from .errors import SpecError

    if detach and broker is None:
        raise SpecError("--detach needs a pool (--broker): an embedded pool stops when `resume` exits")

    def start(broker_url: str) -> None:
        _, what = client.resume(run_id, broker_url, store)
        click.echo(f"run {run_id}: {what}", err=True)

    if broker:
        start(broker)
        doc = (client.describe(run_id, broker, store) if detach
               else _follow(broker, run_id, timeout_s))
    else:
        doc = _embedded(run_id, store, local_workers, timeout_s, start)
    print_result(doc, as_json)
    if doc["state"] == "failed":
        sys.exit(1)


# ---- status / runs ----------------------------------------------------------------------------

@cli.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--watch", is_flag=True, help="Follow the run until it finishes.")
@pool_options
def status(broker, store, run_id, as_json, watch):
    """Show a run: state, metrics, rounds, attempts (from the broker, else the store)."""
    from . import client

    doc = client.describe(run_id, broker, store)
    if watch and broker and doc["state"] not in ("succeeded", "failed"):
        progress = RunProgress(doc["spec"])
        try:
            doc = client.wait(broker, run_id, on_update=progress)
        finally:
            progress.close()
    if as_json:
        emit_json(doc)
        return
    print_result(doc, False)
    for r in doc.get("rounds", []):
        acc = r.get("val_accuracy")
        click.echo(f"  round {r['round']}: loss {r['loss']:.4f} val_loss {r['val_loss']:.4f}"
                   + (f" val_acc {acc:.3f}" if acc is not None else "") + f" bytes {r['bytes']}")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@pool_options
def runs(broker, store, as_json):
    """List runs, newest first (from the broker, else the store's manifests)."""
    from . import client

    items = client.list_runs(broker, store)
    if as_json:
        emit_json(items)
        return
    if not items:
        click.echo("no runs")
    for m in items:
        acc = (m.get("metrics") or {}).get("test_accuracy")
        click.echo(f"{m['run_id']}  {m['mode']:8s} {m['state']:9s} {m['recipe']}"
                   + (f"  test_accuracy {acc:.4f}" if acc is not None else ""))


@cli.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print the plots' locations as JSON.")
@pool_options
def report(broker, store, run_id, as_json):
    """Plot a run (loss per round or member, samples/s per worker, bytes moved) as PNG files
    saved beside its manifest; prints where they are."""
    from . import client
    from .report import save_report
    from .store import open_store

    uris = save_report(client.describe(run_id, broker, store), open_store(store))
    if as_json:
        emit_json(uris)
        return
    for uri in uris:
        click.echo(uri)


# ---- workers / agent / up ---------------------------------------------------------------------

@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@pool_options
def workers(broker, store, as_json):
    """List the pool's machines: state (idle/busy/offline), device, memory, current task."""
    from . import client

    if not broker:
        raise TensorTurnError("`workers` needs a pool: pass --broker URL or set TENSORTURN_BROKER_URL")
    items = client.workers(broker)
    if as_json:
        emit_json(items)
        return
    if not items:
        click.echo("no workers have connected to this broker")
    for w in items:
        mem = f"{w['device_memory_gb']:.1f} GB"
        line = (f"{w['name']:28s} {w['state']:8s} {w['device']:4s} {w['device_name'][:32]:32s} "
                f"{w['cpu_count']:>3} cpus  {mem:>9s}  done {w['tasks_done']}")
        if w["task"]:
            rate = w.get("samples_per_s")
            line += f"  {w['task']}" + (f" {rate:.0f} samples/s" if rate else "")
        if w["state"] == "offline":
            line += f"  (last seen {w['last_seen_s']:.0f}s ago)"
        click.echo(line)


@cli.command()
@click.option("--join", "join", metavar="JOIN", envvar="TENSORTURN_JOIN",
              help="The join string `tensorturn up` printed (carries the broker and store).")
@click.option("--name", default=None, help="Worker name (shown as NAME@host) [default: agent].")
@click.option("--concurrency", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tasks at once on this machine. One is right for a GPU and for CPUs "
                   "(each CPU task uses --threads-per-task threads).")
@click.option("--memory-gb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Offer at most this much device memory (VRAM, or RAM on CPU) to the pool.")
@click.option("--loglevel", default=None, help="Celery log level [default: INFO].")
@pool_options
def agent(broker, store, join, name, concurrency, memory_gb, loglevel):
    """Run this machine's agent: a Celery worker that trains what the pool queues.

    It only opens outbound connections, to the broker and the store, reconnects forever when the
    network drops, and on SIGTERM puts its running task back in the queue within a few seconds.
    """
    import os

    # SIGTERM (systemd, Ctrl-C of a supervisor) becomes Celery's cold shutdown with a short soft
    # grace: running tasks get a few seconds, then their messages go straight back to the queue.
    # billiard reads this when first imported, so it is set before anything imports Celery.
    os.environ.setdefault("REMAP_SIGTERM", "SIGQUIT")
    from .celery_app import configure
    from .runs import check_broker
    from .store import open_store
    from .telemetry import MEMORY_ENV

    if join:
        from .coordinator import apply_join, parse_join

        broker, joined_store = apply_join(parse_join(join))
        if joined_store:
            store = joined_store
            os.environ[settings.STORE_ENV] = store
    if not broker:
        raise TensorTurnError("the agent needs a pool: pass --join JOIN (from `tensorturn up`), "
                              "or --broker URL / TENSORTURN_BROKER_URL")
    check_broker(broker)
    if join or os.environ.get(settings.STORE_ENV):
        open_store(store).check()
    if memory_gb:
        os.environ[MEMORY_ENV] = str(memory_gb)
    configure(broker)
    from .agent import run_agent

    run_agent(name, concurrency, loglevel)


@cli.command()
@click.option("--port", type=click.IntRange(1, 65535), default=None,
              help="Redis port [default: 6379, or the one used last time].")
@click.option("--bind", default="0.0.0.0", show_default=True,
              help="Address Redis listens on (0.0.0.0: every interface, for your other machines).")
@click.option("--advertise", default=None, metavar="HOST",
              help="Host name or address the agents dial [default: this machine's address].")
@click.option("--dir", "directory", type=click.Path(file_okay=False), default=".tensorturn",
              show_default=True, help="Where Redis keeps its data and the generated password.")
@pool_options
def up(broker, store, port, bind, advertise, directory):
    """Start the coordinator in the foreground: a Redis for the pool and the store.

    It prints the one line to paste on each of your machines. Stop it with Ctrl-C. Users with
    their own Redis and S3/MinIO do not need this: give agents --broker and --store instead.
    """
    from pathlib import Path

    from .coordinator import CoordinatorConfig, advertised_host, make_join
    from .local import RedisServer
    from .store import open_store

    if broker:
        raise TensorTurnError("`up` starts its own Redis; drop --broker (or unset TENSORTURN_BROKER_URL)")
    home = Path(directory).resolve()
    cfg = CoordinatorConfig.load_or_create(home, port or 0)
    open_store(store).check()
    server = RedisServer(home / "redis", port=cfg.port, appendonly=True, password=cfg.password,
                         bind=bind)
    try:
        server.start()
    except TensorTurnError as exc:
        raise TensorTurnError(f"{exc}; is port {cfg.port} in use? try --port") from None
    host = advertise or (advertised_host() if bind == "0.0.0.0" else bind)
    broker_url = f"redis://:{cfg.password}@{host}:{cfg.port}/0"
    join = make_join(broker_url, store)
    url_file = home / "broker-url"  # written before the join line, which callers wait for
    url_file.write_text(broker_url + "\n")
    url_file.chmod(0o600)
    click.echo(f"TensorTurn coordinator: Redis on {bind}:{cfg.port} (AOF on, noeviction), "
               f"store {settings.mask_url(store)}", err=True)
    click.echo("On each of your machines, run (this line is a secret: it holds the Redis "
               "password):", err=True)
    click.echo(f"  tensorturn agent --join {join}")
    click.echo(f"Submit runs with: TENSORTURN_BROKER_URL=$(cat {home / 'broker-url'}) tensorturn run ...",
               err=True)
    click.echo("Ctrl-C stops the coordinator.", err=True)
    _stop_on_signals()
    try:
        server.proc.wait()
        raise TensorTurnError(f"redis-server exited (log: {home / 'redis' / 'redis.log'})")
    except KeyboardInterrupt:
        click.echo("stopping the coordinator", err=True)
    finally:
        server.stop()


def _stop_on_signals() -> None:
    """Ctrl-C and SIGTERM (a service manager's stop) both end a foreground command cleanly.

    Set explicitly: a process started in the background by a non-interactive shell inherits
    SIGINT *ignored*, and Python then leaves it ignored, so Ctrl-C semantics would silently vanish.
    """
    def interrupt(_signum, _frame):
        _ignore_signals()  # once: a second Ctrl-C must not cut short the cleanup it starts
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)


def _ignore_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


# ---- serving ----------------------------------------------------------------------------------

@cli.command()
@click.argument("run_id")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 for every interface).")
@click.option("--port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--name", "alias", default=None, help="An alias for the model besides the run id.")
@click.option("--max-body-mb", type=click.FloatRange(min=0, min_open=True), default=8.0,
              show_default=True, help="Largest request body accepted (larger → 413).")
@pool_options
def serve(broker, store, run_id, host, port, alias, max_body_mb):
    """Serve a run's model (or voting ensemble) as an authenticated HTTP API.

    Open Inference Protocol (KServe V2) routes under /v2; OpenAPI page at /docs. Every
    /v2/models route needs `Authorization: Bearer <token>` from `tensorturn token create`.
    The server needs only the store.
    """
    from .serve import run_server
    from .store import open_store

    run_server(open_store(store), run_id, host, port, alias, int(max_body_mb * 1024 * 1024))


@cli.group()
def token():
    """API tokens: create (shown once), list, revoke. Only their hashes are stored."""


@token.command("create")
@click.option("--name", default=None, help="A label to recognise the token by.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (with the token).")
@pool_options
def token_create(broker, store, name, as_json):
    """Create a token and print it once; it cannot be shown again."""
    from . import tokens
    from .store import open_store

    secret, record = tokens.create(open_store(store), name)
    if as_json:
        emit_json({**tokens.public(record), "token": secret})
        return
    click.echo(secret)
    click.echo(f"token {record['id']} ({record['name']}) created; this is the only time it is "
               f"shown. Send it as 'Authorization: Bearer <token>'.", err=True)


@token.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list.")
@pool_options
def token_list(broker, store, as_json):
    """List tokens (ids, names, dates; never the tokens themselves)."""
    from . import tokens
    from .store import open_store

    items = [tokens.public(r) for r in tokens.records(open_store(store))]
    if as_json:
        emit_json(items)
        return
    if not items:
        click.echo("no tokens")
    for t in items:
        state = "revoked" if t["revoked_at"] else "active"
        created = time.strftime("%Y-%m-%d %H:%M", time.localtime(t["created_at"]))
        click.echo(f"{t['id']}  {t['name']:20s} {state:8s} created {created}")


@token.command("revoke")
@click.argument("id_or_name")
@pool_options
def token_revoke(broker, store, id_or_name):
    """Revoke a token by id or name; servers refuse it within a few seconds."""
    from . import tokens
    from .store import open_store

    record = tokens.revoke(open_store(store), id_or_name)
    click.echo(f"token {record['id']} ({record['name']}) revoked")


def main() -> None:
    cli(prog_name="tensorturn")


if __name__ == "__main__":
    main()
