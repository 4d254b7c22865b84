"""A module an agent allows whole (``mixed_recipe:*``) that holds more than its recipe: a function
it imported, a factory, a class that is no recipe, an instance. Only ``Small`` may be built from a
spec; calling anything else leaves a mark at ``TT_CALLED_MARKER`` (``copyfile`` leaves its copy)."""

from __future__ import annotations

import os
from pathlib import Path
from shutil import copyfile  # noqa: F401 - what a signed spec named in the attack

from tensorturn.recipes.digits import DigitsMLP


def _mark(what: str) -> None:
    Path(os.environ["TT_CALLED_MARKER"]).write_text(what)


class Small(DigitsMLP):
    name = "small"


def factory(**options):
    _mark("factory")
    return Small(**options)


class NotARecipe:
    def __init__(self, **options):
        _mark("NotARecipe")


instance = Small()
