"""What a run report says where it has nothing to draw or is handed something that is not a run."""

from __future__ import annotations

import pytest

from tensorturn.runs.report import (
    plots,
    report_files,
)


def test_not_a_run_description_is_refused():
    from tensorturn.errors import TensorTurnError

    with pytest.raises(TensorTurnError, match="not a run description"):
        plots({"hello": "world"})
    with pytest.raises(TensorTurnError, match="not a run description"):
        report_files({"run_id": "x", "mode": "other"})


def test_an_empty_chart_says_why_it_is_empty():
    from tensorturn.runs.report.figures import none_yet

    assert none_yet({"state": "running"}, "no round finished yet") == "no round finished yet"
    assert none_yet({"state": "succeeded"}, "no round finished yet") == "none recorded"
    soup = {"state": "succeeded", "lineage": {"souped_from": "20260101-000000-abcdef"}}
    said = none_yet(soup, "no round finished yet")
    assert said == "a weight soup of run 20260101-000000-abcdef: it trained nothing itself"


def test_a_run_with_no_training_rate_says_what_did_finish():
    from tensorturn.runs.report.figures import no_rate

    assert no_rate({"attempts": []}) == "no training rate yet (no task finished)"
    failed_at_its_first_evaluation = {"attempts": [{"task": f"r0/shard-{k}", "outcome": "succeeded"} for k in range(2)]
                                      + [{"task": "r0/eval", "outcome": "failed: ValueError: boom"}]}
    assert no_rate(failed_at_its_first_evaluation).startswith("no training rate: 2 tasks finished")
