"""A regression recipe for tests (scikit-learn's bundled diabetes data, no download): 442 patients,
10 standardised features, a disease-progression score. The target is scaled to mean 0, std 1."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tensorturn.recipes import Recipe


class Diabetes(Recipe):
    name = "diabetes"
    task = "regression"
    lr = 3e-3
    batch_size = 32

    def raw_data(self):
        from sklearn.datasets import load_diabetes
        from sklearn.model_selection import train_test_split

        x, y = load_diabetes(return_X_y=True)
        y = (y - y.mean()) / y.std()
        x_rest, x_test, y_rest, y_test = train_test_split(x, y, test_size=88, random_state=0)
        x_train, x_val, y_train, y_val = train_test_split(x_rest, y_rest, test_size=44, random_state=0)
        t = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
        return t(x_train), t(y_train), t(x_val), t(y_val), t(x_test), t(y_test)

    def default_config(self) -> dict[str, Any]:
        return {"hidden": 32}

    def config_space(self) -> dict[str, list[Any]]:
        return {"hidden": [16, 32, 64]}

    def model(self, config: dict[str, Any]) -> nn.Module:
        return nn.Sequential(nn.Linear(10, config["hidden"]), nn.ReLU(), nn.Linear(config["hidden"], 1))


class WrongTarget(Diabetes):
    """A regression recipe that forgot to say so: its float targets meet cross-entropy."""

    task = "classification"
