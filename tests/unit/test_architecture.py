"""The house rules that keep the package readable, checked on the source (no imports run).

The import layering and the absence of cycles are checked by ``lint-imports`` (contracts in
``pyproject.toml``, run by ``.ci/run``); these are the rules it cannot express.
"""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "tensorturn"
MAX_LINES = 500
# what a test of the command line takes from it: the command itself, its JSON writer, and the
# module whose terminal check a test of `runs rm` stands in for
CLI_FOR_TESTS = {"cli", "main", "emit_json", "inspect"}


def _modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if ".venv" not in p.parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names, line) of every ``from X import names`` and ``import X`` in ``path``."""
    out: list[tuple[str, list[str], int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            out.extend((a.name, [], node.lineno) for a in node.names)
    return out


def test_no_module_of_the_package_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in _modules(PACKAGE)
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_private_name_is_imported_from_another_module():
    found = []
    for path in _modules(PACKAGE) + _modules(ROOT / "tests") + _modules(ROOT / "benchmarks"):
        for module, names, line in _imports(path):
            if not module.startswith("tensorturn"):
                continue
            found += [f"{path.relative_to(ROOT)}:{line} {module}.{name}" for name in names
                      if name.startswith("_") and not name.startswith("__")]
    assert found == []


def test_no_test_module_imports_another():
    tests = {p.stem for p in (ROOT / "tests").rglob("test_*.py")}
    found = [f"{path.name}:{line} {module}" for path in _modules(ROOT / "tests")
             for module, _, line in _imports(path) if module.split(".")[-1] in tests]
    assert found == []


def test_tests_and_benchmarks_use_the_package_not_the_command_line():
    """Tests and benchmarks call the package's functions (``tensorturn.runs``…); the CLI only parses
    and calls them, so a test imports from it only the command it runs."""
    found = []
    for path in _modules(ROOT / "tests") + _modules(ROOT / "benchmarks"):
        for module, names, line in _imports(path):
            if module != "tensorturn.cli" and not module.startswith("tensorturn.cli."):
                continue
            in_tests = path.relative_to(ROOT).parts[0] == "tests"
            allowed = CLI_FOR_TESTS if in_tests and module == "tensorturn.cli" else set()
            found += [f"{path.relative_to(ROOT)}:{line} {module}.{name}" for name in names or ["*"]
                      if name not in allowed]
    assert found == []


# where a process's settings may be replaced (:func:`tensorturn.config.use`, ``reload``): the
# command line's entry point, once, from the environment and the command's flags
# and the Python API's Pool.connect, the same once (a join file's pool key, the recipes the user allowed)
SETTINGS_SET_IN = {"tensorturn/cli/__init__.py", "tensorturn/api.py"}


def test_settings_are_passed_not_swapped():
    """No library call changes the process's settings as a side effect (say, widening the recipe
    allowlist for a recipe the user named): what a call needs beyond them is passed to it."""
    found = []
    for path in _modules(PACKAGE):
        where = str(path.relative_to(ROOT))
        if where in SETTINGS_SET_IN or where == "tensorturn/config.py":
            continue
        tree = ast.parse(path.read_text(), where)
        imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.module == "tensorturn.config" for a in node.names}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            swaps = (isinstance(func, ast.Attribute) and func.attr in ("use", "reload")
                     and isinstance(func.value, (ast.Name, ast.Attribute))
                     and ast.unparse(func.value).split(".")[-1] == "config")
            swaps = swaps or (isinstance(func, ast.Name) and func.id in imported & {"use", "reload"})
            if swaps:
                found.append(f"{where}:{node.lineno} {ast.unparse(func)}")
    assert found == []


FUSED = PACKAGE / "modes" / "fused"
# what may name a sync policy: the policies themselves (modes/fused/sync/), their registry, and
# the driver that asks the run's policy and queues what it returns
POLICY_SIDE = {"policies.py", "driver.py"}
ENTRY = "tasks.py"  # the mode's entry point, which Celery includes: it imports the driver only


def test_no_fused_unit_looks_a_policy_up():
    """A sync policy decides what a round trains and what follows each output and each outer
    step; the work it schedules is plain (a shard trains and stores, an outer step steps and
    stores) and never looks a policy up or calls it: it is handed a plan and a driver to give
    its result to. No module of the fused mode but the policies, their registry and the driver
    imports one, or the driver (the entry point excepted), or calls a policy's method."""
    side = ("tensorturn.modes.fused.policies", "tensorturn.modes.fused.sync", "tensorturn.modes.fused.driver")
    decisions = {"policy", "shard_plan", "step_plan", "on_output", "on_step"}
    found = []
    for path in _modules(FUSED):
        where = path.relative_to(FUSED)
        if where.parts[0] == "sync" or str(where) in POLICY_SIDE:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                named = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            else:
                named = []
            allowed = {"tensorturn.modes.fused.driver"} if str(where) == ENTRY else set()
            found += [f"{where}:{node.lineno} imports {name}" for name in named
                      if name not in allowed and any(name == s or name.startswith(s + ".") for s in side)]
            if isinstance(node, ast.Call) and (  # (a plain name: a training loop's own on_step callback)
                    isinstance(node.func, ast.Name) and node.func.id == "policy"
                    or isinstance(node.func, ast.Attribute) and node.func.attr in decisions):
                found.append(f"{where}:{node.lineno} calls {ast.unparse(node.func)}")
    assert found == []


def test_the_sync_choices_are_the_registrys_policies():
    """``--sync`` offers (:data:`~tensorturn.modes.fused.options.SYNCS`, read without torch)
    exactly the policies of the registry."""
    from tensorturn.modes.fused.options import SYNCS
    from tensorturn.modes.fused.policies import POLICIES

    assert tuple(POLICIES) == SYNCS
