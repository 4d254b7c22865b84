"""An embedded run whose following fails is cancelled and kept before its pool stops."""

from __future__ import annotations

import pytest

from tensorturn.runs import launch


def test_an_embedded_run_whose_following_fails_is_cancelled_and_kept_before_the_pool_stops(tmp_path, monkeypatch):
    """Following the run failed (here its observer raises — a tracker, a display): the run is
    cancelled as `tensorturn cancel` would and its manifest saved before the embedded pool and
    its Redis go, so `tensorturn resume` continues it from the store."""
    from tensorturn.runs.request import RunRequest
    from tensorturn.state.manifest import read_manifest
    from tensorturn.store.objects import open_store

    class Failing(launch.Quiet):
        def watch(self, doc):
            def update(_doc):
                raise RuntimeError("the display broke")
            return update

    monkeypatch.chdir(tmp_path)
    store = (tmp_path / "store").as_uri()
    said = []
    observer = Failing()
    observer.say = said.append
    launcher = launch.Launcher(None, store, observer)
    stages, recipes = launcher.stages(RunRequest.of({"recipe": "digits-mlp", "rounds": 50}), 1)
    run_id = stages[0][0]
    with pytest.raises(RuntimeError, match="the display broke"):
        launcher.launch(stages, recipes, 1)
    assert read_manifest(open_store(store), run_id)["state"] == "cancelled"
    assert said[-1].startswith(f"run {run_id} cancelled"), said
