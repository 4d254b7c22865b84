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
from conftest import TEST_POOL_KEY, clean_env, tt_here, tt_many

from tensorturn import trust
from tensorturn.pool.coordinator import make_join

LIMIT = "10"  # seconds: far above what Tiny's other hooks take, even on a busy machine
LOOPING = {"looping_recipe:LoopsInLoss": "loss", "looping_recipe:StuckInEvaluate": "evaluate"}


@pytest.fixture(scope="module")
def stopped_checks(tmp_path_factory):
    """`check-recipe` of each looping recipe, all at once (each waits out the limit): recipe →
    (its answer, the file its loop's process id was written to)."""
    work = tmp_path_factory.mktemp("looping")
    pid_files = [work / f"pid-{i}" for i in range(len(LOOPING))]
    results = tt_many(*(("check-recipe", recipe, "--hook-timeout", LIMIT) for recipe in LOOPING),
                      envs=[clean_env(TT_LOOP_PID_FILE=str(pid)) for pid in pid_files])
    return dict(zip(LOOPING, zip(results, pid_files)))


@pytest.mark.parametrize("recipe,hook", list(LOOPING.items()))
def test_a_hook_that_never_returns_is_stopped_and_named_in_one_line(stopped_checks, recipe, hook):
    result, pid_file = stopped_checks[recipe]
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
    join = tmp_path / ".tensorturn" / "join"
    trust.write_secret(join, make_join("redis://default:pw@127.0.0.1:1/0", pushed_table.as_uri(),
                                       TEST_POOL_KEY) + "\n")
    by_option, by_join = tt_many((*args, "--store", str(pushed_table)), args, cwd=elsewhere,
                                 envs=[clean_env(), clean_env(TENSORTURN_JOIN_FILE=str(join))])
    assert by_option.returncode == 0, by_option.stderr
    assert by_join.returncode == 0, by_join.stderr
    assert json.loads(by_join.stdout)["rows"] == json.loads(by_option.stdout)["rows"]
    assert not (elsewhere / "tensorturn-store").exists()
