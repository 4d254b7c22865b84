"""``tensorturn run``, ``resume``, ``cancel`` and ``check-recipe``: parse, call
:mod:`tensorturn.runs`, print."""

from __future__ import annotations

import click

from tensorturn.cli import cli, debugging, emit_json, fail, pool_options
from tensorturn.cli.options import (
    GroupedHelp,
    follow_options,
    mode_options,
    parse_recipe_options,
    run_groups,
    training_options,
)
from tensorturn.cli.output import launched, print_result, print_results, say
from tensorturn.cli.track import track_options, tracking
from tensorturn.errors import SpecError, TensorTurnError
from tensorturn.modes import mode_names
from tensorturn.recipes.check import HOOK_TIMEOUT_S


# Options of one mode default to None here: only what the user gave reaches the spec, so an
# option of the other mode is refused by name, and defaults live in the mode's options class.
# --help lists the common options first, then the rest under "Expert options" headings.
@cli.command(cls=GroupedHelp, groups=run_groups)
@click.option("--mode", type=click.Choice(mode_names()), default="fused", show_default=True,
              help="fused: shard the data, average weights every H steps into one model. "
                   "ensemble: diverse full models that vote.")
@click.option("--recipe", metavar="NAME|module:attr",
              help="What to train: a built-in recipe (digits-mlp, charlm) or package.module:attr "
                   "importable on every machine. Required, here or in --config's file.")
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
@click.option("--config", "config_file", type=click.Path(dir_okay=False), metavar="FILE",
              help="Read the run's settings from a run file (TOML: one key a flag, e.g. rounds = 4, "
                   "and a [recipe_options] table); flags given here override it.")
@click.option("--print-config", is_flag=True,
              help="Print the settings the run would have (the run file's and the flags, with every "
                   "default) as a run file, and exit without running.")
@click.option("--plan-only", is_flag=True,
              help="Fused: print what --plan auto would choose (codecs, sync, H, shards, where the "
                   "outer step runs) and why, from the pool's links and step times (θ_0's step "
                   "timed here), and exit without running.")
@track_options
def run(broker, store, mode, recipe, recipe_options, merge, local_workers, detach, timeout_s,
        as_json, config_file, print_config, plan_only, track, track_dir, **options):
    """Train a model on the pool and print the result.

    \b
    Examples (no setup; a private pool on this machine):
      tensorturn run --mode fused --recipe digits-mlp --local-workers 3 --json
      tensorturn run --mode ensemble --recipe digits-mlp --members 4 --local-workers 2
      tensorturn run --mode ensemble --recipe digits-mlp --members 4 --merge distill
      tensorturn run --recipe charlm --rounds 4 --print-config > run.toml
      tensorturn run --config run.toml --seed 1
      tensorturn run --recipe gpt2-small --broker redis://... --plan-only
    """
    from click.core import ParameterSource

    from tensorturn import runfile
    from tensorturn.runs.launch import Launcher
    from tensorturn.runs.request import RunRequest

    ctx = click.get_current_context()
    values = {"mode": mode, "recipe": recipe, "merge": merge, "local_workers": local_workers,
              "timeout_s": timeout_s, **options}
    # a flag given (not its default) wins over the run file; every default is the file's to set
    given = {("timeout" if k == "timeout_s" else k): v for k, v in values.items()
             if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT}
    if recipe_options:
        given["recipe_options"] = parse_recipe_options(recipe_options)
    request = RunRequest.of(given, config_file)  # before anything starts or anything heavy is imported
    if print_config:
        click.echo(runfile.dumps(request.settings), nl=False)
        return
    if plan_only:
        doc = Launcher(broker, store).plan(request)
        if as_json:
            emit_json(doc)
        else:
            from tensorturn.runs.display import plan_lines

            for line in plan_lines(doc["plan"]):
                click.echo(line)
        return
    tracked = tracking(track, track_dir, detach)
    docs: list[dict] = []
    try:
        launched(lambda observer: Launcher(broker, store, tracked(observer)).run(request, detach, docs))
    except TensorTurnError:
        if docs:  # a later stage was refused: what finished is still the user's to see
            print_result(docs[-1], as_json, exit_on_failure=False)
        raise
    print_results(docs, as_json)


@cli.command()
@click.argument("run_id", metavar="RUN")
@click.option("--replan", is_flag=True,
              help="Fused, started with --plan auto: make the plan again from today's links and "
                   "step times (the codecs and H it chose; the sync policy stays) before the next "
                   "round; recorded on the run.")
@follow_options("resume")
@track_options
def resume(broker, store, run_id, replan, local_workers, detach, timeout_s, as_json, track, track_dir):
    """Continue a run from the last complete round or checkpoints in the store. (To let a
    paused machine work again: `tensorturn unpause MACHINE`.)

    For a run whose chain was lost (Redis lost its data, the embedded pool was stopped) or that
    failed and whose cause is fixed: every task gets a fresh allowance of attempts. Needs only
    the store (and a pool, or --local-workers).
    """
    from tensorturn.runs.launch import Launcher
    from tensorturn.runs.owners import names_an_agent

    if broker and names_an_agent(broker, run_id):  # the old form of `unpause`, kept working
        from tensorturn.cli.owner import unpause_machine

        click.echo(f"note: `tensorturn resume MACHINE` is now `tensorturn unpause {run_id}`", err=True)
        unpause_machine(broker, run_id, as_json)
        return

    tracked = tracking(track, track_dir, detach)
    print_results(launched(lambda observer: Launcher(broker, store, tracked(observer)).resume(
        run_id, local_workers, detach, timeout_s, replan=replan)), as_json)


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

    from tensorturn import runs

    if not broker:
        raise SpecError("cancel needs the pool the run is on: --join-file (from `tensorturn up`) "
                        "or --broker; a run of an embedded pool is cancelled by Ctrl-C on its "
                        "`tensorturn run`")
    doc, what = runs.cancel(run_id, broker, store, by=f"tensorturn cancel on {socket.gethostname()}")
    say(what)
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
    from tensorturn.recipes.check import CheckFailed, check_in_child

    options = parse_recipe_options(recipe_options)
    try:  # the recipe was named here, by this user: the check may import it
        found = check_in_child(recipe, options, hook_timeout, debug=debugging(), allow=[recipe])
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
