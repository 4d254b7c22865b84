"""The base of recipes that train on a dataset pushed with ``tensorturn data push``.

A subclass says how a table of rows becomes (raw inputs, targets) — :meth:`PushedRecipe.tensors` —
and everything else follows: a fused shard reads only its own rows' chunks
(:meth:`shard_data`), which can be fetched ahead (:meth:`prefetch`); evaluation streams the split
chunk by chunk (:meth:`eval_batches`); other uses (an ensemble, ``check-recipe``) read the whole
dataset (:meth:`raw_data`), which must then fit in memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tensorturn.errors import RecipeError
from tensorturn.recipes.base import Recipe


class PushedRecipe(Recipe):
    kind_of_data = "table"  # what `data push` must have made of the source

    def __init__(self, dataset: str, version: int | None = None):
        from tensorturn.data.source import Dataset

        self.dataset, self.version = dataset, version
        self._data = Dataset(dataset, version)
        found = self._data.index.get("kind")
        if found != self.kind_of_data:
            raise RecipeError(f"dataset {dataset!r} is {found!r} data, not {self.kind_of_data!r}")

    @property
    def index(self) -> dict[str, Any]:
        return self._data.index

    def __repr__(self) -> str:  # what identifies the splits a process caches
        return f"{type(self).__name__}({self.dataset!r}, version={self.index['version']})"

    def pinned_options(self) -> dict[str, Any]:
        return {"version": self.index["version"]}  # a push after the run started changes nothing

    def tensors(self, table: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw inputs and targets of the rows of ``table`` (an Arrow table of the dataset)."""
        raise NotImplementedError

    def raw_data(self):
        out: list[torch.Tensor] = []
        for split in ("train", "val", "test"):
            out.extend(self.tensors(self._data.read(split)))
        return tuple(out)

    def shard_data(self, k: int, shards: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        start, stop = self._data.shard_range("train", shards, k)
        x, y = self.tensors(self._data.read("train", start, stop))
        return self.preprocess(x), y, torch.arange(len(y))

    def cached_shards(self, shards: int) -> list[int]:
        return [k for k in range(shards)
                if self._data.cached("train", *self._data.shard_range("train", shards, k))]

    def prefetch(self, k: int, shards: int) -> None:
        self._data.prefetch("train", *self._data.shard_range("train", shards, k))

    def eval_batches(self, split: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for table in self._data.batches(split):
            x, y = self.tensors(table)
            yield self.preprocess(x), y

    def train_rows(self) -> int:
        return self._data.rows("train")

    def sample_input(self) -> torch.Tensor:
        x, _ = self.tensors(self._data.read("train", 0, 1))
        return self.preprocess(x)

    def sample_rows(self, split: str, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = min(rows, self._data.rows(split))
        if n == 0:  # an empty split: no chunk to read, the columns come from a training row
            x, y = self.tensors(self._data.read("train", 0, 1))
            return self.preprocess(x[:0]), y[:0]
        x, y = self.tensors(self._data.read(split, 0, n))
        return self.preprocess(x), y
