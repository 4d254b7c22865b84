"""The house rules that keep the package readable, checked on the source (no imports run).

The import layering and the absence of cycles are checked by ``lint-imports`` (contracts in
``pyproject.toml``, run by ``.ci/run``); these are the rules it cannot express.

Modules are cut by concept, not by a line cap (STYLE.md: rq keeps ``worker.py`` whole because it
is one concept). The rules that say so: every part of the package is on :data:`CONCEPTS`, the
map of what each holds, and is a layer of the import contract; every module says its concept in
its docstring's first line and is named for it (no ``utils``, ``helpers``, ``part2``). Size is a
hint: a module over :data:`LONG` lines is reported (a warning in the test summary, not a failure),
one over :data:`TOO_LONG` fails — at that length a module holds more than one concept, whatever
its docstring says, and the map's line for it should become two.
"""

from __future__ import annotations

import ast
import re
import tomllib
import warnings
from pathlib import Path

from conftest import ROOT

PACKAGE = ROOT / "tensorturn"
LONG = 500       # reported: read it again for a second concept
TOO_LONG = 800   # fails
# what a test of the command line takes from it: the command itself, its JSON writer, and the
# module whose terminal check a test of `runs rm` stands in for
CLI_FOR_TESTS = {"cli", "main", "emit_json", "inspect"}

# The concept map: each part of tensorturn/ (a package or a top-level module) and what it holds.
# A new part takes a line here and a layer in pyproject's import contract; a new module inside a
# part belongs to that part's concept (its docstring says which piece of it).
CONCEPTS: dict[str, str] = {
    "__main__": "`python -m tensorturn`: the command line",
    "cli": "click commands that parse and call; commands that train nothing never import torch",
    "api": "the Python API: a pool and its runs as objects",
    "dashboard": "a live web view of the pool, its runs and served models",
    "track": "experiment trackers (MLflow, TensorBoard, W&B) fed a run's rounds, members and end",
    "runs": "the run lifecycle the CLI, API, tests and benchmarks call: launch, follow, cancel, resume, report",
    "runfile": "a run's settings in a TOML file",
    "merge": "an ensemble made one model: distillation, soups",
    "serve": "the inference API: app, wire protocol, server, auth, tokens, batching",
    "modes": "run modes as plug-ins: fused (DiLoCo rounds, sync policies) and ensemble (segments, the vote)",
    "tasks": "what runs on the agents: the attempt protocol, quarantine, the start task",
    "pool": "the machines: Celery app, agent, leases, telemetry, routing, capacity, the owner's rules, embedded pool",
    "export": "a finished run as a self-describing folder, and that folder loaded back without a pool",
    "recipes": "what to train: the Recipe protocol and its contract, task kinds, the vote rule, built-in recipes",
    "train": "the math and the loop, free of the pool: DiLoCo, the inner loop, device, distillation math",
    "data": "the data plane: pushed datasets, chunk index, per-machine cache",
    "state": "the run state on the broker: one small class per Redis structure; nothing else touches the client",
    "store": "the object store and what lives in it: files or S3, seals, safetensors, codecs",
    "spec": "the run spec: the options every run has, plus its mode's",
    "registry": "the mode registry: a mode's name → its package",
    "trust": "the pool key: what proves a spec, task, manifest or token came from the pool's owner",
    "tracebacks": "tracebacks a user can read: their code's frames, bounded, secrets masked",
    "config": "every TENSORTURN_* setting, read once into one frozen Settings",
    "platforms": "what differs between Linux, macOS and Windows",
    "errors": "errors a user can cause, with their exit codes",
    "predictor": "a trained model (one, or an ensemble that votes) made ready to predict: what serve and export load",
    "testbed_hooks": "where test and benchmark tooling plugs in (a step's pace, the owner's sensors); never a setting",
    "layout": "where everything lives: every store key, Redis key, claim name and task label, built and parsed",
}
# names that say where code was cut, not what it is
CUT_NAMES = re.compile(r"^(utils?|helpers?|misc|common|stuff|extras?|more|other|impl|part\d*|.*_\d+)$")


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


def _layers() -> set[str]:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in doc["tool"]["importlinter"]["contracts"] if c["id"] == "layers")
    return {name.strip() for layer in contract["layers"] for name in layer.split("|")}


def test_every_part_of_the_package_is_on_the_concept_map_and_a_layer():
    parts = {p.stem if p.suffix else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert parts == set(CONCEPTS), "a part of tensorturn/ takes a line in CONCEPTS (and a layer)"
    assert _layers() == set(CONCEPTS), "every part on the concept map is a layer of pyproject's contract"


def test_every_module_says_its_concept_first_and_is_named_for_it():
    found = []
    for path in _modules(PACKAGE):
        where = str(path.relative_to(ROOT))
        if path.name == "__main__.py":
            continue
        if not (ast.get_docstring(ast.parse(path.read_text(), where)) or "").strip():
            found.append(f"{where}: no docstring saying what it holds")
        if CUT_NAMES.match(path.stem) and path.stem != "__init__":
            found.append(f"{where}: named for where it was cut, not for its concept")
    assert found == []


def _lengths() -> dict[str, int]:
    return {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in _modules(PACKAGE)}


def test_no_module_is_so_long_it_must_hold_two_concepts():
    assert {where: n for where, n in _lengths().items() if n > TOO_LONG} == {}


def test_long_modules_are_reported():
    """Not a failure: a module over LONG lines may be one concept (say so in its docstring); the
    warning keeps it in view."""
    for where, n in sorted(_lengths().items()):
        if n > LONG:
            warnings.warn(f"{where} is {n} lines: one concept still?", stacklevel=1)


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
REGISTRY = "tensorturn.modes.fused.policies"
ENTRY = "tasks.py"  # the mode's entry point, which Celery includes: it imports the driver only


def test_no_fused_unit_looks_a_policy_up():
    """A sync policy decides what a round trains and what follows each output and each outer
    step; the work it schedules is plain (a shard trains and stores, an outer step steps and
    stores) and never looks a policy up or calls it: it is handed a plan and a driver to give
    its result to. No module of the fused mode but the policies, their registry and the driver
    imports one, or the driver (the entry point excepted), or calls a policy's method."""
    side = (REGISTRY, "tensorturn.modes.fused.sync", "tensorturn.modes.fused.driver")
    decisions = {"policy", "shard_plan", "step_plan", "on_output", "on_step"}
    found = []
    for path in _modules(FUSED):
        where = path.relative_to(FUSED)
        if where.parts[0] == "sync" or str(where) in POLICY_SIDE:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == REGISTRY:
                # the registry's names (the --sync choices) are no policy; a lookup is
                named = [f"{node.module}.{a.name}" for a in node.names if a.name != "POLICIES"]
            elif isinstance(node, ast.ImportFrom) and node.module:
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


def test_each_registered_policy_is_its_named_class():
    """Each entry of the registry (a ``"module:Class"`` name, imported when a run asks) names a
    :class:`~tensorturn.modes.fused.sync.base.SyncPolicy` of :mod:`tensorturn.modes.fused.sync`
    whose ``name`` is its key — the ``--sync`` value that chooses it."""
    from tensorturn.modes.fused.options import SYNCS
    from tensorturn.modes.fused.policies import POLICIES, policy_class
    from tensorturn.modes.fused.sync.base import SyncPolicy

    assert SYNCS == tuple(POLICIES)
    for name, where in POLICIES.items():
        cls = policy_class(name)
        assert issubclass(cls, SyncPolicy) and cls is not SyncPolicy
        assert cls.name == name
        assert where.startswith("tensorturn.modes.fused.sync.")
