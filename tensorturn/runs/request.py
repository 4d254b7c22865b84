"""A run as a user asks for it: :class:`RunRequest`, made from ``tensorturn run``'s flags,
``Pool.run``'s keyword arguments or a run file (flags and keywords over it), and checked once,
when it is made. A :class:`~tensorturn.runs.launch.Launcher` starts it.

Nothing here imports torch, Celery or boto3: ``run --print-config`` and a bad option are
answered before anything heavy loads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tensorturn import runfile
from tensorturn.errors import SpecError
from tensorturn.spec import RunSpec, check_bounds


def validate(spec: RunSpec) -> None:
    """Everything about a spec that can be checked without torch, a broker or a store."""
    from tensorturn.recipes import check_name

    spec.validate()
    check_name(spec.recipe)


def check_merge(mode: str, merge: str) -> None:
    """SpecError unless ``merge`` fits a run of ``mode``: only an ensemble's members merge."""
    if merge != "none" and mode != "ensemble":
        raise SpecError(f"--merge {merge} merges an ensemble's members into one model: it needs "
                        f"--mode ensemble (a {mode} run is one model already)")


@dataclass(frozen=True)
class RunRequest:
    """One run to start, checked: what runs (``spec``, with no store or run id yet: the launch
    gives both) and how the command that asked for it runs it. Made by :meth:`of` only; a
    mistake there is the command's one-line SpecError (or RecipeError for a recipe name)."""

    spec: RunSpec                     # mode, recipe and its options, training, the mode's options
    merge: str = "none"               # "distill": then distill the ensemble into one model
    local_workers: int | None = None  # an embedded pool's agents, as given (None: LOCAL_WORKERS)
    timeout: float | None = None      # how long the command waits, as given (None: to the end)

    @classmethod
    def of(cls, options: Mapping[str, Any], config_file: str | Path | None = None) -> RunRequest:
        """The request of the run file ``config_file`` with ``options`` (flags or keyword
        arguments by field name; ``None``: not given) over it, every default filled in — checked
        here, once: kinds and names, every bound, the spec, the recipe's name, the merge."""
        file = runfile.read(config_file) if config_file else {}
        settings = runfile.combine(file, runfile.check(dict(options)))
        # how it runs, checked too: --print-config writes only what `run` takes
        check_bounds({"local_workers": settings.get("local_workers"), "timeout": settings.get("timeout")})
        values = {k: v for k, v in settings.items()
                  if k not in ("mode", "recipe", "recipe_options", *runfile.LAUNCH)}
        spec = RunSpec.create(settings["mode"], settings.get("recipe", ""), "",
                              recipe_options=dict(settings.get("recipe_options") or {}), **values)
        validate(spec)  # before anything starts or anything heavy is imported
        check_merge(spec.mode, settings["merge"])
        return cls(spec, settings["merge"], settings.get("local_workers"), settings.get("timeout"))

    @property
    def settings(self) -> dict[str, Any]:
        """Every setting as a run file holds it (:func:`tensorturn.runfile.resolved`): what
        ``--print-config`` prints."""
        return runfile.resolved(self.spec, {"merge": self.merge, "local_workers": self.local_workers,
                                            "timeout": self.timeout})

    @property
    def training(self) -> dict[str, Any]:
        """The training settings a distillation after the run (``merge="distill"``) takes too."""
        return {k: getattr(self.spec, k) for k in runfile.TRAINING}

    def spec_for(self, store_url: str, pool_size: int | None) -> RunSpec:
        """The spec of one run of this request, storing to ``store_url``, with a fresh run id;
        it keeps the settings (``run_config``) so that ``status`` shows what ran — with the size
        of the embedded pool it runs on (``pool_size``), none on a standing pool."""
        settings = {k: v for k, v in self.settings.items() if k != "local_workers"}
        if pool_size is not None:
            settings = runfile.ordered({**settings, "local_workers": pool_size})
        # a copy: starting a run fills in its spec (the recipe's pinned options, the pool's sizes)
        spec = RunSpec.from_json({**self.spec.to_json(), "store_url": store_url, "run_id": "",
                                  "created_at": 0.0})
        spec.run_config = settings
        return spec
