"""The data plane: datasets pushed to the object store as Parquet chunks and a versioned index.

``tensorturn data push SOURCE --name NAME`` reads a local dataset (:mod:`.readers`: a table, a
folder of images or text, a saved Hugging Face dataset), shuffles its rows once (``--seed``),
splits them into train/validation/test (:mod:`.splits`), and writes each split as Parquet chunks
of about ``--chunk-mb`` (zstd) under ``datasets/chunks/<sha256>.parquet`` — content-addressed, so
a chunk that did not change is stored once — plus an index ``datasets/<name>/v<NNNN>.json``
naming every chunk with its sha256, rows and bytes (:mod:`.upload`, :mod:`.index`). Why Parquet
through TensorTurn's own store and cache, rather than a streaming library: docs/data-plane.md
(measured side by side).

Machines read datasets through :mod:`.source` and :mod:`.cache`: only the chunks asked for,
verified against their sha256, kept under a byte budget.

This package's face is what the CLI, the recipes and the tests use as ``datasets.X``.
"""

from tensorturn.data.index import FORMAT, NAME, check_name, names, remove, show, summary, versions
from tensorturn.data.readers import IMAGE_SUFFIXES, MAX_IMAGE_PIXELS, SKIPPED_SHOWN, links_out, read_source
from tensorturn.data.splits import MAX_CLASSES, SPLIT_NAMES, SPLITS
from tensorturn.data.upload import push

__all__ = [
    "FORMAT", "IMAGE_SUFFIXES", "MAX_CLASSES", "MAX_IMAGE_PIXELS", "NAME", "SKIPPED_SHOWN", "SPLITS",
    "SPLIT_NAMES", "check_name", "links_out", "names", "push", "read_source", "remove", "show",
    "summary", "versions",
]
