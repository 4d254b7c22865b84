"""The quick start as the README gives it: no warning, and its accuracy reached."""

from __future__ import annotations

import json

from conftest import tt


def test_the_quick_start_prints_no_warning_and_reaches_its_accuracy(tmp_path):
    proc = tt("run", "--mode", "fused", "--recipe", "digits-mlp", "--local-workers", "3",
              "--store", str(tmp_path / "store"), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning" not in proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["metrics"]["test_accuracy"] >= 0.95
    assert (doc["spec"]["options"]["shards"], doc["spec"]["options"]["sync_every"]) == (2, 25)
