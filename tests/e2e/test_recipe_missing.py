"""A recipe missing on the agent that starts a run, or on the workers: refused before queueing, or
the run fails with every attempt."""

from __future__ import annotations

import redis
from conftest import assert_clean_error, clean_env, queued_messages, tt

from tensorturn import runs
from tensorturn.spec import RunSpec

RUN = ("run",)

SMALL = ("--rounds", "1", "--shards", "2", "--sync-every", "2")

MY_RECIPE = '''
"""A recipe module that exists only on the submitting machine."""
from typing import Any

import torch
from torch import nn

from tensorturn.recipes import Recipe


class Mine(Recipe):
    name = "mine"
    lr = 3e-3
    batch_size = 32

    def raw_data(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(300, 8, generator=g)
        y = (x.sum(1) > 0).long()
        return x[:200], y[:200], x[200:250], y[200:250], x[250:], y[250:]

    def default_config(self) -> dict[str, Any]:
        return {"hidden": 16}

    def model(self, config: dict[str, Any]) -> nn.Module:
        return nn.Sequential(nn.Linear(8, config["hidden"]), nn.ReLU(), nn.Linear(config["hidden"], 2))
'''


def test_recipe_missing_on_the_agent_that_starts_the_run_is_refused_before_queueing(pool, tmp_path):
    """An idle agent builds the recipe for `run` (the CLI loads no torch): if it cannot import it,
    the command says so in one line, naming the machine, and nothing is queued."""
    (tmp_path / "myrecipe.py").write_text(MY_RECIPE)
    runs_before = redis.Redis.from_url(pool.broker_url).zcard("tt:runs")
    proc = tt(*RUN, "--broker", pool.broker_url, "--store", pool.store_url, "--recipe", "myrecipe:Mine",
              *SMALL, env=clean_env(PYTHONPATH=str(tmp_path)))
    line = assert_clean_error(proc, exit_code=2)
    assert "recipe 'myrecipe:Mine' failed to import" in line and "(on worker local" in line
    r = redis.Redis.from_url(pool.broker_url)
    assert r.zcard("tt:runs") == runs_before and queued_messages(r) == []


def test_recipe_missing_on_workers_fails_the_run_with_every_attempt(pool, tmp_path, monkeypatch):
    """Started where the recipe imports (here), it fails on every agent: each attempt recorded."""
    (tmp_path / "myrecipe.py").write_text(MY_RECIPE)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = RunSpec.create(mode="fused", recipe="myrecipe:Mine", store_url=pool.store_url, rounds=1,
                          shards=2, sync_every=2, max_attempts=2)
    runs.submit(spec, pool.broker_url, here=True)
    doc = runs.wait(pool.broker_url, spec.run_id, timeout_s=300)
    assert doc["state"] == "failed"
    assert doc["recipe"] == "myrecipe:Mine"
    error = doc["error"]
    assert "myrecipe:Mine" in error and "failed to import" in error, error
    assert "No module named 'myrecipe'" in error
    assert "on worker local" in error  # says where it failed
    assert doc["model_uri"] is None and doc["model_sha256"] is None
    assert doc["rounds"] == []

    attempts = doc["attempts"]
    assert attempts, doc
    by_task: dict[str, list[dict]] = {}
    for a in attempts:
        assert a["task"] in ("r0/shard-0", "r0/shard-1"), a
        assert a["worker"].startswith(("local1@", "local2@")), a
        by_task.setdefault(a["task"], []).append(a)
    for entries in by_task.values():
        assert sorted(e["attempt"] for e in entries) == list(range(1, len(entries) + 1)), entries
        assert len(entries) <= 2, entries  # never more than --max-attempts
    finished = [a for a in attempts if a["finished_at"] is not None]
    assert finished
    for a in finished:
        assert a["outcome"].startswith("failed: recipe 'myrecipe:Mine' failed to import"), a
        assert a["finished_at"] >= a["started_at"]
    # the task named in the run's error used up both of its attempts, each recorded as failed
    failed_task = error.split(" ", 1)[0]  # "r0/shard-1 failed 2 attempts; last: ..."
    assert failed_task in by_task, error
    assert [e["outcome"].startswith("failed:") for e in by_task[failed_task]] == [True, True]
    assert "succeeded" not in {a["outcome"] for a in attempts}
