"""MkDocs hooks: the lists that drift, generated from the code when the site is built.

A page asks for a list with a line of its own, ``<!-- generated: NAME -->``; :func:`render`
replaces it with what the code says now, so the site cannot disagree with the code it documents:

- ``settings``: every ``TENSORTURN_*`` variable (``tensorturn.config.VARIABLES``);
- ``policies``: every ``--sync`` value and its class's docstring (the sync policy registry);
- ``codecs``: every ``--codec`` and what it costs, measured by encoding a tensor with it;
- ``modes``: the mode registry; ``recipes``: the built-in recipes;
- ``layers``: the import contract's layers, top to bottom (``pyproject.toml``);
- ``modules``: every module of the package and the first paragraph of its docstring;
- ``keys``: the store and Redis layout, from ``tensorturn.layout``'s docstring;
- ``commands``: every command's ``--help``.

Docstrings are read with :mod:`ast` where that is enough (nothing imported, no torch); the
registries and the command are imported. A name a page asks for that is not here, or a registry
that moved, fails the build (``mkdocs build --strict``) naming it. It also copies the benchmark
results (``benchmarks/results/``) into the site, so the benchmark pages show their figures: a page
links them as the repository has them (``../../benchmarks/results/x.png``), and GitHub shows them too.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "tensorturn"
RESULTS = ROOT / "benchmarks" / "results"
MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)


# ---- docstrings -------------------------------------------------------------------------------

def _plain(text: str) -> str:
    """reST's inline markup as Markdown: ``x`` → `x`, :role:`~a.b.c` → `c`, :role:`a.b` → `a.b`."""
    def role(match: re.Match) -> str:
        tilde, target = match.groups()
        return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"

    text = re.sub(r":[a-z]+:`(~?)([^`]+)`", role, text)
    return text.replace("``", "`")


def _first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    paragraph = doc.strip().split("\n\n", 1)[0]
    return _plain(" ".join(paragraph.split())).replace("|", "\\|")


def _module_doc(path: Path) -> str | None:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))


def _class_doc(ref: str) -> str | None:
    """The docstring of ``module:Class`` read from its source, without importing it."""
    module, _, name = ref.partition(":")
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise LookupError(f"{ref}: no module {module}")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return ast.get_docstring(node) or ast.get_docstring(tree)  # else its module's
    raise LookupError(f"{ref}: no class {name} in {module}")


def _doc_of(value: Any) -> str | None:
    """A registry entry's docstring: a ``"module:Class"`` string, or the class itself."""
    if isinstance(value, str):
        return _class_doc(value) if ":" in value else _module_doc(Path(importlib.util.find_spec(value).origin))
    return inspect.getdoc(value)


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ---- the lists ----------------------------------------------------------------------------------

def settings() -> str:
    from tensorturn import config

    return config.markdown_table()


# where the ``--sync`` registry (``POLICIES``: name → class, or "module:Class") may live
POLICY_REGISTRIES = ("tensorturn.modes.fused.policies", "tensorturn.modes.fused.sync", "tensorturn.modes.fused")


def policy_registry() -> dict[str, Any]:
    for module in POLICY_REGISTRIES:
        try:
            found = getattr(importlib.import_module(module), "POLICIES", None)
        except ImportError:
            continue
        if isinstance(found, dict) and found:
            return found
    raise LookupError(f"no POLICIES registry in {', '.join(POLICY_REGISTRIES)}: "
                      "name its module in docs/hooks.py's POLICY_REGISTRIES")


def policies() -> str:
    rows = [(f"`{name}`", _first_paragraph(_doc_of(value))) for name, value in policy_registry().items()]
    return _table(("`--sync`", "what the policy does (its class's docstring)"), rows)


def codecs() -> str:
    import torch

    from tensorturn.store import tensors

    values = torch.randn(1 << 14, generator=torch.Generator().manual_seed(0))
    rows = []
    for codec in tensors.CODECS:
        parts = tensors.encode_tensor("w", values, codec)
        per_value = sum(t.numel() * t.element_size() for t in parts.values()) / values.numel()
        rows.append((f"`{codec}`", f"{per_value:.3f}", f"{4 / per_value:.1f}×"))
    return _table(("codec", "bytes per value", "fewer bytes than fp32"), rows)


def plan() -> str:
    from tensorturn.modes.fused import plan as model

    names = ("TARGET_UTILISATION", "MAX_PLANNED_SYNC_EVERY", "SMALL_COMM", "ROUND_TRIPS_PER_TASK",
             "TASK_OVERHEAD_S", "FIXED_ROUND_S", "OUTER_S_PER_UNIT", "LOOPBACK_BPS", "LOOPBACK_RTT_S",
             "BESIDE_STORE_BPS", "SPEED_SPREAD", "WORTH_H", "WORTH_EXPONENT")
    rows = [(f"`{name}`", f"{getattr(model, name):g}") for name in names]
    rows += [(f"outer step units a value: `{codec}` read, broadcast",
              f"{model.READ_UNITS[codec]:g}, {model.BROADCAST_UNITS[codec]:g}") for codec in model.READ_UNITS]
    rows += [(f"`{codec}` bytes per value", f"{size:.4f}") for codec, size in model.BYTES_PER_VALUE.items()]
    return _table(("the plan's figure (tensorturn/modes/fused/plan.py)", "value"), rows)


def modes() -> str:
    from tensorturn import registry

    rows = [(f"`{name}`", _first_paragraph(_doc_of(package))) for name, package in registry.REGISTRY.items()]
    return _table(("`--mode`", "what it does (its package's docstring)"), rows)


def recipes() -> str:
    from tensorturn import recipes as registry

    rows = [(f"`{name}`", _first_paragraph(_doc_of(ref))) for name, ref in registry.BUILTIN.items()]
    return _table(("`--recipe`", "what it trains (its docstring)"), rows)


def layers() -> str:
    """The import contract's layers (``pyproject.toml``), top to bottom, each part with the first
    paragraph of its docstring."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layered = next(c for c in contracts if c["type"] == "layers")
    rows = []
    for n, layer in enumerate(layered["layers"], 1):
        for part in (p.strip() for p in layer.split("|")):
            path = PACKAGE / part / "__init__.py" if (PACKAGE / part).is_dir() else PACKAGE / f"{part}.py"
            rows.append((str(n), f"`tensorturn.{part}`", _first_paragraph(_module_doc(path)) or "—"))
    return _table(("layer", "package or module", "what it is for (its docstring)"), rows)


def modules() -> str:
    """One table per package, in the order the folders sit; a package's own docstring first."""
    out = []
    for folder in sorted({p.parent for p in PACKAGE.rglob("*.py")}):
        files = sorted(folder.glob("*.py"), key=lambda p: (p.name != "__init__.py", p.name))
        dotted = ".".join(folder.relative_to(ROOT).parts)
        rows = []
        for path in files:
            name = dotted if path.name == "__init__.py" else f"{dotted}.{path.stem}"
            rows.append((f"`{name}`", _first_paragraph(_module_doc(path)) or "—"))
        out.append(f"### `{dotted}`\n\n" + _table(("module", "what it is for (its docstring)"), rows))
    return "\n\n".join(out)


def keys() -> str:
    """``tensorturn.layout``'s docstring, its literal blocks as code."""
    doc = _module_doc(PACKAGE / "layout.py") or ""
    body = doc.split("\n\n", 1)[1] if "\n\n" in doc else doc
    out: list[str] = []
    code: list[str] | None = None  # the literal block a "heading::" paragraph opened
    for paragraph in body.split("\n\n"):
        if code is not None and paragraph.startswith(" "):
            code.append(paragraph)
            continue
        if code is not None:
            out[-1] += "\n\n```text\n" + textwrap.dedent("\n\n".join(code)).strip("\n") + "\n```"
            code = None
        if paragraph.rstrip().endswith("::"):
            out.append(_plain(" ".join(paragraph.split())[:-1]))
            code = []
        elif paragraph.strip():
            out.append(_plain(" ".join(paragraph.split())))
    if code:
        out[-1] += "\n\n```text\n" + textwrap.dedent("\n\n".join(code)).strip("\n") + "\n```"
    return "\n\n".join(out)


def commands() -> str:
    import click

    from tensorturn import cli as package

    groups = [v for v in vars(package).values() if isinstance(v, click.Group)]
    main = getattr(package, "cli", None) if isinstance(getattr(package, "cli", None), click.Group) else groups[0]
    out = []

    def walk(command: click.Command, path: list[str]) -> None:
        ctx = click.Context(command, info_name=" ".join(path), terminal_width=100, max_content_width=100)
        if len(path) > 1 and not getattr(command, "hidden", False):
            out.append(f"### `{' '.join(path)}`\n\n```text\n{command.get_help(ctx)}\n```")
        if isinstance(command, click.Group):
            for name in sorted(command.list_commands(ctx)):
                sub = command.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    walk(sub, path + [name])

    walk(main, ["tensorturn"])
    return "\n\n".join(out)


LISTS: dict[str, Callable[[], str]] = {
    "settings": settings, "policies": policies, "codecs": codecs, "plan": plan, "modes": modes, "recipes": recipes,
    "layers": layers, "modules": modules, "keys": keys, "commands": commands,
}


def render(markdown: str) -> str:
    """``markdown`` with each ``<!-- generated: NAME -->`` line replaced by the list NAME."""
    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in LISTS:
            raise LookupError(f"a page asks for the generated list {name!r}; docs/hooks.py has "
                              f"{', '.join(LISTS)}")
        try:
            return LISTS[name]()
        except Exception as e:  # a registry moved or changed shape: say which list, and why
            raise RuntimeError(f"docs/hooks.py could not generate {name!r} from the code: {e!r}") from e

    return MARKER.sub(replace, markdown)


# ---- MkDocs' hook functions ---------------------------------------------------------------------

def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """The generated lists; and a link to the benchmark results as the repository has it (from the
    page's folder up to the root: it works on GitHub) made the site's (the results sit at the same
    path under the site's root as under the repository's)."""
    depth = page.file.src_uri.count("/")
    return render(markdown).replace("](" + "../" * (depth + 1) + "benchmarks/results/",
                                    "](" + "../" * depth + "benchmarks/results/")


def on_files(files: Any, config: Any, **_: Any) -> Any:
    """The benchmark results, under ``benchmarks/results/`` in the site, beside the benchmark pages."""
    from mkdocs.structure.files import File

    for path in sorted(RESULTS.iterdir()):
        if path.suffix in (".png", ".json"):
            files.append(File(f"benchmarks/results/{path.name}", src_dir=str(ROOT), dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files
