"""A failed embedded run keeps its logs, and `status` shows where it broke."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from conftest import RECIPES, tt


def bug_line() -> int:
    """The line of the failing recipe module where ShapeBug's loss hands torch a batch of the wrong width."""
    import failing

    lines, first = inspect.getsourcelines(failing.ShapeBug.loss)
    return first + next(i for i, line in enumerate(lines) if "return super().loss" in line)



def test_a_failed_embedded_run_keeps_its_logs_and_status_shows_where_it_broke(tmp_path):
    proc = tt("run", "--recipe", "failing:ShapeBug", "--local-workers", "1", "--rounds", "1",
              "--shards", "2", "--sync-every", "2", "--max-attempts", "2", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    run_id = proc.stdout.split()[1].rstrip(":")
    last = proc.stderr.strip().splitlines()[-1]
    logs = Path(".tensorturn") / "logs" / run_id
    assert last.startswith("error: r0/shard-") and "mat1 and mat2" in last
    assert last.endswith(f"(agent logs: {logs})") and "Traceback" not in proc.stderr

    kept = tmp_path / logs
    agent_log = (kept / "agent-1.log").read_text()
    assert "mat1 and mat2" in agent_log  # the agent's own account of the failure
    assert "TENSORTURN_POOL_KEY" not in agent_log and "ttk1." not in agent_log
    assert "redis://default:" not in agent_log.replace("redis://default:***@", "")

    store = str(tmp_path / "tensorturn-store")
    status = tt("status", run_id, "--store", store, "--debug")
    assert status.returncode == 1
    assert f'    File "{RECIPES / "failing.py"}", line {bug_line()}, in loss' in \
        status.stderr.splitlines()
    assert "RuntimeError: mat1 and mat2 shapes cannot be multiplied" in status.stderr
    doc = json.loads(tt("status", run_id, "--store", store, "--json").stdout)
    failed = [a for a in doc["attempts"] if a["outcome"].startswith("failed")]
    assert failed and all(f"line {bug_line()}, in loss" in a["traceback"] for a in failed)
