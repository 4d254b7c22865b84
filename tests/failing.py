"""A recipe for tests: digits-mlp that raises in the hook named by ``TT_FAIL_IN`` (read at each
call, so a test can make it fail after the run was submitted, or only on the agents)."""

from __future__ import annotations

import os

from tensorturn.recipes.digits import DigitsMLP


def maybe_fail(hook: str) -> None:
    if os.environ.get("TT_FAIL_IN") == hook:
        raise ValueError(f"boom in {hook}\n(a second line: the user sees both, on one line)")


class Failing(DigitsMLP):
    name = "failing"

    def raw_data(self):
        maybe_fail("raw_data")
        return super().raw_data()

    def model(self, config):
        maybe_fail("model")
        return super().model(config)

    def loss(self, model, x, y):
        maybe_fail("loss")
        return super().loss(model, x, y)

    def evaluate(self, model, x, y):
        maybe_fail("evaluate")
        return super().evaluate(model, x, y)

    def predict_proba(self, model, x):
        maybe_fail("predict_proba")
        return super().predict_proba(model, x)
