"""Predicted beside measured utilisation, as `status` and the report say it."""

from tensorturn.runs.display import utilisation_text


def test_a_small_models_prediction_is_said_to_be_rough():
    small = {"predicted_utilisation": 0.043, "round_s": 1.4}
    said = utilisation_text(small, 0.31)
    assert said.startswith("predicted 0.04 by the plan, measured 0.31")
    assert "a round of 1.4 s is mostly the fixed costs" in said


def test_a_large_models_prediction_stands_as_it_is():
    large = {"predicted_utilisation": 0.863, "round_s": 62.0}
    assert utilisation_text(large, 0.888) == "predicted 0.86 by the plan, measured 0.89"
    assert utilisation_text(large, None) == "predicted 0.86 by the plan, measured — (no shard finished yet)"
