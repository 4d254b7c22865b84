"""Recipes: what to train. A recipe names the data, the model, the loss and the evaluation.

Built-in recipes are listed in :data:`BUILTIN`; any other recipe is given as ``package.module:attr``
and must be importable on every machine of the pool (a class, a factory, or an instance).
"""

from __future__ import annotations

import importlib

from ..errors import RecipeError
from .base import Recipe, Splits, load_splits
from .charlm import CharLM
from .digits import DigitsMLP

__all__ = ["Recipe", "Splits", "load_splits", "resolve", "BUILTIN"]

BUILTIN: dict[str, type[Recipe]] = {
    "digits-mlp": DigitsMLP,
    "charlm": CharLM,
}


def resolve(name: str, options: dict | None = None) -> Recipe:
    """The recipe called ``name`` (built-in, or ``module:attr``), built with ``options``."""
    options = options or {}
    if name in BUILTIN:
        target: object = BUILTIN[name]
    elif ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
            raise RecipeError(f"recipe {name!r} failed to import: {type(exc).__name__}: {exc}") from exc
        try:
            target = getattr(module, attr)
        except AttributeError:
            raise RecipeError(f"recipe {name!r}: module {module_name!r} has no attribute {attr!r}") from None
    else:
        known = ", ".join(sorted(BUILTIN))
        raise RecipeError(f"unknown recipe {name!r}: use one of {known} or package.module:attr")

    try:
        recipe = target(**options) if callable(target) else target
    except TypeError as exc:
        raise RecipeError(f"recipe {name!r} does not accept options {sorted(options)}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - a user recipe's own failure, shown in one line
        raise RecipeError(f"recipe {name!r} failed to build: {type(exc).__name__}: {exc}") from exc
    if not isinstance(recipe, Recipe):
        raise RecipeError(f"recipe {name!r} is a {type(recipe).__name__}, not a tensorturn Recipe")
    recipe.ref = name
    return recipe
