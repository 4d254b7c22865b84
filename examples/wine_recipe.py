"""A user recipe in ~40 lines: scikit-learn's bundled wine data (13 features, 3 classes).

Run it on any pool whose machines can import this file:

    PYTHONPATH=examples tensorturn run --recipe wine_recipe:Wine --rounds 4
"""

import torch
from torch import nn

from tensorturn.recipes import Recipe


class Wine(Recipe):
    name = "wine"
    lr = 1e-2
    batch_size = 16

    def raw_data(self):
        from sklearn.datasets import load_wine
        from sklearn.model_selection import train_test_split

        x, y = load_wine(return_X_y=True)
        x_rest, x_test, y_rest, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
        x_train, x_val, y_train, y_val = train_test_split(x_rest, y_rest, test_size=0.15,
                                                          random_state=0, stratify=y_rest)
        t = lambda a, dt=torch.float32: torch.tensor(a, dtype=dt)  # noqa: E731
        self._mean, self._std = t(x_train).mean(0), t(x_train).std(0)
        return (t(x_train), t(y_train, torch.long), t(x_val), t(y_val, torch.long),
                t(x_test), t(y_test, torch.long))

    def preprocess(self, raw):
        # Standardize with the training split's statistics: what raw_data set on self is kept
        # with the run and set on every machine's recipe, and the served model's, before any hook.
        return (raw.float() - self._mean) / self._std

    def default_config(self):
        return {"hidden": 32}

    def model(self, config):
        return nn.Sequential(nn.Linear(13, config["hidden"]), nn.ReLU(), nn.Linear(config["hidden"], 3))
