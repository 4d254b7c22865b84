"""Built-in recipe ``textlm``: ``charlm``'s transformer over a pushed text dataset, byte-level.

    tensorturn data push books/ --name books          (a folder of UTF-8 text files)
    tensorturn run --recipe textlm --recipe-option dataset=books

Each split's documents (the split was made at push: whole files, or the files cut by position
when they are too few) are joined and read as UTF-8 bytes, so the vocabulary is the 256 byte
values whatever the text; inputs are windows of ``context`` byte ids, and the model predicts the
next byte. Options as ``charlm``'s, plus
``dataset`` and ``version``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tensorturn.errors import RecipeError
from tensorturn.recipes.charlm import MAX_EVAL_WINDOWS, ByteVocabulary, CharLM, windows


class TextLM(ByteVocabulary, CharLM):
    name = "textlm"

    def __init__(self, dataset: str, version: int | None = None, context: int = 64, n_layer: int = 2,
                 n_head: int = 4, n_embd: int = 128, dropout: float = 0.0):
        from tensorturn.data.source import Dataset

        super().__init__(None, context, n_layer, n_head, n_embd, dropout)
        self.dataset, self.version = dataset, version
        self._data = Dataset(dataset, version)  # (a language model reads its splits whole)
        if self._data.index.get("kind") != "text":
            raise RecipeError(f"dataset {dataset!r} is {self._data.index.get('kind')!r} data, not text "
                              f"(push a folder of text files)")

    def __repr__(self) -> str:
        return f"TextLM({self.dataset!r}, version={self._data.index['version']}, context={self.context})"

    def pinned_options(self) -> dict[str, Any]:
        return {"version": self._data.index["version"]}

    def _ids(self, split: str) -> torch.Tensor:
        docs = [t for table in self._data.batches(split) for t in table.column("text").to_pylist()]
        return self.encode("\n".join(docs))

    def raw_data(self):
        out: list[torch.Tensor] = []
        for split in ("train", "val", "test"):
            x, y = windows(self._ids(split), self.context, None if split == "train" else MAX_EVAL_WINDOWS)
            if len(x) == 0:
                need = math.ceil(self.context + 1)
                raise ValueError(f"dataset {self.dataset!r}: its {split} split has fewer than {need} bytes "
                                 f"of text, too short for windows of {self.context}: push more text, or "
                                 f"pass a smaller --recipe-option context=N")
            out += [x, y]
        return tuple(out)
