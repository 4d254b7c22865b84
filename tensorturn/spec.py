"""The run spec: the options every run has, plus one options object of its mode.

``runs/<id>/spec.json`` holds it; it decides the run's result. Derived facts (the memory a task
needs, θ_0's hash) are filled in when the run starts and stored with it. This module imports no
torch: the CLI validates a spec before anything heavy is loaded.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any, ClassVar, TypeVar

from tensorturn.errors import SpecError
from tensorturn.registry import get_mode, mode_names, option_owner


class RunState(StrEnum):
    """A run's state (``tt:run:<id>``'s ``state``, the JSON's ``state``). A ``StrEnum``: each
    member is the very string stored and printed, so stored runs and the JSON are unchanged."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class Outcome(StrEnum):
    """How an attempt ended (``attempts[].outcome``): the word it starts with. A finished
    attempt's outcome may go on after a colon (``failed: ValueError: ...``, ``lost: requeued to
    another attempt``); :meth:`of` reads the word back."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LATE = "late"
    CANCELLED = "cancelled"
    LOST = "lost"
    REFUSED = "refused"
    HANDED_BACK = "handed back"  # its machine's owner needed it: the task went to another (no attempt spent)

    def says(self, why: str) -> str:
        """The outcome ``<word>: why`` as stored."""
        return f"{self.value}: {why}"

    @classmethod
    def of(cls, outcome: str) -> Outcome | None:
        """The word an outcome starts with; None for one that starts with no known word."""
        try:
            return cls(outcome.split(":", 1)[0])
        except ValueError:
            return None


class MemberState(StrEnum):
    """An ensemble member's state (``members[].state``)."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    DROPPED = "dropped"


STATES = tuple(RunState)
PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # device.autocast's (this module imports no torch)
FINISHED = (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED)  # no task of such a run starts


def flag(name: str) -> str:
    """The command-line flag of an option field: ``sync_every`` → ``--sync-every``."""
    return "--" + name.replace("_", "-")


def new_run_id() -> str:
    """A fresh run id: when, then 6 random hex digits (``20261203-194501-3fa9c2``)."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


@dataclass(frozen=True)
class Bound:
    """The values one option may take. The ceilings are what one machine, the broker and a
    run's lifetime can hold: past them an option does not make a bigger run, it takes the pool
    down (100,000 threads crashed an agent; a million shards hung the broker). ``why`` is said
    when a value is over the ceiling."""

    low: float
    high: float
    why: str = ""
    low_open: bool = False   # the end itself is outside
    high_open: bool = False

    @property
    def whole(self) -> bool:
        return isinstance(self.low, int) and isinstance(self.high, int)

    def shown(self) -> str:
        """The range as ``--help`` shows it (click's notation): ``1<=x<=1024``, ``0<x<10``."""
        return (f"{self.low:.15g}{'<' if self.low_open else '<='}x"
                f"{'<' if self.high_open else '<='}{self.high:.15g}")

    def check(self, name: str, value: Any) -> None:
        """SpecError, in one line, unless ``value`` is within the bound (None: not given)."""
        if value is None:
            return
        if self.whole:
            if not isinstance(value, int) or isinstance(value, bool) or value < self.low:
                raise SpecError(f"{flag(name)} must be a whole number ≥ {self.low} (got {value})")
            if value > self.high:
                raise SpecError(f"{flag(name)} must be at most {self.high:,} (got {value:,})"
                                + (f": {self.why}" if self.why else ""))
            return
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise SpecError(f"{flag(name)} must be a number (got {value!r})")
        if self.low == 0 and self.low_open and value <= 0:
            raise SpecError(f"{flag(name)} must be positive (got {value:g})")
        above = value > self.high or (self.high_open and value == self.high)
        below = value < self.low or (self.low_open and value == self.low)
        if above or below or not math.isfinite(value):
            interval = (f"{'(' if self.low_open else '['}{self.low:.15g}, {self.high:.15g}"
                        f"{')' if self.high_open else ']'}")
            raise SpecError(f"{flag(name)} must be in {interval} (got {value:g})"
                            + (f": {self.why}" if above and self.why else ""))


YEAR_S = 365 * 24 * 3600
# Every numeric option of a run, of either mode, of `distill` and of the command that starts it:
# one table, shown by `--help` and checked before anything is queued (tests/integration/test_bounds.py).
LIMITS: dict[str, Bound] = {
    # every run (RunSpec)
    "seed": Bound(0, 2 ** 32 - 1, "seeds are 32-bit"),
    "lr": Bound(0.0, 10.0, low_open=True, high_open=True),
    "batch_size": Bound(1, 2 ** 20),
    "threads_per_task": Bound(1, 256, "one task's torch threads (an agent with fewer cores "
                                      "uses as many as it has)"),
    "max_attempts": Bound(1, 100),
    "eval_batches": Bound(0, 1_000_000),
    "accumulate": Bound(1, 1024),
    # fused
    "rounds": Bound(1, 10_000),
    "sync_every": Bound(1, 1_000_000),
    "shards": Bound(1, 1024, "each is a task on the broker every round"),
    "outer_lr": Bound(0.0, 10.0, low_open=True),
    "outer_momentum": Bound(0.0, 1.0, high_open=True),
    "eval_every": Bound(1, 10_000),
    # ensemble
    "members": Bound(2, 64, "each is a whole model, trained, stored and run for every answer"),
    "min_members": Bound(1, 64),
    "segments": Bound(1, 10_000),
    "segment_steps": Bound(1, 1_000_000),
    "deadline": Bound(0.0, YEAR_S, "a year at most", low_open=True),
    # distill (`tensorturn distill`, `run --merge distill`)
    "temperature": Bound(0.0, 100.0, low_open=True),
    "alpha": Bound(0.0, 1.0),
    "top_k": Bound(1, 4096, "the teacher's targets are stored for every row"),
    "mixup": Bound(0, 64, "the mixed rows are held in memory"),
    # the command: processes on this machine, and how long it waits
    "local_workers": Bound(1, 64, "each is an agent process on this machine"),
    "timeout": Bound(0.0, YEAR_S, "a year at most", low_open=True),
}
# What a whole run may add up to, over its options together (ModeOptions.workload)
MAX_TASKS = 100_000            # tasks over a run's life: each leaves records on the broker
MAX_QUEUED = 10_000            # task messages on the broker at once
MAX_MINIBATCHES = 10_000_000   # minibatches one shard or member trains (× --accumulate)


def check_bounds(values: dict[str, Any]) -> None:
    """SpecError for the first value outside its bound in :data:`LIMITS` (keys are field names)."""
    for name, value in values.items():
        LIMITS[name].check(name, value)


@dataclass(frozen=True)
class Workload:
    """What a run's options add up to: (count, the flags whose product it is) for its tasks
    over its life, the task messages queued at once, and the optimizer steps one shard or
    member trains."""

    tasks: tuple[int, str]
    queued: tuple[int, str]
    steps: tuple[int, str]

    def check(self, accumulate: int) -> None:
        """SpecError when the run as a whole is more than a pool can hold or finish."""
        (tasks, tasks_by), (queued, queued_by), (steps, steps_by) = self.tasks, self.queued, self.steps
        if tasks > MAX_TASKS:
            raise SpecError(f"{tasks_by} is {tasks:,} tasks; a run has at most {MAX_TASKS:,} "
                            f"(each leaves records on the broker)")
        if queued > MAX_QUEUED:
            raise SpecError(f"{queued_by} queues {queued:,} tasks at once; a run queues at most "
                            f"{MAX_QUEUED:,} (each is a message on the broker)")
        if steps * accumulate > MAX_MINIBATCHES:
            by = steps_by + (" × --accumulate" if accumulate > 1 else "")
            raise SpecError(f"{by} is {steps * accumulate:,} minibatches for each model; a run "
                            f"trains at most {MAX_MINIBATCHES:,}")


@dataclass
class ModeOptions:
    """Base of a mode's own options (a dataclass per mode, in ``tensorturn.modes.<mode>``).

    ``HELP`` is a small table, one option a line: the field's name, then its help. Every field in
    it becomes a ``tensorturn run`` flag (``sync_every`` → ``--sync-every``) with that help and
    the field's default; ``CHOICES`` limits a flag to some values. Fields not in ``HELP`` are
    derived when the run starts, never given by the user.
    """

    HELP: ClassVar[str] = ""
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}

    def validate(self) -> None:
        """Raise SpecError with a one-line reason for the first invalid option (subclasses
        check their own rules after these)."""
        defaults = {f.name: f.default for f in fields(self)}
        for name, allowed in self.CHOICES.items():
            value = getattr(self, name)
            if value is None and defaults.get(name) is None:  # left out: another option decides
                continue
            if value not in allowed:
                raise SpecError(f"{flag(name)} {value!r} is not one of {', '.join(allowed)}")

    def workload(self) -> Workload:
        """What these options add up to (:class:`Workload`); an option left to the run's start
        counts at the most it can be set to, or is checked again once set."""
        raise NotImplementedError

    @classmethod
    def flags(cls) -> list[tuple[str, str]]:
        """(field, help) of every option a user can give, in the order of ``HELP``."""
        rows = [line.split(maxsplit=1) for line in cls.HELP.strip().splitlines()]
        return [(name, text) for name, text in rows]


OptionsT = TypeVar("OptionsT", bound=ModeOptions)


@dataclass(slots=True)  # a misspelt attribute is an error, not a silent new field
class RunSpec:
    """Everything that determines a run's result. Stored at ``runs/<id>/spec.json``."""

    mode: str
    recipe: str
    store_url: str
    options: ModeOptions
    run_id: str = ""
    recipe_options: dict[str, Any] = field(default_factory=dict)
    # what the recipe's raw_data learned from the training data, set on every instance before any
    # hook (recipes/learned.py): filled when the run starts, signed with the spec
    recipe_state: dict[str, Any] = field(default_factory=dict)
    # the pushed-dataset indexes the recipe read when the run started (store key → sha256 of the
    # index's bytes), signed with the spec: every machine's recipe reads those bytes or fails
    # (tensorturn.data.source.pinned). None: a run started before runs pinned them
    datasets: dict[str, str] | None = None
    seed: int = 0
    # inner training (None: the recipe's default)
    lr: float | None = None
    batch_size: int | None = None
    threads_per_task: int = 1
    max_attempts: int = 3
    # evaluate on at most this many forward passes (0: the whole split; None: the mode's default —
    # fused: what a shard trains in a round, modes.fused.options.eval_passes; ensemble: all)
    eval_batches: int | None = None
    precision: str = "auto"          # auto (bf16 on CUDA, fp32 elsewhere), fp32, bf16, fp16
    accumulate: int = 1              # minibatches per optimizer step (gradient accumulation)
    # derived when the run starts: bytes one task needs on a machine (capacity.estimate)
    memory_needed_bytes: int | None = None
    created_at: float = 0.0
    # the settings `tensorturn run` (or Pool.run) resolved from its flags and run file, as
    # `--print-config` prints them: kept so that `status` shows exactly what ran (not read by a task)
    run_config: dict[str, Any] | None = None

    def settle_run_config(self, recipe: Any) -> None:
        """The kept settings (``run_config``) completed with what the run decided at its start —
        the ``lr`` and ``batch_size`` of ``recipe`` where none was given, the options the recipe
        pinned (the dataset version it found) and the mode's options the pool sized (an
        ensemble's ``members``) — so that a run from them is this run again."""
        if self.run_config is None:
            return
        settled = dict(self.run_config)
        settled["lr"] = self.lr or recipe.lr
        settled["batch_size"] = self.batch_for(recipe)
        options = asdict(self.options)
        for name, _ in type(self.options).flags():
            if settled.get(name) is None and options.get(name) is not None:
                settled[name] = options[name]
        if self.recipe_options:
            settled["recipe_options"] = {**(settled.get("recipe_options") or {}), **self.recipe_options}
        self.run_config = settled

    def batch_for(self, recipe: Any) -> int:
        """The inner batch of this run with ``recipe``: the run's ``--batch-size``, else the recipe's
        (one place for a fact the memory check, the shards, the backups and the members all use)."""
        return self.batch_size or recipe.batch_size

    def __post_init__(self) -> None:
        if not self.run_id:
            self.run_id = new_run_id()
        if not self.created_at:
            self.created_at = time.time()

    @classmethod
    def create(cls, mode: str, recipe: str, store_url: str, **values: Any) -> "RunSpec":
        """A spec from flat options, as the CLI and tests give them: the common ones go to the
        spec, the mode's own to its options; an option of another mode is a SpecError."""
        if mode not in mode_names():
            raise SpecError(f"unknown mode {mode!r}: choose {' or '.join(mode_names())}")
        options_cls = get_mode(mode).Options
        own = {f.name for f in fields(options_cls)}
        common = {f.name for f in fields(cls)} - {"mode", "recipe", "store_url", "options"}
        spec_values, option_values = {}, {}
        for name, value in values.items():
            if name in own:
                option_values[name] = value
            elif name in common:
                spec_values[name] = value
            else:
                owner = option_owner(name)
                if owner:
                    raise SpecError(f"{flag(name)} is an option of --mode {owner}; "
                                    f"it does not apply to --mode {mode}")
                raise SpecError(f"unknown option {name!r}")
        return cls(mode=mode, recipe=recipe, store_url=store_url,
                   options=options_cls(**option_values), **spec_values)

    def validate(self) -> "RunSpec":
        """Raise SpecError with a one-line reason for the first invalid option."""
        if self.mode not in mode_names():
            raise SpecError(f"unknown mode {self.mode!r}: choose {' or '.join(mode_names())}")
        if not isinstance(self.options, get_mode(self.mode).Options):
            raise SpecError(f"the options of a {self.mode} run are {type(self.options).__name__}")
        if not self.recipe or not isinstance(self.recipe, str):
            raise SpecError("--recipe is required")
        check_bounds({"threads_per_task": self.threads_per_task, "max_attempts": self.max_attempts,
                      "batch_size": self.batch_size, "eval_batches": self.eval_batches,
                      "accumulate": self.accumulate, "seed": self.seed, "lr": self.lr})
        if self.precision not in PRECISIONS:
            raise SpecError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        self.options.validate()
        self.options.workload().check(self.accumulate)
        return self

    def opts(self, kind: type[OptionsT]) -> OptionsT:
        """The mode options, typed: ``spec.opts(FusedOptions).rounds``."""
        if not isinstance(self.options, kind):
            raise SpecError(f"run {self.run_id} is a {self.mode} run, not {kind.__name__}")
        return self.options

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["options"] = asdict(self.options)
        return doc

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RunSpec":
        """The spec from its JSON; a flat spec (written before modes had their own options)
        is read too, keeping only its mode's options."""
        options_cls = get_mode(data["mode"]).Options
        own = {f.name for f in fields(options_cls)}
        raw_options = data.get("options")
        if not isinstance(raw_options, dict):
            raw_options = {k: v for k, v in data.items() if k in own}
        common = {f.name for f in fields(cls)} - {"options"}
        return cls(options=options_cls(**{k: v for k, v in raw_options.items() if k in own}),
                   **{k: v for k, v in data.items() if k in common})


def options_json(spec_doc: dict[str, Any]) -> dict[str, Any]:
    """The mode options of a spec's JSON, whether nested (``options``) or flat (older runs)."""
    nested = spec_doc.get("options")
    return nested if isinstance(nested, dict) else spec_doc
