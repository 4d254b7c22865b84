#!/usr/bin/env python3
"""Move the test modules into folders by what they start (issue 48, move 7), with ``git mv`` so
history follows; the only content it changes is the one line per file that names the recipes'
folder. Run from anywhere in the repository; it is idempotent: a module already moved is left
alone, so it can run again after a merge brings test modules written at the old place.

    tests/unit/         pure math, parsing, the source read with ast: no process, no redis-server
    tests/integration/  the in-process harness: a real redis-server, the tasks run in this process
                        (``world``), the CLI against a broker with no agent, moto's S3, child
                        processes that are not agents
    tests/e2e/          real agent processes (conftest marks every test here ``e2e``)
    tests/recipes/      recipe modules the tests and their agents import (on PYTHONPATH)

A test module this script does not know (one added on another branch) is placed by what it
uses: module-level ``pytest.mark.e2e`` → e2e; a redis-server, the world, a pool, a CLI
subprocess or a server → integration; else unit. It says so; check that it fits.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
TESTS = ROOT / "tests"

RECIPES = ["contract_recipes", "divergent", "evil_recipe", "failing", "gated", "huge",
           "learned_recipes", "looping_recipe", "mixed_recipe", "regress"]

FOLDER = {
    "unit": ["allowlist", "architecture", "broadcast", "data_safety", "distill_math", "layering",
             "layout", "math", "model_files", "seals"],
    "integration": ["agent", "async", "attempt", "bad_input", "bounds", "cancel", "charlm",
                    "checkrecipe_limits", "cli_fast", "control_plane", "data", "data_text",
                    "defaults", "deploy", "evaluation", "lease", "local", "outer_role", "overlap",
                    "owner_policy", "platforms", "progress", "recipe_contract", "recipe_lifecycle",
                    "records", "run_files", "run_lifecycle", "secrets", "small_fixes", "store",
                    "tracebacks", "transport", "trust"],
    "e2e": ["api", "chaos", "dashboard", "distill", "ensemble", "ensemble_divergence", "export",
            "flower", "fused", "import_path", "links", "owner", "quarantine", "report", "serve",
            "soup", "status", "tamper", "tasks", "threads_pool", "track"],
}
# a module renamed as it moves: its old name said when it was written, not what it checks
RENAMED: dict[str, str] = {}

# the lines that name the recipes' folder (the test process's and the agents' PYTHONPATH)
REWRITES = [
    (TESTS / "conftest.py", 'RECIPES = ROOT / "tests"\n', 'RECIPES = ROOT / "tests" / "recipes"\n'),
    (ROOT / "benchmarks" / "defaults.py", 'for folder in ("tests", "examples"):',
     'for folder in ("tests/recipes", "examples"):'),
]


def git(*args: str) -> None:
    subprocess.run(["git", *args], cwd=ROOT, check=True)


def guess(path: Path) -> str:
    text = path.read_text()
    if re.search(r"^pytestmark\s*=.*\be2e\b", text, re.M):
        return "e2e"
    if re.search(r"\b(redis_server|world|pool|pool_factory|s3_bucket|s3_endpoint|tt|tt_json|tt_many|"
                 r"tt_json_many|Server|start_pool|subprocess)\b", text):
        return "integration"
    return "unit"


def main() -> int:
    moved = 0
    for name in RECIPES:
        if (TESTS / f"{name}.py").exists():
            (TESTS / "recipes").mkdir(exist_ok=True)
            git("mv", f"tests/{name}.py", f"tests/recipes/{name}.py")
            moved += 1
    where = {f"test_{m}": folder for folder, modules in FOLDER.items() for m in modules}
    for path in sorted(TESTS.glob("test_*.py")):
        folder = where.get(path.stem)
        if folder is None:
            folder = guess(path)
            print(f"{path.name}: not in the table; placed in tests/{folder}/ by what it uses")
        (TESTS / folder).mkdir(exist_ok=True)
        new = RENAMED.get(path.stem, path.stem)
        git("mv", f"tests/{path.name}", f"tests/{folder}/{new}.py")
        moved += 1
    for other in sorted(TESTS.glob("*.py")):
        if other.name != "conftest.py":
            print(f"{other.name}: neither a test module nor a known recipe; left in tests/")
    for path, old, new in REWRITES:
        text = path.read_text()
        if old in text:
            path.write_text(text.replace(old, new))
            git("add", str(path.relative_to(ROOT)))
    print(f"{moved} files moved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
