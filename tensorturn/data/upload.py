"""``tensorturn data push``: a local dataset read, shuffled once, split, and stored as the next
version of a named dataset — Parquet chunks of about ``--chunk-mb`` (zstd) under
``datasets/chunks/<sha256>.parquet``, content-addressed so a chunk that did not change is stored
once, and an index ``datasets/<name>/v<NNNN>.json`` naming every chunk with its sha256, rows and
bytes. Nothing is stored when the dataset cannot be read or split.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorturn import layout
from tensorturn.data.index import FORMAT, check_name, versions
from tensorturn.data.readers import read_source
from tensorturn.data.splits import SPLITS, empty_split, label_table, split_text, table_stats
from tensorturn.errors import SpecError

if TYPE_CHECKING:
    import pyarrow as pa

    from tensorturn.store.objects import Store


def _parquet_bytes(table: pa.Table) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = pa.BufferOutputStream()
    # no dictionary encoding: it bloats float columns (docs/data-plane.md); zstd compresses
    pq.write_table(table, out, compression="zstd", use_dictionary=False)
    return out.getvalue().to_pybytes()


def _chunks(table: pa.Table, chunk_bytes: int) -> list[pa.Table]:
    """``table`` cut into slices of about ``chunk_bytes`` of Arrow data (at least one row)."""
    if table.num_rows == 0:
        return []
    per_row = max(1, table.nbytes // table.num_rows)
    rows = max(1, chunk_bytes // per_row)
    return [table.slice(i, rows) for i in range(0, table.num_rows, rows)]


def push(store: Store, source: str, name: str, label: str | None = None, task: str | None = None,
         seed: int = 0,
         val_fraction: float = 0.1, test_fraction: float = 0.1, chunk_mb: float = 16.0,
         image_size: tuple[int, int] | None = None, include: tuple[str, ...] = (),
         on_chunk: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Push ``source`` as the next version of dataset ``name``; returns its index. Nothing is
    stored when a split whose fraction is above zero would be empty (a SpecError says why)."""
    import numpy as np

    check_name(name)
    if not (0 <= val_fraction < 1 and 0 <= test_fraction < 1 and val_fraction + test_fraction < 1):
        raise SpecError("--val-fraction and --test-fraction must be in [0, 1) and leave rows to train on")
    try:
        table, about = read_source(source, label, image_size, tuple(include))
    except SpecError:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed file, in one line
        text = " ".join(str(exc).split())[:300]
        raise SpecError(f"{source}: cannot read it: {type(exc).__name__}: {text}") from None
    n = table.num_rows
    if n == 0:
        raise SpecError(f"{source}: the dataset is empty")
    if about["kind"] == "text" and "files" in about:  # a folder: split by characters, not files
        table, cuts, about["split_by"] = split_text(table, seed, val_fraction, test_fraction, source)
    else:
        order = np.random.default_rng(seed).permutation(n)  # rows shuffled once: chunks are iid
        n_test, n_val = int(round(n * test_fraction)), int(round(n * val_fraction))
        cuts = {"test": order[:n_test], "val": order[n_test:n_test + n_val], "train": order[n_test + n_val:]}
        if len(cuts["train"]) == 0:
            raise SpecError(f"{source}: {n} rows leave none to train on")
        about["split_by"] = "row"
    if about["kind"] == "table":
        table, labelled = label_table(table, about, task)
        about.update(labelled, **table_stats(table.take(cuts["train"]), about))
    for split, fraction in (("val", val_fraction), ("test", test_fraction)):
        if fraction > 0 and len(cuts[split]) == 0:  # (a text folder's split never gets here empty)
            raise empty_split(source, n, split, fraction)
    pieces = {split: _chunks(table.take(rows), int(chunk_mb * 1024 * 1024)) for split, rows in cuts.items()}
    total = sum(len(p) for p in pieces.values())
    done = 0
    splits: dict[str, list[dict[str, Any]]] = {}
    for split in SPLITS:
        entries = []
        for piece in pieces[split]:
            data = _parquet_bytes(piece)
            sha = hashlib.sha256(data).hexdigest()
            key = layout.key("chunk", sha)
            if not store.exists(key):  # content-addressed: an unchanged chunk is stored once
                store.put_bytes(key, data)
            entries.append({"sha256": sha, "rows": piece.num_rows, "bytes": len(data)})
            done += 1
            if on_chunk:
                on_chunk(done, total)
        splits[split] = entries
    version = 1 + max((v["version"] for v in versions(store, name)), default=0)
    index = {"format": FORMAT, "name": name, "version": version, "created_at": time.time(),
             "source": Path(source).name, "seed": seed, **about,
             "schema": {f.name: str(f.type) for f in table.schema},
             "rows": {s: sum(c["rows"] for c in splits[s]) for s in SPLITS},
             "bytes": sum(c["bytes"] for s in SPLITS for c in splits[s]), "splits": splits}
    store.put_json(layout.key("dataset", name, version), index)
    return index
