"""`tensorturn cancel` on a standing pool: the run ends `cancelled`, its queued tasks are dropped,
its running attempts stop and store nothing, no attempt starts afterwards, and `resume` continues
it to the model an uncancelled run gives — showing its earlier rounds at once, in order, with
their times."""

from __future__ import annotations

from conftest import tt


def test_cancel_refuses_a_run_the_broker_does_not_know(redis_server, tmp_path):
    proc = tt("cancel", "20990101-000000-abcdef", "--broker", redis_server.url,
              "--store", str(tmp_path / "store"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "no run '20990101-000000-abcdef' on this broker" in proc.stderr


def test_cancel_without_a_pool_says_what_it_needs(tmp_path):
    proc = tt("cancel", "20990101-000000-abcdef", "--store", str(tmp_path / "store"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--join-file" in proc.stderr


