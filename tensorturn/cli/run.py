"""``tensorturn run`` and ``resume``: queue work, follow it with a progress bar, print the result."""

from __future__ import annotations

import glob
import re
import sys
import time
from collections.abc import Callable
from typing import Any

import click

from tensorturn import config
from tensorturn.cli import cli, debugging, emit_json, fail, ignore_signals, pool_options, stop_on_signals
from tensorturn.errors import SpecError, TensorTurnError
from tensorturn.modes import get_mode, mode_names
from tensorturn.recipes.check import HOOK_TIMEOUT_S
from tensorturn.spec import FINISHED, LIMITS, check_bounds
from tensorturn.state.live import WIDTH, fit

LIVE_EVERY_S = 2.0  # without a terminal, what a run does now is printed at most this often


def _shape(note: str | None) -> str | None:
    """A line without its durations: "no progress for 130s" is not news after "… for 120s"."""
    return re.sub(r"\d+(\.\d+)?s\b", "Ns", note) if note else note


class RunProgress:
    """Live progress on stderr: a bar on a terminal, with what the run does now beside it;
    otherwise a line per finished unit, in order, and — indented, when it changed, at most
    every LIVE_EVERY_S — what the run does now. What a unit is (a round, a member's segment)
    and what "now" says are the mode's (``progress``, ``live_line``). Lines fit 80 columns."""

    def __init__(self, doc: dict[str, Any], quiet: bool = False,
                 clock: Callable[[], float] = time.monotonic):
        self.mode = get_mode(doc["mode"])
        self.quiet, self.info, self.note = quiet, "", None
        self.clock, self.live, self.live_at = clock, "", float("-inf")
        self.lines_seen: set[str] = set()
        _, self.total, _ = self.mode.progress(doc)
        self.bar = None
        if sys.stderr.isatty() and not quiet:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            # state, a short bar and the time leave the info column about 50 of 80 columns
            self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(bar_width=10),
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
        if _shape(doc.get("note")) != _shape(self.note):  # a stalled run says why, once per change
            self.note = doc.get("note")
            if self.note:
                self._say(f"warning: {self.note}")
        if self.bar is not None:
            width = max(self.bar.console.width - len(str(doc["state"])) - 10 - 7 - 3, 20)
            live = self.mode.live_line(doc, width)
            self.bar.update(self.task, completed=done, total=self.total, description=doc["state"],
                            info=live or fit(self.info, width))
            return
        live = self.mode.live_line(doc, WIDTH - 2)
        # a line that only counts seconds (an outer step evaluating) is not printed again
        if live and _shape(live) != _shape(self.live) and self.clock() - self.live_at >= LIVE_EVERY_S:
            self.live, self.live_at = live, self.clock()
            self._say("  " + live)

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


def print_result(doc: dict[str, Any], as_json: bool, exit_on_failure: bool = True,
                 finished_only: bool = False) -> None:
    """The run's outcome on stdout (JSON, or a few lines); a note on stderr; exit 1 if failed
    (and, with ``finished_only`` — a command that waited for a result — if cancelled)."""
    if as_json:
        emit_json(doc)
    else:
        click.echo(f"run {doc['run_id']}: {doc['state']}")
        if doc.get("error"):
            click.echo(f"  error: {doc['error']}")
        if doc["state"] == "cancelled":
            cancelled = doc.get("cancelled") or {}
            at = cancelled.get("at") or doc.get("finished_at")
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at)) if at else "?"
            click.echo(f"  cancelled at {when}" + (f" by {cancelled['by']}" if cancelled.get("by") else "")
                       + f"; `tensorturn resume {doc['run_id']}` continues it")
        for k, v in sorted((doc.get("metrics") or {}).items()):
            click.echo(f"  {k}: {v:.4f}" if isinstance(v, float) else f"  {k}: {v}")
        for m in doc.get("members") or []:  # an ensemble's members left out of its vote, and why
            if m["state"] == "dropped":
                click.echo(f"  member {m['member']} dropped: {m['reason']}")
        lineage = doc.get("lineage") or {}
        if "distilled_from" in lineage:
            click.echo(f"  distilled from: run {lineage['distilled_from']} (T {lineage['temperature']:g}, "
                       f"alpha {lineage['alpha']:g}, top-k {lineage['top_k']})")
        if "souped_from" in lineage:
            click.echo(f"  souped from: run {lineage['souped_from']} ({lineage['rule']} soup of "
                       f"members {', '.join(map(str, lineage['members']))})")
        if doc.get("model_uri"):
            click.echo(f"  model: {doc['model_uri']}")
            click.echo(f"  sha256: {doc['model_sha256']}")
    if doc.get("note"):
        click.echo(f"warning: {doc['note']}", err=True)
    if debugging() and not as_json:  # where each failed task broke, as its agent recorded it
        from tensorturn.tracebacks import failed_attempts

        for line in failed_attempts(doc.get("attempts") or []):
            click.echo(line, err=True)
    if doc["state"] == "failed" and exit_on_failure:
        logs = f" (agent logs: {doc['agent_logs']})" if doc.get("agent_logs") else ""
        click.echo(f"error: {config.mask_text(doc.get('error') or 'the run failed')}{logs}", err=True)
        sys.exit(1)
    if doc["state"] == "cancelled" and exit_on_failure and finished_only:
        click.echo(f"error: run {doc['run_id']} was cancelled; `tensorturn resume {doc['run_id']}` "
                   f"continues it", err=True)
        sys.exit(1)


def print_results(docs: list[dict[str, Any]], as_json: bool) -> None:
    """The outcome of one run, or of an ensemble and the student distilled from it (``--merge
    distill``): with ``--json`` one object, the student's, holding the ensemble's as ``ensemble``."""
    if len(docs) == 1:
        print_result(docs[0], as_json, finished_only=True)
        return
    if as_json:
        print_result({**docs[-1], "ensemble": docs[0]}, True, finished_only=True)
        return
    for doc in docs[:-1]:
        print_result(doc, False, exit_on_failure=False)
    print_result(docs[-1], False, finished_only=True)


def follow_options(command: str) -> Callable:
    """What `run` and `resume` share: where the work runs, and how the command waits for it."""

    def decorate(fn: Callable) -> Callable:
        for option in reversed([
            click.option("--local-workers", type=int, default=2, show_default=True,
                         help="Embedded pool only: agent processes to start on this machine."
                              + bounded("local_workers")),
            click.option("--detach", is_flag=True,
                         help="Queue the work and return at once (needs --broker)."),
            click.option("--timeout", "timeout_s", type=float, default=None,
                         help="Stop waiting after this many seconds (the run goes on)."
                              + bounded("timeout")),
            click.option("--json", "as_json", is_flag=True,
                         help="Print the run as one JSON object on stdout."),
            pool_options(f"Redis URL of the pool (env TENSORTURN_BROKER_URL). Without it, "
                         f"`{command}` starts a private embedded pool on this machine."),
        ]):
            fn = option(fn)
        return fn

    return decorate


def mode_options(*modes: str, defaults: dict[str, str] | None = None) -> Callable:
    """A flag for every option of ``modes`` (every mode in the registry when none is named),
    from the mode's options class; ``defaults`` shows a command's own defaults instead."""
    from dataclasses import MISSING, fields

    types = {"int": int, "float": float, "str": str}

    def decorate(fn: Callable) -> Callable:
        for name in reversed(modes or mode_names()):
            options = get_mode(name).Options
            by_name = {f.name: f for f in fields(options)}
            for field_name, text in reversed(options.flags()):
                f = by_name[field_name]
                kind = str(f.type).split(" | ")[0]
                shown = ("on" if f.default else "off") if kind == "bool" else f.default
                default = "" if f.default in (MISSING, None) else f" [default: {shown}]"
                if defaults and field_name in defaults:
                    default = f" [default: {defaults[field_name]}]"
                help_text = f"{name.capitalize()}: {text}.{default}{bounded(field_name)}"
                flag = "--" + field_name.replace("_", "-")
                if kind == "bool":
                    fn = click.option(f"{flag}/--no-{flag[2:]}", field_name, default=None, help=help_text)(fn)
                elif field_name in options.CHOICES:
                    fn = click.option(flag, field_name, type=click.Choice(options.CHOICES[field_name]),
                                      default=None, help=help_text)(fn)
                else:
                    fn = click.option(flag, field_name, type=types[kind], default=None, help=help_text)(fn)
        return fn

    return decorate


def bounded(name: str) -> str:
    """The range of an option, as ``--help`` shows it (from :data:`tensorturn.spec.LIMITS`)."""
    return f" [{LIMITS[name].shown()}]" if name in LIMITS else ""


def training_options(fn: Callable) -> Callable:
    """The inner training's options every run has (``RunSpec``'s common fields)."""
    for option in reversed([
        click.option("--lr", type=float, default=None,
                     help=f"Inner learning rate [default: the recipe's]{bounded('lr')}."),
        click.option("--batch-size", type=int, default=None,
                     help=f"[default: the recipe's]{bounded('batch_size')}"),
        click.option("--seed", type=int, default=0, show_default=True, help=bounded("seed")[1:]),
        click.option("--threads-per-task", type=int, default=1, show_default=True,
                     help="CPU torch threads per task; CPU results depend on it (an agent with "
                          f"fewer cores uses all of its own).{bounded('threads_per_task')}"),
        click.option("--max-attempts", type=int, default=3, show_default=True,
                     help="Attempts per task before the run fails (or an ensemble member drops)."
                          + bounded("max_attempts")),
        click.option("--eval-batches", type=int, default=None,
                     help="Validation and test figures from at most this many forward passes (of the "
                          "recipe's eval_batch_size rows, 512 by default) [default: the whole split]"
                          f"{bounded('eval_batches')}."),
        click.option("--precision", type=click.Choice(["auto", "fp32", "bf16", "fp16"]), default="auto",
                     show_default=True, help="Training precision: auto is bf16 on CUDA GPUs that "
                     "support it and fp32 elsewhere; bf16/fp16 autocast anywhere (fp16 with a "
                     "gradient scaler)."),
        click.option("--accumulate", type=int, default=1, show_default=True,
                     help="Minibatches per optimizer step (gradient accumulation: a batch of "
                          f"--batch-size × N in the memory of one).{bounded('accumulate')}"),
    ]):
        fn = option(fn)
    return fn


TRAINING = ("seed", "lr", "batch_size", "threads_per_task", "max_attempts", "eval_batches",
            "precision", "accumulate")

# A stage of a command: (run id, start(broker URL) — queue the run on that pool)
Stage = tuple[str, Callable[[str], Any]]


def launch(stages: list[Stage], broker: str | None, store: str, local_workers: int | None,
           detach: bool, timeout_s: float | None, recipes: list[str],
           docs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Start each stage's run and follow it to its end, on the pool at ``broker`` or on a
    private embedded one; a stage starts only once the one before it succeeded. Returns the
    runs' last descriptions (with ``detach``, the first run's as queued), appended to ``docs``
    as they finish (so a caller has them when a later stage is refused)."""
    from tensorturn.runs import service as client

    if not broker:  # the agents start here, on this machine
        check_bounds({"local_workers": local_workers})
    check_bounds({"timeout": timeout_s})
    if detach and broker is None:
        raise SpecError("--detach needs a pool (--broker): an embedded pool stops when the command exits")
    if detach and len(stages) > 1:
        raise SpecError("--merge waits for the ensemble to distill it: drop --detach, or run "
                        "`tensorturn distill RUN` once the ensemble has finished")
    docs = [] if docs is None else docs
    if not broker:
        return embedded(stages, store, local_workers or 1, timeout_s, recipes, docs)
    for run_id, start in stages:
        doc = start(broker)
        if detach:
            docs.append(doc if isinstance(doc, dict) else client.describe(run_id, broker, store))
            return docs
        click.echo(f"run {run_id} queued on {config.mask_url(broker)}", err=True)
        docs.append(follow_pool(broker, run_id, timeout_s))
        if docs[-1]["state"] != "succeeded":
            break
        if len(docs) < len(stages):  # the next stage reads this run's manifest: saved, finished
            from tensorturn.state.board import RunBoard
            from tensorturn.state.broker import check_broker
            from tensorturn.state.manifest import write_manifest
            from tensorturn.store.objects import open_store

            write_manifest(open_store(store), RunBoard(check_broker(broker)), run_id)
    return docs


# Options of one mode default to None here: only what the user gave reaches the spec, so an
# option of the other mode is refused by name, and defaults live in the mode's options class.
@cli.command()
@click.option("--mode", type=click.Choice(mode_names()), default="fused", show_default=True,
              help="fused: shard the data, average weights every H steps into one model. "
                   "ensemble: diverse full models that vote.")
@click.option("--recipe", required=True, metavar="NAME|module:attr",
              help="What to train: a built-in recipe (digits-mlp, charlm) or package.module:attr "
                   "importable on every machine.")
@click.option("--recipe-option", "recipe_options", multiple=True, metavar="KEY=VALUE",
              help="An option for the recipe (repeatable), e.g. --recipe-option data=book.txt. "
                   "Values are parsed as JSON when they can be (numbers, lists), else strings.")
@mode_options()
@click.option("--merge", type=click.Choice(["none", "distill"]), default="none", show_default=True,
              help="Ensemble: then distill the finished ensemble into one model on the same pool "
                   "(`tensorturn distill RUN` with its defaults; --seed, --lr and the other "
                   "training options given here apply to the student too; the result is the "
                   "student's run).")
@training_options
@follow_options("run")
def run(broker, store, mode, recipe, recipe_options, merge, local_workers, detach, timeout_s,
        as_json, **options):
    """Train a model on the pool and print the result.

    \b
    Examples (no setup; a private pool on this machine):
      tensorturn run --mode fused --recipe digits-mlp --local-workers 3 --json
      tensorturn run --mode ensemble --recipe digits-mlp --members 4 --local-workers 2
      tensorturn run --mode ensemble --recipe digits-mlp --members 4 --merge distill
    """
    from tensorturn.runs import service as client
    from tensorturn.spec import RunSpec

    training = {k: options.pop(k) for k in TRAINING}
    given = {k: v for k, v in options.items() if v is not None}
    spec = RunSpec.create(mode, recipe, store, recipe_options=parse_recipe_options(recipe_options),
                          **training, **given)
    client.validate(spec)  # before anything starts or anything heavy is imported
    if merge != "none" and mode != "ensemble":
        raise SpecError(f"--merge {merge} merges an ensemble's members into one model: it needs "
                        f"--mode ensemble (a {mode} run is one model already)")
    stages: list[Stage] = [(spec.run_id, lambda broker_url: client.submit(spec, broker_url))]
    recipes = [recipe]
    if merge == "distill":
        from tensorturn.cli.distill import check_distillable, distill_stage

        check_distillable(recipe, spec.recipe_options)  # before the ensemble, not after it
        stages.append(distill_stage(spec.run_id, store, training))
        recipes.append("distill")
    docs: list[dict[str, Any]] = []
    try:
        launch(stages, broker, store, local_workers, detach, timeout_s, recipes, docs)
    except TensorTurnError:
        if docs:  # a later stage was refused: what finished is still the user's to see
            print_result(docs[-1], as_json, exit_on_failure=False)
        raise
    print_results(docs, as_json)


def follow(broker: str, run_id: str, timeout_s: float | None) -> dict[str, Any]:
    """Wait for the run with a progress display; returns its last description."""
    from tensorturn.runs import service as client
    from tensorturn.state.board import RunBoard
    from tensorturn.state.broker import check_broker

    first = RunBoard(check_broker(broker)).describe(run_id)
    for warning in first.get("warnings", []):
        click.echo(f"warning: {warning}", err=True)
    progress = RunProgress(first)
    try:
        return client.wait(broker, run_id, on_update=progress, timeout_s=timeout_s)
    finally:
        progress.close()


def follow_pool(broker: str, run_id: str, timeout_s: float | None) -> dict[str, Any]:
    """:func:`follow` on a standing pool: Ctrl-C stops following (exit 130), not the run."""
    try:
        return follow(broker, run_id, timeout_s)
    except KeyboardInterrupt:
        click.echo(f"stopped following; run {run_id} goes on in the pool "
                   f"(`tensorturn status {run_id} --watch` follows it again)", err=True)
        sys.exit(130)


def embedded(stages: list[Stage], store_url: str, local_workers: int, timeout_s: float | None,
             recipes: list[str], docs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Start a private pool; for each stage, ``start(broker_url)`` its run and follow it (the
    next only once it succeeded); stop the pool. Returns the runs' last descriptions.

    The pool's agents import ``recipes`` (the user named them on this machine's command line)
    and share this machine's pool key (made on first use, ``.tensorturn/pool-key``)."""
    from tensorturn import trust
    from tensorturn.pool.embedded import LocalPool, logs_dir
    from tensorturn.state.board import RunBoard
    from tensorturn.state.broker import check_broker
    from tensorturn.state.manifest import write_manifest
    from tensorturn.store.objects import open_store

    click.echo(f"starting an embedded pool: redis-server + {local_workers} local agents; "
               f"store {config.mask_url(store_url)}", err=True)
    config.use(trust.with_allowed(config.current(), [glob.escape(r) for r in recipes]))  # exactly these
    trust.pool_key_or_create()
    t0 = time.monotonic()
    stop_on_signals()  # SIGTERM too: the pool's processes must not outlive this command
    queued, run_id = False, stages[0][0]
    docs = [] if docs is None else docs
    try:
        logs = logs_dir(run_id)  # kept once the pool stops: a failure is explained there too
        with LocalPool(local_workers, store_url, keep_logs=logs) as pool:
            click.echo(f"pool ready in {time.monotonic() - t0:.1f}s; run {run_id}", err=True)
            board = RunBoard(check_broker(pool.broker_url))
            for run_id, start in stages:
                queued = False
                try:
                    start(pool.broker_url)
                    doc = follow(pool.broker_url, run_id, timeout_s)
                except KeyboardInterrupt:
                    queued = board.exists(run_id)
                    if queued:  # cancelled as `tensorturn cancel` would, then the pool stops
                        from tensorturn.runs import service as client

                        try:
                            _, what = client.cancel(run_id, pool.broker_url, store_url,
                                                    by="interrupting its `tensorturn run` (embedded pool)",
                                                    wait_s=10.0)
                            click.echo(what, err=True)
                        except TensorTurnError:  # it finished just now: nothing to cancel
                            write_manifest(open_store(store_url), board, run_id)
                    raise
                if doc["state"] not in FINISHED:
                    board.fail(run_id, f"did not finish within --timeout {timeout_s}s; "
                                       f"continue with: tensorturn resume {run_id}")
                # the manifest must hold the final state before this pool (and its Redis) goes away
                docs.append({**write_manifest(open_store(store_url), board, run_id),
                             "agent_logs": str(logs)})
                if docs[-1]["state"] != "succeeded":
                    break
            ignore_signals()  # the runs are over: let the pool stop whatever arrives now
    except KeyboardInterrupt:
        if queued:
            click.echo(f"error: interrupted: run {run_id} was cancelled and the embedded pool "
                       f"stopped; the finished work is in the store. Continue with: "
                       f"tensorturn resume {run_id}", err=True)
        else:
            click.echo(f"error: interrupted before run {run_id} was queued; nothing to resume",
                       err=True)
        sys.exit(130)
    return docs


@cli.command()
@click.argument("run_id")
@follow_options("resume")
def resume(broker, store, run_id, local_workers, detach, timeout_s, as_json):
    """Continue a run from the last complete round or checkpoints in the store.

    For a run whose chain was lost (Redis lost its data, the embedded pool was stopped) or that
    failed and whose cause is fixed: every task gets a fresh allowance of attempts. Needs only
    the store (and a pool, or --local-workers).
    """
    from tensorturn.runs import service as client

    known = client.describe(run_id, None, store)  # an unknown run is refused before any pool starts
    if (known.get("lineage") or {}).get("souped_from"):
        raise SpecError(f"run {run_id} is a weight soup made by `tensorturn soup`: it is finished, "
                        f"there is nothing to resume")

    def start(broker_url: str) -> None:
        _, what = client.resume(run_id, broker_url, store)
        click.echo(f"run {run_id}: {what}", err=True)

    recipes = [known["recipe"]]
    if known["recipe"] == "distill":  # a student: its agents build the ensemble's recipe too
        recipes.append(((known.get("spec") or {}).get("recipe_options") or {}).get("recipe", ""))
    print_results(launch([(run_id, start)], broker, store, local_workers, detach, timeout_s,
                         [r for r in recipes if r]), as_json)


@cli.command()
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True, help="Print the run as one JSON object.")
@pool_options()
def cancel(broker, store, run_id, as_json):
    """Stop a run on the pool: it ends as `cancelled`.

    Its queued tasks are dropped and running ones stop within about a second, storing nothing;
    no attempt starts afterwards. `tensorturn resume RUN` continues it later from its last
    complete round (fused) or checkpoints (ensemble). Needs the pool (--join-file or --broker);
    Ctrl-C on a `tensorturn run` with an embedded pool cancels its run the same way.
    """
    import socket

    from tensorturn.runs import service as client

    if not broker:
        raise SpecError("cancel needs the pool the run is on: --join-file (from `tensorturn up`) "
                        "or --broker; a run of an embedded pool is cancelled by Ctrl-C on its "
                        "`tensorturn run`")
    doc, what = client.cancel(run_id, broker, store, by=f"tensorturn cancel on {socket.gethostname()}")
    click.echo(what, err=True)
    print_result(doc, as_json)


@cli.command("check-recipe")
@click.argument("recipe", metavar="NAME|module:Class")
@click.option("--recipe-option", "recipe_options", multiple=True, metavar="KEY=VALUE",
              help="An option for the recipe (repeatable), as `run` takes it.")
@click.option("--hook-timeout", type=click.FloatRange(min=0, min_open=True, max=86400), metavar="SECONDS",
              default=HOOK_TIMEOUT_S, show_default=True,
              help="The longest one step (one hook) may run before the check stops it and names it.")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as one JSON object.")
@pool_options("Unused: the recipe is checked here, with the store of --store or the join file.")
def check_recipe(recipe, recipe_options, hook_timeout, as_json, broker, store):
    """Run every hook of a recipe on a few rows, in seconds, before a long run.

    Data and splits, preprocess, the model, the loss and its gradient, a few training steps,
    evaluate, two ensemble members combined by the recipe's task kind, and the answer the API
    would serve. The first problem is one line naming the step and, when the recipe raised, its
    file and line (exit 2; --debug adds the traceback); nothing is queued. It runs in a process
    of its own, as an agent would import the recipe (from PYTHONPATH and installed packages, not
    the current directory), and reads datasets from the store `run` would use.
    """
    from tensorturn import trust
    from tensorturn.recipes.check import CheckFailed, check_in_child

    config.use(trust.with_allowed(config.current(), [recipe]))  # named here, by this user
    options = parse_recipe_options(recipe_options)
    try:
        found = check_in_child(recipe, options, hook_timeout, debug=debugging())
    except CheckFailed as exc:
        if debugging() and exc.trace:  # the recipe's own failure: where, in full
            click.echo(exc.trace, err=True)
        fail(f"recipe {recipe!r} failed at {exc}" + (f" (at {exc.where})" if exc.where else ""),
             exc.exit_code)
        return
    if as_json:
        emit_json(found)
        return
    rows = found["rows"]
    outputs = ", ".join(f"{n} {o['datatype']} {o['shape']}" for n, o in found["outputs"].items())
    metrics = ", ".join(f"{k} {v:.4g}" for k, v in found["val_metrics"].items())
    click.echo(f"recipe {recipe} ({found['task']}): ok in {found['seconds']:.1f}s\n"
               f"  data: {rows['train']} train / {rows['val']} validation / {rows['test']} test rows, "
               f"input {found['input_shape']}\n"
               f"  model: {found['parameters']:,} parameters; train loss {found['train_loss']:.4g} "
               f"after a few steps; validation {metrics}\n"
               f"  served: {outputs}")
    for note in found.get("notes", []):
        click.echo(f"  note: {note}")
