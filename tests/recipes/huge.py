"""A recipe for tests: digits-mlp with two 200k-wide layers, about 40 billion parameters — far
beyond any machine here (the memory check must refuse it)."""

from tensorturn.recipes.digits import DigitsMLP


class Huge(DigitsMLP):
    def default_config(self):
        return {"hidden": [200_000, 200_000], "dropout": 0.0}
