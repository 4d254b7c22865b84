"""The documentation a user reads: the README is a first page (short, its links resolve, its test
command the one CI runs), and the lists the docs site generates from the code come out whole."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from tensorturn import config, registry

ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def hooks():
    """docs/hooks.py, the MkDocs hook that generates the lists (it needs no MkDocs to render)."""
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_a_first_page_of_at_most_300_lines():
    assert len(README.read_text().splitlines()) <= 300


def test_every_relative_link_in_the_readme_points_at_a_file_that_exists():
    targets = [t for t in LINK.findall(README.read_text()) if not re.match(r"[a-z]+:|#", t)]
    assert targets, "the README links to the docs"
    missing = [t for t in targets if not (ROOT / t.split("#", 1)[0]).exists()]
    assert not missing


def test_ci_runs_the_readme_test_command_verbatim():
    commands = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    test_command = next(c.strip() for c in commands if "pytest" in c)
    assert test_command in (ROOT / ".ci" / "run").read_text().splitlines()


def test_every_list_a_page_asks_for_is_generated():
    generate = hooks()
    asked = {m for page in (ROOT / "docs").rglob("*.md") for m in generate.MARKER.findall(page.read_text())}
    assert {"settings", "policies", "codecs", "modules", "keys", "commands"} <= asked <= set(generate.LISTS)
    with pytest.raises(LookupError, match="'nonesuch'"):
        generate.render("<!-- generated: nonesuch -->")


def test_the_generated_lists_hold_what_the_code_holds():
    generate = hooks()
    assert "<!-- generated: settings -->" in (ROOT / "docs" / "configuration.md").read_text()
    assert generate.render("<!-- generated: settings -->") == config.markdown_table()
    synced = generate.render("<!-- generated: policies -->")
    assert all(f"| `{name}` |" in synced for name in generate.policy_registry())
    modes = generate.render("<!-- generated: modes -->")
    assert all(f"| `{name}` |" in modes for name in registry.REGISTRY)
    modules = generate.render("<!-- generated: modules -->")
    for path in (ROOT / "tensorturn").rglob("*.py"):
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        assert f"| `{dotted}` |" in modules
    codecs = generate.render("<!-- generated: codecs -->")
    assert all(f"| `{codec}` |" in codecs for codec in ("fp32", "int8", "ternary"))
    assert "runs/<id>/spec.json" in generate.render("<!-- generated: keys -->")
    assert "### `tensorturn run`" in generate.render("<!-- generated: commands -->")


def test_every_test_the_docs_cite_exists():
    """The trust model's every "cannot" names the test that makes the attack; a renamed or moved
    test must take its citation along (a module is found under any folder of tests/)."""
    pages = "\n".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    cited = set(re.findall(r"`(test_[a-z0-9_]+)(?:::(test_[a-z0-9_]+)…?)?`", pages))
    cited |= {(Path(path).stem, "") for path in re.findall(r"`tests/([a-z0-9_/]+\.py)", pages)}
    modules = {p.stem: p.read_text() for p in (ROOT / "tests").rglob("*.py")}
    cited -= {(metric, "") for metric in ("test_accuracy", "test_loss", "test_mae", "test_rows")}  # JSON fields
    assert len(cited) > 20
    missing = [f"{module}::{test}" if test else module for module, test in sorted(cited)
               if module not in modules or (test and f"def {test}" not in modules[module])]
    assert not missing
