"""Recipes for tests of the recipe contract (tests/test_recipe_contract.py), over scikit-learn's
bundled data (no download): diabetes — 442 patients, 10 features, a disease-progression score
from 25 to 346 — and digits."""

from __future__ import annotations

from typing import Any

import torch
from regress import Diabetes as StandardisedDiabetes
from torch import nn

from tensorturn.recipes import Recipe
from tensorturn.recipes.digits import DigitsMLP


def diabetes(standardise: bool) -> tuple[torch.Tensor, ...]:
    """Fixed splits (310 / 44 / 88 rows); targets standardised with mean and std when asked."""
    from sklearn.datasets import load_diabetes
    from sklearn.model_selection import train_test_split

    x, y = load_diabetes(return_X_y=True)
    if standardise:
        y = (y - y.mean()) / y.std()
    x_rest, x_test, y_rest, y_test = train_test_split(x, y, test_size=88, random_state=0)
    x_train, x_val, y_train, y_val = train_test_split(x_rest, y_rest, test_size=44, random_state=0)
    return tuple(torch.tensor(a, dtype=torch.float32) for a in (x_train, y_train, x_val, y_val, x_test, y_test))


class Diabetes(StandardisedDiabetes):
    """tests/regress.py's regression on standardised targets, saying how they were scaled."""

    name = "diabetes-standardised"

    def __init__(self) -> None:
        from sklearn.datasets import load_diabetes

        y = load_diabetes().target
        self.mu, self.sigma = float(y.mean()), float(y.std())

    def unscale_targets(self, values: torch.Tensor) -> torch.Tensor:
        return values * self.sigma + self.mu


class DiabetesR2(Diabetes):
    """Its own evaluate, as the issue's user wrote it: MSE, MAE and R² in the user's units."""

    @torch.no_grad()
    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        model.eval()
        pred = self.unscale_targets(model(x).reshape(y.shape))
        y = self.unscale_targets(y)
        err = pred - y
        return {"loss": float((err ** 2).mean()), "mae": float(err.abs().mean()),
                "r2": float(1 - (err ** 2).sum() / ((y - y.mean()) ** 2).sum())}


class NoTask(Recipe):
    """A regression recipe that forgot ``task``: float targets under the default
    classification."""

    name = "no-task"

    def raw_data(self):
        return diabetes(standardise=False)

    def model(self, config: dict[str, Any]) -> nn.Module:
        return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))


class ProbaRegression(Diabetes):
    """Overrides predict_proba, which a regression never calls."""

    def predict_proba(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.unscale_targets(model(x))


class ScaledDigits(DigitsMLP):
    """A classifier with unscale_targets, which a classification never calls."""

    def unscale_targets(self, values: torch.Tensor) -> torch.Tensor:
        return values * 2


class NamedDigits(DigitsMLP):
    """Digits whose classes have names."""

    classes = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


class TwoNames(DigitsMLP):
    classes = ["even", "odd"]


class WideRegression(Diabetes):
    """Three values per row for one target each: the default loss would broadcast them."""

    def model(self, config: dict[str, Any]) -> nn.Module:
        return nn.Sequential(nn.Linear(10, 8), nn.ReLU(), nn.Linear(8, 3))


class WrongWidth(DigitsMLP):
    """A first layer one input wider than the data (64 pixels): meta raises, the CPU names it."""

    def model(self, config: dict[str, Any]) -> nn.Module:
        return nn.Sequential(nn.Linear(65, 32), nn.ReLU(), nn.Linear(32, 10))


class Configured(DigitsMLP):
    """digits-mlp with options a user might pass: a password, an API key, a URL with a password."""

    def __init__(self, password: str = "", api_key: str = "", endpoint: str = "") -> None:
        self.password, self.api_key, self.endpoint = password, api_key, endpoint
