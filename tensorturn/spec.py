"""The run spec: the options every run has, plus one options object of its mode.

``runs/<id>/spec.json`` holds it; it decides the run's result. Derived facts (the memory a task
needs, θ_0's hash) are filled in when the run starts and stored with it. This module imports no
torch: the CLI validates a spec before anything heavy is loaded.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

from .errors import SpecError
from .modes.registry import get_mode, mode_names, option_owner

STATES = ("queued", "running", "succeeded", "failed", "cancelled")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")  # device.autocast's (this module imports no torch)
FINISHED = ("succeeded", "failed", "cancelled")  # no task of such a run starts


def flag(name: str) -> str:
    """The command-line flag of an option field: ``sync_every`` → ``--sync-every``."""
    return "--" + name.replace("_", "-")


def new_run_id() -> str:
    """A fresh run id: when, then 6 random hex digits (``20261203-194501-3fa9c2``)."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def check_positive(values: dict[str, Any]) -> None:
    """SpecError for the first value that is not a whole number ≥ 1 (keys are field names)."""
    for name, value in values.items():
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise SpecError(f"{flag(name)} must be a whole number ≥ 1 (got {value})")


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
        for name, allowed in self.CHOICES.items():
            value = getattr(self, name)
            if value not in allowed:
                raise SpecError(f"{flag(name)} {value!r} is not one of {', '.join(allowed)}")

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
    seed: int = 0
    # inner training (None: the recipe's default)
    lr: float | None = None
    batch_size: int | None = None
    threads_per_task: int = 1
    max_attempts: int = 3
    eval_batches: int | None = None  # evaluate on at most this many forward passes (None: all)
    precision: str = "auto"          # auto (bf16 on CUDA, fp32 elsewhere), fp32, bf16, fp16
    accumulate: int = 1              # minibatches per optimizer step (gradient accumulation)
    # derived when the run starts: bytes one task needs on a machine (capacity.estimate)
    memory_needed_bytes: int | None = None
    created_at: float = 0.0

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
        check_positive({"threads_per_task": self.threads_per_task,
                        "max_attempts": self.max_attempts, "batch_size": self.batch_size,
                        "eval_batches": self.eval_batches, "accumulate": self.accumulate})
        if self.precision not in PRECISIONS:
            raise SpecError(f"--precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.lr is not None and not (0 < self.lr < 10):
            raise SpecError(f"--lr must be in (0, 10) (got {self.lr})")
        self.options.validate()
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
