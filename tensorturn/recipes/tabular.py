"""Built-in recipe ``tabular``: an MLP over the numeric columns of a pushed table.

    tensorturn data push houses.csv --name houses --label price
    tensorturn run --recipe tabular --recipe-option dataset=houses

An integer label is a classification (as many classes as its largest value + 1), any other a
regression. Features are standardised with the train split's mean and std, recorded at push. In
a fused run each shard reads only its own rows' chunks (:meth:`shard_data`), and evaluation
streams the split chunk by chunk; other uses (an ensemble, ``check-recipe``) read the whole
dataset, which must then fit in memory.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from tensorturn.errors import RecipeError
from tensorturn.recipes.pushed import PushedRecipe


class Tabular(PushedRecipe):
    name = "tabular"
    lr = 3e-3
    batch_size = 64

    def __init__(self, dataset: str, version: int | None = None, hidden: list[int] | None = None):
        super().__init__(dataset, version)
        self.hidden = list(hidden or [64, 64])
        stats = self.index["stats"]
        others = [c for c in self.index["features"] if c not in stats["numeric"]]
        if others:
            raise RecipeError(f"dataset {dataset!r}: columns {', '.join(others)} are not numeric; "
                              f"encode them as numbers (or drop them) before pushing")
        self.features, self.label = stats["numeric"], self.index["label"]
        self._mean = torch.tensor(stats["mean"], dtype=torch.float32)
        self._std = torch.tensor(stats["std"], dtype=torch.float32)
        self.task = self.index.get("task") or ("classification" if self.index.get("classes") else "regression")
        self.num_classes = self.index.get("classes") if self.task == "classification" else None
        # a text (or boolean) label's values, by class number; served as class_name
        self.classes = self.index.get("class_names") if self.task == "classification" else None

    def tensors(self, table: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if table.num_rows:
            x = np.stack([table.column(c).to_numpy(zero_copy_only=False).astype(np.float32)
                          for c in self.features], axis=1)
            y = table.column(self.label).to_numpy(zero_copy_only=False)
        else:
            x, y = np.zeros((0, len(self.features)), np.float32), np.zeros(0)
        y_t = torch.from_numpy(np.array(y, np.int64 if self.num_classes else np.float32))  # a writable copy
        return torch.from_numpy(np.ascontiguousarray(x)), y_t

    def input_shape(self) -> list[int]:
        return [len(self.features)]

    def preprocess(self, raw: torch.Tensor) -> torch.Tensor:
        return (raw.float() - self._mean) / self._std

    def default_config(self) -> dict[str, Any]:
        return {"hidden": self.hidden}

    def config_space(self) -> dict[str, list[Any]]:
        return {"hidden": [[32], [64], [64, 64], [128, 64]], "lr_scale": [0.5, 1.0, 2.0]}

    def model(self, config: dict[str, Any]) -> nn.Module:
        layers: list[nn.Module] = []
        width = len(self.features)
        for h in config["hidden"]:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, self.num_classes or 1))
        return nn.Sequential(*layers)
