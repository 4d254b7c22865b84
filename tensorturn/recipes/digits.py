"""Built-in recipe ``digits-mlp``: scikit-learn's bundled 8×8 handwritten digits, a small MLP.

1797 images of 64 pixels valued 0–16, 10 classes; no download. The split is fixed (stratified,
seed 0): 1293 train, 144 validation, 360 test.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tensorturn.recipes.base import Recipe


class DigitsMLP(Recipe):
    name = "digits-mlp"
    lr = 3e-3
    batch_size = 32

    def raw_data(self):
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        x_rest, x_test, y_rest, y_test = train_test_split(x, y, test_size=360, random_state=0, stratify=y)
        x_train, x_val, y_train, y_val = train_test_split(
            x_rest, y_rest, test_size=144, random_state=0, stratify=y_rest)
        as_x = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
        as_y = lambda a: torch.tensor(a, dtype=torch.long)  # noqa: E731
        return (as_x(x_train), as_y(y_train), as_x(x_val), as_y(y_val), as_x(x_test), as_y(y_test))

    def input_shape(self) -> list[int]:
        # 8×8 pixels, known without loading the data (2 s of scikit-learn in serve and export);
        # a subclass with data of its own finds its shape in it
        return [64] if type(self).raw_data is DigitsMLP.raw_data else super().input_shape()

    def preprocess(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.float() / 16.0

    def default_config(self) -> dict[str, Any]:
        return {"hidden": [256], "dropout": 0.1}

    def config_space(self) -> dict[str, list[Any]]:
        return {"hidden": [[128], [256], [512], [256, 128], [128, 128]],
                "dropout": [0.0, 0.1, 0.2, 0.3],
                "lr_scale": [0.5, 1.0, 2.0]}

    def model(self, config: dict[str, Any]) -> nn.Module:
        layers: list[nn.Module] = []
        width = 64
        for h in config["hidden"]:
            layers += [nn.Linear(width, h), nn.ReLU(), nn.Dropout(config["dropout"])]
            width = h
        layers.append(nn.Linear(width, 10))
        return nn.Sequential(*layers)
