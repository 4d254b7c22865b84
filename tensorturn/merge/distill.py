"""Distillation as a run: its defaults, its checks, and the fused run of the ``distill`` recipe
(:mod:`tensorturn.merge.student`) that trains a student against a finished ensemble's vote —
what ``tensorturn distill RUN`` and ``run --merge distill`` start, and tests and benchmarks build.

The one place for them: the recipe takes its defaults from here, and every range is
:data:`tensorturn.spec.LIMITS`' (``--help`` shows them). Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

from tensorturn.errors import SpecError
from tensorturn.spec import MemberState, RunSpec, check_bounds

TEMPERATURE, ALPHA, TOP_K, MIXUP = 2.0, 0.5, 16, 0
# the fused run's defaults for a student (FusedOptions' own suit training from scratch on
# many machines): about the ensemble's own training budget, in few long rounds
ROUNDS, SYNC_EVERY = 24, 100
# the tasks whose ensembles can be distilled: a regression ensemble's mean is its teacher already
DISTILLABLE = ("classification", "language_model")


def check_settings(temperature: Any, alpha: Any, top_k: Any, mixup: Any) -> None:
    """SpecError in one line unless T, α, top-k and the mixed rows are in their ranges."""
    check_bounds({"temperature": temperature, "alpha": alpha, "top_k": top_k, "mixup": mixup})


def parse_student(text: str | None) -> dict[str, Any]:
    """``--student``: a JSON object of model settings, or ``@path`` to a file holding one."""
    if text is None:
        return {}
    source = "--student"
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            text = path.read_text()
        except OSError as exc:
            raise SpecError(f"--student {text}: cannot read {path}: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise SpecError(f"--student {text}: {path} is not UTF-8 text (a JSON object of model "
                            f"settings)") from None
        source = f"--student file {path}"
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise SpecError(f"{source} is not JSON ({exc}); give an object such as '{{\"hidden\": [64]}}'") from None
    if not isinstance(value, dict):
        raise SpecError(f"{source} must be a JSON object of model settings (got {type(value).__name__})")
    return value


def plan(store: Any, teacher: str, student: dict[str, Any] | None, temperature: float,
         alpha: float, top_k: int, mixup: int = 0, allow: Collection[str] = ()) -> dict[str, Any]:
    """The ``distill`` recipe's options for ensemble run ``teacher``, checked before anything is
    queued: a finished ensemble (its signed manifest) of a classification or language-model
    recipe, T, α, top-k and ``mixup`` (mixed transfer rows per row, real-valued inputs only) in
    range, and a student that fits the data. One-line errors. ``allow``: recipe names the caller
    allows here besides the machine's allowlist (:func:`tensorturn.recipes.resolve`), such as
    the ensemble's."""
    from tensorturn.recipes import resolve
    from tensorturn.state.manifest import finished_ensemble

    check_settings(temperature, alpha, top_k, mixup)
    manifest = finished_ensemble(store, teacher, "distillation")
    spec = manifest["spec"]
    options = {"teacher": teacher, "recipe": spec["recipe"],
               "recipe_options": spec.get("recipe_options") or {}, "student": dict(student or {}),
               **({"recipe_state": spec["recipe_state"]} if spec.get("recipe_state") else {}),
               "temperature": float(temperature), "alpha": float(alpha), "top_k": top_k,
               "mixup": 0}
    recipe = resolve("distill", options, allow)
    if mixup and not recipe.sample_input().is_floating_point():
        raise SpecError(f"--mixup mixes real-valued inputs; recipe {spec['recipe']!r} takes "
                        f"{recipe.sample_input().dtype} inputs (token ids): use --mixup 0")
    options["mixup"] = mixup
    members = [m["config"]["model"] for m in manifest.get("members", []) if m.get("state") == MemberState.SUCCEEDED]
    recipe.check_student(members)  # type: ignore[attr-defined]
    return options


def distill_spec(teacher: str, store: str, run_id: str = "", student: dict[str, Any] | None = None,
                 temperature: float = TEMPERATURE, alpha: float = ALPHA, top_k: int = TOP_K,
                 mixup: int = MIXUP, allow: Collection[str] = (), **options: Any) -> RunSpec:
    """The fused run that distills ensemble ``teacher``: its recipe is ``distill`` over the
    ensemble's (checked now: a finished ensemble, a student that fits the data; ``allow``:
    recipe names the caller allows for these checks besides the machine's allowlist, such as
    the ensemble's). Fused options not given take the student's defaults (ROUNDS, SYNC_EVERY,
    and the shards any fused run gets: :func:`tensorturn.modes.fused.default_shards`)."""
    from tensorturn.modes.fused import default_shards
    from tensorturn.recipes import check_name, resolve
    from tensorturn.recipes.contract import check_contract
    from tensorturn.store.objects import open_store

    check_settings(temperature, alpha, top_k, mixup)
    recipe_options = plan(open_store(store), teacher, student, temperature, alpha, top_k, mixup, allow)
    recipe = resolve("distill", recipe_options, allow)
    check_contract(recipe_options["recipe"], recipe, "nothing was queued")  # the ensemble's, as it is now
    options = {k: v for k, v in options.items() if v is not None}
    options.setdefault("rounds", ROUNDS)
    # the command's choices, not the user's: the run warns about its shards' passes only for the user's
    options["chosen"] = [name for name in ("sync_every", "shards") if name not in options]
    options.setdefault("sync_every", SYNC_EVERY)
    if "shards" not in options:
        options["shards"] = default_shards(recipe.train_rows())
    spec = RunSpec.create("fused", "distill", store, recipe_options=recipe_options,
                          **({"run_id": run_id} if run_id else {}), **options)
    spec.validate()
    check_name(spec.recipe)
    return spec


def check_distillable(recipe: str, recipe_options: dict[str, Any]) -> None:
    """``run --merge distill``: refuse, before the ensemble trains, a recipe whose ensemble
    could not be distilled (its kind), building it here — the user named it on this command."""
    from tensorturn.recipes import resolve

    task = resolve(recipe, recipe_options, allow=[recipe]).task
    if task not in DISTILLABLE:
        raise SpecError(f"--merge distill: recipe {recipe!r} is a {task} recipe; distillation needs "
                        f"a classification or language-model ensemble (its vote is already the "
                        f"members' mean)")
