"""An embedded run whose following fails is cancelled and kept before its pool stops."""

from __future__ import annotations

import pytest

from tensorturn.runs import launch


def test_an_embedded_run_whose_following_fails_is_cancelled_and_kept_before_the_pool_stops(tmp_path, monkeypatch):
    """Following the run failed (here its observer raises — a tracker, a display): the run is
    cancelled as `tensorturn cancel` would and its manifest saved before the embedded pool and
    its Redis go, so `tensorturn resume` continues it from the store."""
    from tensorturn.spec import RunSpec
    from tensorturn.state.manifest import read_manifest
    from tensorturn.store.objects import open_store

    class Failing(launch.Quiet):
        def watch(self, doc):
            def update(_doc):
                raise RuntimeError("the display broke")
            return update

    monkeypatch.chdir(tmp_path)
    spec = RunSpec.create("fused", "digits-mlp", (tmp_path / "store").as_uri(), rounds=50)
    said = []
    observer = Failing()
    observer.say = said.append
    with pytest.raises(RuntimeError, match="the display broke"):
        launch.launch_run(spec, None, 1, observer=observer)
    assert read_manifest(open_store(spec.store_url), spec.run_id)["state"] == "cancelled"
    assert said[-1].startswith(f"run {spec.run_id} cancelled"), said
