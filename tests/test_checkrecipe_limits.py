"""`check-recipe` answers within its limit, and reads the store `run` would.

A hook that never returns — a pure-Python loop that catches everything, or one C call that never
comes back to the interpreter — is stopped after ``--hook-timeout`` seconds and named in one line,
and nothing of it is left running. ``--store`` and the join file (``TENSORTURN_JOIN_FILE``) say
where a pushed dataset is, as they do for `run`.
"""

from __future__ import annotations

import csv
import json

import psutil
import pytest
from conftest import TEST_POOL_KEY, clean_env, tt_here

from tensorturn import trust
from tensorturn.pool.coordinator import make_join

LIMIT = "10"  # seconds: far above what Tiny's other hooks take, even on a busy machine


@pytest.mark.parametrize("recipe,hook", [("looping_recipe:LoopsInLoss", "loss"),
                                         ("looping_recipe:StuckInEvaluate", "evaluate")])
def test_a_hook_that_never_returns_is_stopped_and_named_in_one_line(tmp_path, recipe, hook):
    pid_file = tmp_path / "pid"
    result = tt_here("check-recipe", recipe, "--hook-timeout", LIMIT,
                     env=clean_env(TT_LOOP_PID_FILE=str(pid_file)))
    assert result.returncode == 2
    assert result.stderr == (f"error: recipe {recipe!r} failed at {hook}: still running after {LIMIT} s "
                             f"(the limit per hook, --hook-timeout); stopped\n")
    assert result.stdout == ""
    assert not psutil.pid_exists(int(pid_file.read_text()))  # the loop is gone with its process


@pytest.fixture
def pushed_table(tmp_path):
    """A store holding the table ``tab`` (3 numeric columns, label ``y``)."""
    table, store = tmp_path / "table.csv", tmp_path / "store"
    with open(table, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["a", "b", "c", "y"])
        w.writerows([i % 7, i % 5, i % 3, i % 2] for i in range(200))
    pushed = tt_here("data", "push", str(table), "--name", "tab", "--label", "y", "--store", str(store))
    assert pushed.returncode == 0, pushed.stderr
    return store


def test_check_recipe_reads_the_store_of_store_or_the_join_file(pushed_table, tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere"  # its ./tensorturn-store holds no dataset
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    args = ("check-recipe", "tabular", "--recipe-option", "dataset=tab", "--json")
    by_option = tt_here(*args, "--store", str(pushed_table))
    assert by_option.returncode == 0, by_option.stderr
    join = tmp_path / ".tensorturn" / "join"
    trust.write_secret(join, make_join("redis://default:pw@127.0.0.1:1/0", pushed_table.as_uri(),
                                       TEST_POOL_KEY) + "\n")
    by_join = tt_here(*args, env=clean_env(TENSORTURN_JOIN_FILE=str(join)))
    assert by_join.returncode == 0, by_join.stderr
    assert json.loads(by_join.stdout)["rows"] == json.loads(by_option.stdout)["rows"]
    assert not (elsewhere / "tensorturn-store").exists()
