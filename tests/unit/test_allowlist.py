"""The recipe allowlist: which names a machine imports (decided on the name alone, before any
import) and what it then calls (a Recipe class, nothing else the module holds)."""

from __future__ import annotations

import pytest

from tensorturn import config, trust
from tensorturn.errors import RecipeError
from tensorturn.recipes import BUILTIN, resolve
from tensorturn.trust import UntrustedError

# pattern, recipe name, allowed: the module and the attribute are matched apart, and a `*`
# stays within one dotted part of the module (a `**` part spans any number, none included)
RULES = [
    ("mymod:*", "mymod:Net", True),
    ("mymod:*", "mymod.sub:Net", False),
    ("mymod:*", "mymodule:Net", False),
    ("mymod:Net*", "mymod:NetV2", True),
    ("mymod:Net", "mymod:Netter", False),
    ("*.recipes:*", "team.recipes:Net", True),
    ("*.recipes:*", "evil_recipe:x.recipes:y", False),    # the attack: `*` crossed the colon
    ("*.recipes:*", "a.b.recipes:Net", False),
    ("team.recipes.*:*", "team.recipes.vision:Net", True),
    ("team.recipes.*:*", "team.recipes:Net", False),
    ("team.recipes.*:*", "team.recipes.vision.cnn:Net", False),
    ("myproject.*:*", "myproject.recipes:Net", True),     # the README's pattern
    ("myproject.*:*", "myproject.a.b:Net", False),
    ("team.**:*", "team:Net", True),
    ("team.**:*", "team.recipes.vision.cnn:Net", True),
    ("team.**:*", "teams.recipes:Net", False),
    ("team.**.cnn:*", "team.a.b.cnn:Net", True),
    ("team.**.cnn:*", "team.cnn:Net", True),
    ("*:*", "wine_recipe:Wine", True),
    ("*:*", "pkg.wine:Wine", False),
    ("evil_*:*", "evil_recipe:Evil", True),               # tests/test_trust.py's pattern
    ("wine_recipe:[!W]*", "wine_recipe:Wine", False),
    ("pkg.*", "pkg.mod:Net", False),                      # no colon: allows nothing
    ("mymod:*", "mymod:a.b", False),                      # names of any other shape: never
    ("mymod:*", "mymod:", False),
    ("mymod:*", "mymod:*", False),
    ("*:*", ":Net", False),
    ("*.*:*", "a..b:Net", False),
    ("**:*", "os:system ", False),
]


def test_patterns_match_the_module_and_the_attribute_apart_by_dotted_parts():
    for pattern, name, allowed in RULES:
        settings = config.current().with_(allow_recipes=pattern)
        try:
            trust.check_recipe_allowed(name, BUILTIN, settings)
            got = True
        except UntrustedError:
            got = False
        assert got is allowed, (pattern, name)


def test_a_star_never_crosses_the_colon_into_an_import(tmp_path, monkeypatch):
    """The attack: `*.recipes:*` allowed `evil_recipe:x.recipes:y`, and `evil_recipe` ran."""
    marker = tmp_path / "evil-imported"
    monkeypatch.setenv("TT_EVIL_MARKER", str(marker))
    config.use(trust.with_allowed(config.current(), ["*.recipes:*"]))
    for name in ("evil_recipe:x.recipes:y", "evil_recipe:x.recipes"):
        with pytest.raises(UntrustedError, match="not allowed on this machine"):
            resolve(name)
    assert not marker.exists()


def test_only_a_recipe_class_of_an_allowed_module_is_called(tmp_path, monkeypatch):
    """The attack: with `mixed_recipe:*` allowed, a signed spec named `copyfile` and its options
    copied a file on the agent before the refusal. Nothing but a Recipe class is called."""
    marker = tmp_path / "called"
    monkeypatch.setenv("TT_CALLED_MARKER", str(marker))
    config.use(trust.with_allowed(config.current(), ["mixed_recipe:*"]))
    secret, copy = tmp_path / "secret", tmp_path / "copied"
    secret.write_text("not for strangers")
    with pytest.raises(RecipeError, match="is a function, not a tensorturn Recipe class"):
        resolve("mixed_recipe:copyfile", {"src": str(secret), "dst": str(copy)})
    assert not copy.exists()
    with pytest.raises(RecipeError, match="is a function, not a tensorturn Recipe class"):
        resolve("mixed_recipe:factory")
    with pytest.raises(RecipeError, match="is a class NotARecipe, not a tensorturn Recipe class"):
        resolve("mixed_recipe:NotARecipe")
    with pytest.raises(RecipeError, match="is a Small, not a tensorturn Recipe class"):
        resolve("mixed_recipe:instance")  # a built recipe: what its constructor was given is unknown
    assert not marker.exists()
    assert resolve("mixed_recipe:Small").ref == "mixed_recipe:Small"
