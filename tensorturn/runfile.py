"""Run files: a run's settings in TOML — ``tensorturn run --config run.toml`` reads one,
``--print-config`` writes one, ``Pool.run(config=...)`` takes one.

A run file holds what ``tensorturn run``'s flags say, one key a flag (``sync_every`` or
``sync-every`` for ``--sync-every``), ``recipe_options`` as a table::

    mode = "fused"
    recipe = "charlm"
    rounds = 4
    [recipe_options]
    data = "book.txt"

Where the run goes (``--broker``, ``--store``, ``--join-file``) is not a run file's: those name a
pool and its secrets, and a run file is kept with the run. Read with the standard library's
``tomllib``, written with ``tomli-w`` (its writing counterpart, by tomllib's author). Nothing
here imports torch.
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorturn.errors import SpecError
from tensorturn.registry import get_mode, mode_names

if TYPE_CHECKING:
    from tensorturn.spec import RunSpec

# How the command runs a run, beside what its spec holds
LAUNCH = ("merge", "local_workers", "timeout")
# The inner training's settings every run has (RunSpec's own fields)
TRAINING = ("seed", "lr", "batch_size", "threads_per_task", "max_attempts", "eval_batches",
            "precision", "accumulate")
MERGES = ("none", "distill")
# What `tensorturn run` does with a setting left out of both the file and the flags (the spec's
# and the modes' own defaults are theirs). An embedded pool's size is not among them: it is how
# this command runs the run, written only where the user gave it (or, kept with an embedded run,
# what ran: tensorturn.runs.request.RunRequest.spec_for)
DEFAULTS: dict[str, Any] = {"mode": "fused", "merge": "none"}
LOCAL_WORKERS = 2  # an embedded pool's agents when --local-workers is not given
WHERE = {"broker": "--broker", "store": "--store", "join_file": "--join-file", "join": "--join-file",
         "allow_recipe": "--allow-recipe"}
# How a run is logged, not what runs: given with the command (or Pool.run), never kept with the run
TRACKING = {"track": "--track (Pool.run(track=...))", "track_dir": "--track-dir (Pool.run(track_dir=...))"}
KIND_WORDS = {"int": "a whole number", "float": "a number", "str": "a string", "bool": "true or false",
              "table": "a table ([recipe_options])"}
HEADER = ("# A TensorTurn run file: `tensorturn run --config FILE` runs it (flags given with it win),\n"
          "# `Pool.run(config=FILE)` too. Where it runs (--broker, --store, --join-file) is not kept here.\n")
UNSETTLED = ("# lr and batch_size not given: the recipe's own (`tensorturn status RUN --print-config`\n"
             "# shows what a run used).\n")


def _kind(annotation: Any) -> str:
    """A dataclass field's kind from its annotation (a string: ``int | None`` → ``int``)."""
    return str(annotation).split(" | ")[0]


def kinds() -> dict[str, str]:
    """Every setting a run file may hold, with its kind (int, float, str, bool, table)."""
    from tensorturn.spec import RunSpec

    spec_fields = {f.name: f for f in fields(RunSpec)}
    out = {"mode": "str", "recipe": "str", "merge": "str", "local_workers": "int", "timeout": "float"}
    out.update({name: _kind(spec_fields[name].type) for name in TRAINING})
    for mode in mode_names():
        options = get_mode(mode).Options
        by_name = {f.name: f for f in fields(options)}
        out.update({name: _kind(by_name[name].type) for name, _ in options.flags()})
    out["recipe_options"] = "table"
    return out


TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str, "table": dict}


def _fits(kind: str, value: Any) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    return not isinstance(value, bool) and isinstance(value, TYPES[kind])


def _check_option(what: str, value: Any) -> None:
    """SpecError unless ``value`` is what a run's options hold (JSON: the spec is JSON): TOML's
    dates and times are not."""
    if isinstance(value, (dict, list)):
        for v in value.values() if isinstance(value, dict) else value:
            _check_option(what, v)
    elif value is not None and not isinstance(value, (str, int, float, bool)):
        raise SpecError(f"{what} is a TOML {type(value).__name__} ({value}), which a run's options cannot "
                        f"hold: write it as a string (\"{value}\")")


def check(settings: dict[str, Any], where: str = "") -> dict[str, Any]:
    """``settings`` with each key as a field name (``sync-every`` → ``sync_every``), or a
    one-line SpecError for the first unknown key or value of the wrong kind; ``where`` (a file)
    starts the message. A value left None counts as not given and is dropped."""
    known = kinds()
    prefix = f"{where}: " if where else ""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        name = key.replace("-", "_")
        if value is None:
            continue
        if name in WHERE:
            raise SpecError(f"{prefix}{key!r} is where the run goes, not what runs: give {WHERE[name]} "
                            f"(or its environment variable) instead")
        if name in TRACKING:
            raise SpecError(f"{prefix}{key!r} is how the run is logged, not what runs: give {TRACKING[name]} "
                            f"instead, or log a run afterwards with `tensorturn track RUN --to ...`")
        if name not in known:
            close = difflib.get_close_matches(name, list(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else " (see `tensorturn run --help`)"
            raise SpecError(f"{prefix}unknown setting {key!r}{hint}")
        if not _fits(known[name], value):
            raise SpecError(f"{prefix}{name} must be {KIND_WORDS[known[name]]} (got {value!r})")
        if name == "recipe_options":
            for option, given in value.items():
                _check_option(f"{prefix}recipe option {option!r}", given)
        out[name] = value
    return out


def read(path: str | Path) -> dict[str, Any]:
    """The settings in the run file at ``path``, checked (:func:`check`); SpecError in one line
    when it cannot be read, is not TOML, or holds an unknown key or a value of the wrong kind."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"no run file {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"cannot read the run file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"{path} is not a valid TOML file: {exc}") from None
    return check(doc, str(path))


def combine(file: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """A run file's settings with those ``given`` (flags, keyword arguments) over them, and the
    defaults of :data:`DEFAULTS` under both; ``recipe_options`` are combined key by key."""
    settings = {**DEFAULTS, **file, **given}
    recipe_options = {**file.get("recipe_options", {}), **given.get("recipe_options", {})}
    if recipe_options:
        settings["recipe_options"] = recipe_options
    if settings["merge"] not in MERGES:
        raise SpecError(f"--merge {settings['merge']!r} is not one of {', '.join(MERGES)}")
    return settings


def resolved(spec: "RunSpec", settings: dict[str, Any]) -> dict[str, Any]:
    """Every setting of ``spec``'s run as a run file holds it: its mode and recipe, the launch's
    (``settings``' merge, local workers and timeout), the training's and the mode's options with
    their defaults filled in — those the run decides at its start (left None) left out — and the
    recipe's options. A run from it is the run of ``spec`` again."""
    out: dict[str, Any] = {"mode": spec.mode, "recipe": spec.recipe}
    out.update({k: settings.get(k) for k in LAUNCH})
    out.update({k: getattr(spec, k) for k in TRAINING})
    options = asdict(spec.options)
    out.update({name: options[name] for name, _ in type(spec.options).flags()})
    if spec.recipe_options:
        out["recipe_options"] = dict(spec.recipe_options)
    return {k: v for k, v in out.items() if v is not None}


def ordered(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` in the order ``run --help`` lists them (mode and recipe first; a copy read
    back from the store has its keys sorted)."""
    order = {k: i for i, k in enumerate(kinds())}
    return dict(sorted(settings.items(), key=lambda kv: order.get(kv[0], len(order))))


def dumps(settings: dict[str, Any]) -> str:
    """``settings`` as a run file (TOML), after a comment on how to use it. A recipe option
    that is null (``--recipe-option k=null``) has no TOML form: a one-line SpecError."""
    import tomli_w

    for key, value in (settings.get("recipe_options") or {}).items():
        if value is None:
            raise SpecError(f"recipe option {key!r} is null, which a TOML run file cannot hold: "
                            f"leave it out or give it a value")
    doc = {k: v for k, v in ordered(settings).items() if v is not None and (k != "recipe_options" or v)}
    header = HEADER + (UNSETTLED if "lr" not in doc or "batch_size" not in doc else "")
    try:
        return header + tomli_w.dumps(doc)
    except TypeError as exc:  # a value TOML has no form for (a null inside a list)
        raise SpecError(f"these settings cannot be written as TOML: {exc}") from None
