"""A recipe for tests: digits-mlp that raises in the hook named by ``TT_FAIL_IN`` (read at each
call, so a test can make it fail after the run was submitted, or only on the agents): a
ValueError (an error of the recipe's code: a run fails at once), or with ``TT_FAIL_AS=RuntimeError``
one a machine may cause (retried); ``evaluate`` with ``TT_FAIL_OVER_ROWS=N`` only on more than N
rows — past the checks at submit (16 rows), as a bug that shows only on a whole split."""

from __future__ import annotations

import os

import torch

from tensorturn.recipes.digits import DigitsMLP


def maybe_fail(hook: str, rows: int | None = None) -> None:
    if os.environ.get("TT_FAIL_IN") != hook:
        return
    if rows is not None and rows <= int(os.environ.get("TT_FAIL_OVER_ROWS", "0")):
        return
    error = RuntimeError if os.environ.get("TT_FAIL_AS") == "RuntimeError" else ValueError
    raise error(f"boom in {hook}\n(a second line: the user sees both, on one line)")


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
        maybe_fail("evaluate", len(y))
        return super().evaluate(model, x, y)

    def predict_proba(self, model, x):
        maybe_fail("predict_proba")
        return super().predict_proba(model, x)


class ShapeBug(DigitsMLP):
    """digits-mlp with a shape bug that shows only on batches of more than ``TT_BUG_ROWS`` rows
    (16 by default): check-recipe's 16 rows pass, a run's batches of 32 fail inside torch."""

    name = "shapebug"

    def loss(self, model, x, y):
        if len(x) > int(os.environ.get("TT_BUG_ROWS", "16")):
            x = torch.cat([x, x[:, :1]], dim=1)  # one feature too many: the first layer refuses it
        return super().loss(model, x, y)
