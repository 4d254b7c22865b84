"""Recipes whose raw_data learns state from the training data (tests/test_recipe_lifecycle.py):
the way a user writes a regression on scikit-learn's diabetes data — the targets standardised
with the training split's mean and std, computed in raw_data and read by unscale_targets and
evaluate — and recipes that break the lifecycle on purpose."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import nn

from tensorturn.recipes import Recipe


def diabetes_splits() -> list[torch.Tensor]:
    """Raw diabetes splits (310 / 44 / 88 rows), targets in points of the score (25 to 346)."""
    from sklearn.datasets import load_diabetes
    from sklearn.model_selection import train_test_split

    if os.environ.get("TT_NO_DATA"):  # a machine where the training data is not
        raise FileNotFoundError("no training data on this machine")
    x, y = load_diabetes(return_X_y=True)
    x_rest, x_test, y_rest, y_test = train_test_split(x, y, test_size=88, random_state=0)
    x_train, x_val, y_train, y_val = train_test_split(x_rest, y_rest, test_size=44, random_state=0)
    return [torch.tensor(a, dtype=torch.float32) for a in (x_train, y_train, x_val, y_val, x_test, y_test)]


class Diabetes(Recipe):
    """Targets and features standardised with statistics raw_data computes: the learned state."""

    name = "diabetes-learned"
    task = "regression"
    lr = 3e-3

    def raw_data(self):
        x_train, y_train, x_val, y_val, x_test, y_test = diabetes_splits()
        self._ymean, self._ystd = float(y_train.mean()), float(y_train.std())  # floats
        self._xmean, self._xstd = x_train.mean(0), x_train.std(0)               # tensors
        self._range = np.array([float(y_train.min()), float(y_train.max())])    # a numpy array
        scale = lambda y: (y - self._ymean) / self._ystd  # noqa: E731
        return x_train, scale(y_train), x_val, scale(y_val), x_test, scale(y_test)

    def preprocess(self, raw: torch.Tensor) -> torch.Tensor:
        return (raw.float() - self._xmean) / self._xstd

    def unscale_targets(self, values: torch.Tensor) -> torch.Tensor:
        return values * self._ystd + self._ymean

    def default_config(self) -> dict[str, Any]:
        return {"hidden": 32}

    def config_space(self) -> dict[str, list[Any]]:
        return {"hidden": [16, 32]}

    def model(self, config: dict[str, Any]) -> nn.Module:
        return nn.Sequential(nn.Linear(10, config["hidden"]), nn.ReLU(), nn.Linear(config["hidden"], 1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        model.eval()
        pred, y = self.unscale_targets(model(x).reshape(y.shape)), self.unscale_targets(y)
        err = pred - y
        return {"loss": float((err ** 2).mean()), "mae": float(err.abs().mean()),
                "in_range": float(((pred >= self._range[0] - 200) & (pred <= self._range[1] + 200)).float().mean())}


class SetByLoss(Diabetes):
    """Reads in evaluate what only its loss sets: a fresh instance has never trained."""

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self._weight = 1.0
        return super().loss(model, x, y) * self._weight

    @torch.no_grad()
    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        return {k: v * self._weight for k, v in super().evaluate(model, x, y).items()}


class Unstorable(Diabetes):
    """Keeps a fitted object on the recipe in raw_data: nothing the run can keep."""

    def raw_data(self):
        splits = super().raw_data()
        self._scaler = object()
        return splits
