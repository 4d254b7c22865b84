"""Reading a pushed dataset on a machine: only the rows asked for, through the machine's cache.

A split's rows are numbered in the order they were pushed (shuffled once, at push), across its
chunks; :meth:`Dataset.read` returns rows ``[start, stop)`` and downloads only the chunks that
hold them. A fused shard reads one contiguous range (:func:`shard_range`), so which chunks a
shard needs is fixed by the dataset and the run's shard count — never by which machine runs it.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import config
from . import show
from .cache import DEFAULT_DIR, ChunkCache

if TYPE_CHECKING:
    import pyarrow as pa

    from ..store import Store


@lru_cache(maxsize=1)
def machine_cache() -> ChunkCache:
    """This machine's chunk cache (``TENSORTURN_CACHE_DIR``, ``TENSORTURN_CACHE_GB``)."""
    settings = config.current()
    return ChunkCache(Path(settings.cache_dir) if settings.cache_dir else DEFAULT_DIR,
                      int(settings.cache_gb * 1024 ** 3))


def shard_range(rows: int, shards: int, k: int) -> tuple[int, int]:
    """Shard k's rows of a split of ``rows``: one contiguous range, the shards' sizes within one."""
    return k * rows // shards, (k + 1) * rows // shards


class Dataset:
    """A version of a pushed dataset, read from this machine's store and cache."""

    def __init__(self, name: str, version: int | None = None, store: Store | None = None,
                 cache: ChunkCache | None = None):
        from ..store import open_store

        self.store = store or open_store(config.current().resolved_store_url())
        self.cache = cache or machine_cache()
        self.index: dict[str, Any] = show(self.store, name, version)

    def rows(self, split: str) -> int:
        return int(self.index["rows"][split])

    def read(self, split: str, start: int = 0, stop: int | None = None) -> pa.Table:
        """Rows ``[start, stop)`` of ``split`` as one table, from the chunks that hold them."""
        import pyarrow as pa

        stop = self.rows(split) if stop is None else stop
        parts, offset = [], 0
        for chunk in self.index["splits"][split]:
            lo, hi = offset, offset + chunk["rows"]
            offset = hi
            if hi <= start or lo >= stop:
                continue  # not needed: not downloaded
            table = self.cache.read(self.store, chunk)
            parts.append(table.slice(max(start - lo, 0), min(stop, hi) - max(start, lo)))
        if not parts:
            return pa.table({})
        return pa.concat_tables(parts)

    def batches(self, split: str) -> Iterator[pa.Table]:
        """The split chunk by chunk (what evaluation streams over)."""
        for chunk in self.index["splits"][split]:
            yield self.cache.read(self.store, chunk)
