"""Built-in recipe ``image-folder``: a small CNN over a pushed folder of images by class.

    tensorturn data push photos/ --name pets --resize 32x32     (photos/<class>/*.png|jpg)
    tensorturn run --recipe image-folder --recipe-option dataset=pets

Raw inputs are the pixels, ``[3, height, width]`` values 0–255 (what a client sends to the served
model); ``preprocess`` scales them to [0, 1] and centres them. Two conv → ReLU → max-pool blocks
(``channels``, default [16, 32]) and a linear layer over the classes. A fused shard decodes only
its own rows' chunks.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from torch import nn

from tensorturn.data import MAX_IMAGE_PIXELS
from tensorturn.errors import RecipeError
from tensorturn.recipes.pushed import PushedRecipe


class ImageFolder(PushedRecipe):
    name = "image-folder"
    kind_of_data = "images"
    lr = 2e-3
    batch_size = 32

    def __init__(self, dataset: str, version: int | None = None, channels: list[int] | None = None):
        super().__init__(dataset, version)
        self.channels = list(channels or [16, 32])
        self.classes: list[str] = list(self.index["classes"])
        self.width, self.height = self.index["image_size"]

    def tensors(self, table: Any) -> tuple[torch.Tensor, torch.Tensor]:
        from PIL import Image

        def decode(blob: bytes) -> np.ndarray:
            image = Image.open(io.BytesIO(blob))
            if image.size != (self.width, self.height) or self.width * self.height > MAX_IMAGE_PIXELS:
                # the store's chunks were changed (a push never stores such an image): a bomb
                # is refused from its header, before it is decoded
                raise RecipeError(f"dataset {self.dataset!r}: a stored image of {image.width}x{image.height} "
                                  f"pixels, where the dataset's are {self.width}x{self.height} (at most "
                                  f"{MAX_IMAGE_PIXELS // 10 ** 6} megapixels); refused")
            return np.asarray(image.convert("RGB"), dtype=np.uint8)

        pixels = [decode(b) for b in table.column("image").to_pylist()]
        x = (np.stack(pixels).transpose(0, 3, 1, 2) if pixels
             else np.zeros((0, 3, self.height, self.width), np.uint8))
        y = np.asarray(table.column("label").to_pylist() if table.num_rows else [], np.int64)
        return torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y)

    def input_shape(self) -> list[int]:
        return [3, self.height, self.width]

    def preprocess(self, raw: torch.Tensor) -> torch.Tensor:
        return raw.float() / 255.0 - 0.5

    def default_config(self) -> dict[str, Any]:
        return {"channels": self.channels}

    def config_space(self) -> dict[str, list[Any]]:
        return {"channels": [[8, 16], [16, 32], [32, 64]], "lr_scale": [0.5, 1.0, 2.0]}

    def model(self, config: dict[str, Any]) -> nn.Module:
        layers: list[nn.Module] = []
        width, size = 3, [self.height, self.width]
        for c in config["channels"]:
            layers += [nn.Conv2d(width, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            width, size = c, [max(1, s // 2) for s in size]
        layers += [nn.Flatten(), nn.Linear(width * size[0] * size[1], len(self.classes))]
        return nn.Sequential(*layers)
