"""Recipes: what to train. A recipe names the data, the model, the loss and the evaluation.

Built-in recipes are listed in :data:`BUILTIN` (by name; imported only when used); any other
recipe is given as ``package.module:Class``, a subclass of :class:`Recipe` that must be importable
on every machine of the pool and allowed there (``--allow-recipe``; see :mod:`tensorturn.trust`):
:func:`resolve` imports nothing a machine has not allowed, and calls nothing but a Recipe class
(a signed spec's options go to that constructor, never to another callable the module holds).

Where a recipe's module comes from: ``PYTHONPATH`` and installed packages. Agents, embedded ones
included, start without the current directory on ``sys.path`` (``python -P``), so a file there
never shadows a module; :data:`WHERE_RECIPES_COME_FROM` says so in errors.
:func:`check_name` needs no torch, for the CLI.
"""

from __future__ import annotations

import glob
import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import sys
from collections.abc import Collection
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from tensorturn.errors import RecipeError, TensorTurnError

if TYPE_CHECKING:
    from tensorturn.recipes.base import Recipe, Splits
    from tensorturn.spec import RunSpec

__all__ = ["Recipe", "Splits", "load_splits", "resolve", "recipe_of", "recipe_for", "check_name", "BUILTIN"]

BUILTIN: dict[str, str] = {
    "digits-mlp": "tensorturn.recipes.digits:DigitsMLP",
    "charlm": "tensorturn.recipes.charlm:CharLM",
    "tabular": "tensorturn.recipes.tabular:Tabular",
    "textlm": "tensorturn.recipes.textlm:TextLM",
    "gpt2-small": "tensorturn.recipes.gpt2:GPT2Small",
    "image-folder": "tensorturn.recipes.imagefolder:ImageFolder",
    # a student trained against a finished ensemble's vote (`tensorturn distill`)
    "distill": "tensorturn.merge.student:Distilled",
}

# said where a recipe's module is not found: agents never look in their current directory
WHERE_RECIPES_COME_FROM = ("recipes are imported from PYTHONPATH and installed packages, not the "
                           "current directory")


def __getattr__(name: str) -> Any:  # Recipe, Splits, load_splits without importing torch early
    if name in ("Recipe", "Splits", "load_splits"):
        from tensorturn.recipes import base

        return getattr(base, name)
    raise AttributeError(name)


def check_name(name: str) -> None:
    """RecipeError unless ``name`` is a built-in or names a module that exists here; imports
    nothing (the recipe itself is imported where it runs)."""
    from tensorturn.trust import recipe_parts

    if name in BUILTIN:
        return
    if recipe_parts(name) is None:
        known = ", ".join(sorted(n for n in BUILTIN if n != "distill"))  # (`tensorturn distill` names it)
        raise RecipeError(f"unknown recipe {name!r}: use one of {known} or package.module:Class")
    module_name = name.partition(":")[0]
    try:
        found = find_module(module_name)
    except (ImportError, ValueError) as exc:
        raise RecipeError(f"recipe {name!r} failed to import: {type(exc).__name__}: {exc}") from None
    if found is None:
        raise RecipeError(f"recipe {name!r} failed to import: ModuleNotFoundError: "
                          f"No module named {module_name!r} ({WHERE_RECIPES_COME_FROM})")


def find_module(dotted: str) -> importlib.machinery.ModuleSpec | None:
    """Where module ``dotted`` would be imported from, importing nothing — not even its parent
    packages, whose ``__init__`` is code (:func:`importlib.util.find_spec` imports them): each
    part is looked for in its parent's folders, as the import system would."""
    parts = dotted.split(".")
    found = importlib.util.find_spec(parts[0])  # (a top-level name: its finders only)
    for i in range(1, len(parts)):
        if found is None or found.submodule_search_locations is None:  # not a package
            return None
        name = ".".join(parts[:i + 1])
        loaded = sys.modules.get(name)
        found = loaded.__spec__ if loaded is not None else importlib.machinery.PathFinder.find_spec(
            name, list(found.submodule_search_locations))
    return found


def resolve(name: str, options: dict | None = None, allow: Collection[str] = ()) -> "Recipe":
    """The recipe called ``name`` (built-in, or ``module:Class``), built with ``options``.

    Checked before each step: the name against the allowlist before the module is imported, and
    that ``Class`` is a Recipe subclass before it is called — what the module imported or defined
    besides (``shutil.copyfile``, a factory, an instance) is never called with a spec's options.

    ``allow``: recipe names allowed for this call besides the machine's allowlist — those the
    user named on this machine (a command line, a Python call), never a spec's: this process's
    settings stay as they are. A recipe that builds on another (``distill``) gets them too."""
    from tensorturn import config, trust
    from tensorturn.recipes.base import Recipe

    settings = trust.with_allowed(config.current(), [glob.escape(n) for n in allow]) if allow else None
    trust.check_recipe_allowed(name, BUILTIN, settings)  # before anything is imported: a recipe is code
    check_name(name)
    module_name, _, attr = BUILTIN.get(name, name).partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise RecipeError(f"recipe {name!r} failed to import: {type(exc).__name__}: {exc}"
                          f"{_where(exc, module_name)}") from exc
    target = getattr(module, attr, None)
    if target is None:
        raise RecipeError(f"recipe {name!r}: module {module_name!r} has no attribute {attr!r}")
    if not (isinstance(target, type) and issubclass(target, Recipe)):
        what = f"class {target.__name__}" if isinstance(target, type) else type(target).__name__
        raise RecipeError(f"recipe {name!r} is a {what}, not a tensorturn Recipe class "
                          f"(a recipe is a subclass of tensorturn.recipes.Recipe)")
    return _built(name, target, options or {}, tuple(allow))


def _where(exc: Exception, module_name: str) -> str:
    """Where recipes come from, when the recipe's own module (not one it imports) is not found."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if missing and f"{module_name}.".startswith(f"{missing}."):
        return f" ({WHERE_RECIPES_COME_FROM})"
    return ""


def required_options(cls: type, given: set[str]) -> list[str]:
    """The options ``cls(...)`` requires (no default) that are not in ``given``."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read: the call says what is wrong
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is p.empty and p.name not in given]


def _built(name: str, cls: "type[Recipe]", options: dict, allow: tuple[str, ...]) -> "Recipe":
    """``cls(**options)``; whatever goes wrong, one line naming the recipe. A class that builds
    on another recipe (``builds_on_recipe``) is given ``allow`` as well — always, so a spec's
    options can never hold their own ``allow`` (it would be a second value: refused)."""
    extra = {"allow": allow} if getattr(cls, "builds_on_recipe", False) else {}
    missing = required_options(cls, {*options, *extra})
    if missing:
        raise RecipeError(f"recipe {name!r} needs the option{'s' if len(missing) > 1 else ''} "
                          f"{', '.join(missing)}: pass "
                          + " ".join(f"--recipe-option {m}=VALUE" for m in missing)
                          + " (in a run file, [recipe_options]; in Python, recipe_options={...})")
    try:
        recipe = cls(**options, **extra)
    except TypeError as exc:
        raise RecipeError(f"recipe {name!r} does not accept options {sorted(options)}: {exc}") from exc
    except TensorTurnError as exc:  # the recipe said what is wrong (a dataset that is not there, ...)
        raise RecipeError(f"recipe {name!r}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a user recipe's own failure, shown in one line
        raise RecipeError(f"recipe {name!r} failed to build: {type(exc).__name__}: {exc}") from exc
    recipe.ref = name
    return recipe


def warm_up() -> None:
    """Import what a first task would: torch, every built-in recipe and what its data needs.
    An agent calls this before its pool forks, so no task pays for imports."""
    for path in BUILTIN.values():
        importlib.import_module(path.partition(":")[0])
    # digits-mlp's data; what torch loads for the memory check on the meta device
    for optional in ("sklearn.datasets", "sklearn.model_selection", "torch._dynamo"):
        try:
            importlib.import_module(optional)
        except ImportError:
            pass


def recipe_for(spec: "RunSpec", allow: Collection[str] = ()) -> "Recipe":
    """The run's recipe, built from its options with the run's learned state set on it
    (:mod:`tensorturn.recipes.learned`): what every hook of the run is called on."""
    return _built_with(spec.recipe, spec.recipe_options, spec.recipe_state, spec.datasets, allow)


def _built_with(name: str, options: dict, state: dict, datasets: Any, allow: Collection[str] = ()) -> "Recipe":
    from tensorturn.data.source import pinned
    from tensorturn.recipes.learned import restore

    with pinned(datasets):  # the dataset indexes it reads are those the run started with
        return restore(resolve(name, options, allow), state)


@lru_cache(maxsize=8)
def _cached(name: str, options_json: str, state_json: str, datasets_json: str) -> "Recipe":
    return _built_with(name, json.loads(options_json), json.loads(state_json), json.loads(datasets_json))


def recipe_of(spec: "RunSpec") -> "Recipe":
    """The run's recipe (:func:`recipe_for`), built once per process."""
    return _cached(spec.recipe, json.dumps(spec.recipe_options, sort_keys=True),
                   json.dumps(spec.recipe_state, sort_keys=True), json.dumps(spec.datasets, sort_keys=True))
