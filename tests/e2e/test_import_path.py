"""Where an embedded pool's agents import code from: ``PYTHONPATH`` and installed packages, never
the directory `tensorturn run` was started in (``python -m`` would put it first on ``sys.path``,
so a stray ``celery.py`` there — or a file named like the user's recipe — would be run instead)."""

from __future__ import annotations

import pytest
from conftest import run_to_end

from tensorturn import config, trust

# what an agent imports at start (celery, json), and the recipe module tests/ holds (regress)
SHADOWS = ("celery", "json", "regress")


@pytest.mark.e2e
def test_embedded_agents_import_nothing_from_the_current_directory(tmp_path, pool_factory, monkeypatch):
    marker = tmp_path / "imported-from-cwd"
    here = tmp_path / "project"
    here.mkdir()
    for module in SHADOWS:
        (here / f"{module}.py").write_text(
            f"open({str(marker)!r}, 'a').write('{module}\\n')\nraise SystemExit('shadowed {module}')\n")
    monkeypatch.chdir(here)
    config.use(trust.with_allowed(config.current(), ["regress:*"]))  # tests/regress.py, on PYTHONPATH
    pool = pool_factory(1)
    # the idle agent builds the recipe
    doc = run_to_end(pool, mode="fused", recipe="regress:Diabetes", rounds=1, shards=1, sync_every=2)
    assert not marker.exists(), marker.read_text()
    assert doc["state"] == "succeeded", doc.get("error")
