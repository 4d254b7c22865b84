"""A run request: made from flags, keyword arguments or a run file, checked once when it is made,
and started by the one launcher — no check repeated on the way to the pool."""

from __future__ import annotations

import dataclasses
import importlib

import pytest

from tensorturn.errors import SpecError
from tensorturn.runs import launch
from tensorturn.runs.launch import Launcher
from tensorturn.runs.request import RunRequest
from tensorturn.spec import RunSpec


def test_a_request_holds_a_checked_spec_and_how_the_command_runs_it(tmp_path):
    file = tmp_path / "run.toml"
    file.write_text('recipe = "digits-mlp"\nrounds = 3\nseed = 4\ntimeout = 60\n[recipe_options]\n')
    request = RunRequest.of({"rounds": 2, "lr": None}, file)  # a keyword over the file; None: not given
    assert (request.spec.recipe, request.spec.options.rounds, request.spec.seed) == ("digits-mlp", 2, 4)
    assert (request.merge, request.local_workers, request.timeout) == ("none", None, 60)
    assert request.settings["rounds"] == 2 and "local_workers" not in request.settings
    assert request.training["seed"] == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.merge = "distill"  # type: ignore[misc]


@pytest.mark.parametrize("options,line", [
    ({"recipe": "digits-mlp", "merge": "distill"}, "--merge distill merges an ensemble's members"),
    ({"recipe": "digits-mlp", "timeout": 0}, "--timeout must be positive (got 0)"),
    ({"recipe": "digits-mlp", "rounds": 0}, "--rounds must be a whole number ≥ 1 (got 0)"),
    ({"rounds": 2}, "--recipe is required"),
])
def test_a_bad_request_is_refused_when_it_is_made(options, line):
    with pytest.raises(SpecError, match="^" + line.replace("(", r"\(").replace(")", r"\)")):
        RunRequest.of(options)


def test_each_launch_of_a_request_is_its_own_run_with_the_store_it_goes_to(tmp_path):
    request = RunRequest.of({"recipe": "digits-mlp"})
    store = (tmp_path / "store").as_uri()
    first, again = request.spec_for(store, None), request.spec_for(store, 3)
    assert first.run_id != again.run_id and first.store_url == store
    assert "local_workers" not in first.run_config and again.run_config["local_workers"] == 3
    first.recipe_options["data"] = "x"  # starting a run fills its spec in: the request's stays as made
    assert request.spec.recipe_options == {} and request.spec.store_url == ""


def test_a_run_is_validated_once_on_its_way_to_the_pool(tmp_path, monkeypatch):
    """From the flags to the call that queues the run, the spec is checked once: when the
    request is made (the agent that sets the run up checks again only what the pool filled in)."""
    checks, queued = [], []
    original = RunSpec.validate
    monkeypatch.setattr(RunSpec, "validate", lambda self: checks.append(self.run_id) or original(self))
    submit = importlib.import_module("tensorturn.runs.submit")  # (tensorturn.runs.submit is also a function)
    monkeypatch.setattr(submit, "queue_run", lambda spec, broker_url, **kw: queued.append(spec) or {})
    monkeypatch.setattr(launch, "follow_on_pool", lambda broker, run_id, *_: {"state": "running", "run_id": run_id})
    request = RunRequest.of({"recipe": "digits-mlp", "rounds": 2})
    Launcher("redis://127.0.0.1:1/0", (tmp_path / "store").as_uri()).run(request)
    assert len(checks) == 1 and len(queued) == 1 and queued[0].options.rounds == 2


def test_a_store_url_written_wrong_is_refused_before_any_pool_starts():
    with pytest.raises(SpecError, match="unsupported store URL 'ftp://x'"):
        Launcher(None, "ftp://x")
