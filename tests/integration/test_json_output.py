"""Every `--json` is strict JSON: a non-finite number (a diverged run's NaN loss) is written as
null, never as NaN or Infinity, which JSON does not have."""

from __future__ import annotations

import json

from conftest import tt_here

from tensorturn.spec import RunSpec
from tensorturn.state.board import RunBoard
from tensorturn.state.broker import redis_client


def strict_json(text: str):
    """``text`` parsed as JSON proper: NaN, Infinity and -Infinity are not JSON."""
    def refuse(constant: str):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_status_json_of_a_run_with_nan_metrics_is_strict_json(redis_server, tmp_path):
    spec = RunSpec.create("fused", "digits-mlp", (tmp_path / "store").as_uri(), rounds=1)
    board = RunBoard(redis_client(redis_server.url))
    board.runs.create(spec)
    board.record_round(spec.run_id, 0, {"round": 0, "loss": float("nan"), "val_loss": float("inf"),
                                        "bytes": 0})
    board.finish(spec.run_id, "succeeded", metrics={"test_loss": float("nan"),
                                                    "test_accuracy": float("-inf")})
    proc = tt_here("status", spec.run_id, "--json", "--broker", redis_server.url,
                   "--store", str(tmp_path / "store"))
    assert proc.returncode == 0, proc.stderr
    doc = strict_json(proc.stdout)
    assert doc["metrics"] == {"test_loss": None, "test_accuracy": None}
    assert doc["rounds"][0]["loss"] is None and doc["rounds"][0]["val_loss"] is None


def test_emit_json_turns_every_non_finite_number_into_null(capsys):
    from tensorturn.cli import emit_json

    emit_json({"a": [1.0, float("nan"), {"b": (float("inf"), 2)}], "c": "NaN", "d": None})
    assert strict_json(capsys.readouterr().out) == {"a": [1.0, None, {"b": [None, 2]}],
                                                    "c": "NaN", "d": None}
