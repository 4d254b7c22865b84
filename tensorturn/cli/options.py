"""The options ``run``, ``distill`` and ``resume`` share: where the work runs and how the command
waits for it, the inner training's, every mode's (from its options class), and ``--recipe-option``
pairs; each ``--help`` shows its range from :data:`tensorturn.spec.LIMITS`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

from tensorturn.cli import pool_options
from tensorturn.errors import SpecError
from tensorturn.modes import get_mode, mode_names
from tensorturn.spec import LIMITS


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
        click.option("--seed", type=int, default=0, show_default=True,
                     help=f"Random seed of the run (initial weights, data order).{bounded('seed')}"),
        click.option("--threads-per-task", type=int, default=1, show_default=True,
                     help="CPU torch threads per task; CPU results depend on it (an agent with "
                          f"fewer cores uses all of its own).{bounded('threads_per_task')}"),
        click.option("--max-attempts", type=int, default=3, show_default=True,
                     help="Attempts per task before the run fails (or an ensemble member drops)."
                          + bounded("max_attempts")),
        click.option("--eval-batches", type=int, default=None,
                     help="Validation and test figures from at most this many forward passes (of the "
                          "recipe's eval_batch_size rows, 512 by default); 0: the whole split "
                          "[default: fused, as many rows as one shard trains in a round (a split "
                          "that small is read whole); ensemble, the whole split]"
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


class GroupedHelp(click.Command):
    """A command whose ``--help`` lists its options under headings, the common ones first.

    click has no option groups of its own; this is its ``format_options`` with the rows sorted
    into sections (``groups(command)``: (heading, parameter names) in order), so the options
    themselves stay plain ``click.option`` decorators. An option no group names is listed last,
    under "Other options": a new flag is never hidden."""

    def __init__(self, *args: Any, groups: Callable[[], list[tuple[str, list[str]]]], **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.groups = groups

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                rows["help" if param is self.get_help_option(ctx) else param.name] = record
        for heading, names in [*self.groups(), ("Other options", list(rows))]:
            section = [rows.pop(name) for name in names if name in rows]
            if section:
                with formatter.section(heading):
                    formatter.write_dl(section)


def run_groups() -> list[tuple[str, list[str]]]:
    """``run --help``'s headings: what most runs set, first; where the run goes and how the
    command waits; then the expert options — each mode's others (from its options class) and
    the inner training's."""
    groups = [("Options", ["mode", "recipe", "recipe_options", "config_file", "rounds", "members",
                           "merge", "seed", "local_workers", "join_file", "as_json", "print_config", "plan_only",
                           "help"]),
              ("Where it runs, and how the command waits",
               ["broker", "store", "allow", "detach", "timeout_s", "track", "track_dir", "debug"])]
    groups += [(f"Expert options, --mode {name}", [f for f, _ in get_mode(name).Options.flags()])
               for name in mode_names()]
    groups.append(("Expert options, training", list(TRAINING)))
    return groups
