"""``textlm`` trains on a pushed folder of Python files."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import tt_json

import tensorturn

SPLITS = ("train", "val", "test")

def copy_sources(to: Path) -> int:
    """tensorturn's own files copied to ``to`` (no caches): its .py files and the dashboard's page,
    script and styles, all UTF-8 text; how many."""
    shutil.copytree(Path(tensorturn.__file__).parent, to, ignore=shutil.ignore_patterns("__pycache__"))
    return sum(1 for path in to.rglob("*") if path.is_file())



def test_textlm_trains_on_a_pushed_folder_of_python_files(tmp_path):
    src = tmp_path / "src"
    copy_sources(src)
    store = str(tmp_path / "store")
    pushed = tt_json("data", "push", str(src), "--name", "code", "--include", "*.py", "--store", store, "--json")
    assert all(pushed["rows"][s] > 0 for s in SPLITS)
    small = ["--recipe-option", "context=32", "--recipe-option", "n_embd=32", "--recipe-option", "n_layer=1"]
    doc = tt_json("run", "--mode", "fused", "--recipe", "textlm", "--recipe-option", "dataset=code", *small,
                  "--local-workers", "1", "--rounds", "1", "--shards", "1", "--sync-every", "5",
                  "--store", store, "--json", cwd=tmp_path)
    assert doc["state"] == "succeeded", doc.get("error")
    assert doc["spec"]["recipe_options"]["version"] == 1 and doc["metrics"]["test_loss"] < 5.6  # ln 256 = 5.55
