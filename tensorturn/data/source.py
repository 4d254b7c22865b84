"""Reading a pushed dataset on a machine: only the rows asked for, through the machine's cache.

A split's rows are numbered in the order they were pushed (shuffled once, at push), across its
chunks; :meth:`Dataset.read` returns rows ``[start, stop)`` and downloads only the chunks that
hold them. A fused shard reads one contiguous range of whole chunks where the split has at least
as many chunks as the run has shards (:func:`shard_bounds`), so which chunks a shard needs is
fixed by the dataset and the run's shard count — never by which machine runs it — and no chunk
is read by two shards.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from functools import lru_cache
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tensorturn import config
from tensorturn.data.cache import DEFAULT_DIR, ChunkCache
from tensorturn.data.index import read

if TYPE_CHECKING:
    import pyarrow as pa

    from tensorturn.store.objects import Store


@lru_cache(maxsize=1)
def machine_cache() -> ChunkCache:
    """This machine's chunk cache (``TENSORTURN_CACHE_DIR``, ``TENSORTURN_CACHE_GB``)."""
    settings = config.current()
    return ChunkCache(Path(settings.cache_dir) if settings.cache_dir else DEFAULT_DIR,
                      int(settings.cache_gb * 1024 ** 3))


def shard_bounds(chunk_rows: list[int], shards: int) -> list[int]:
    """Where each of ``shards`` contiguous shards of a split starts (and, last, where the split
    ends), given its chunks' row counts: at the chunk edge nearest an even split, or — with fewer
    chunks than shards, or edges so uneven that a shard would get less than half its share — at
    the even split."""
    total = sum(chunk_rows)
    even = [k * total // shards for k in range(shards + 1)]
    edges = list(accumulate(chunk_rows, initial=0))
    if len(chunk_rows) < shards:
        return even
    def nearest(b: int) -> int:  # the edge nearest b, the lower one on a tie
        i = bisect_left(edges, b)
        return edges[i] if i == 0 or (i < len(edges) and edges[i] - b < b - edges[i - 1]) else edges[i - 1]

    bounds = [nearest(b) for b in even]
    if any(hi - lo < max(total / shards / 2, 1) for lo, hi in zip(bounds, bounds[1:])):
        return even  # a shard would get less than half its share: uneven chunks
    return bounds


# Where a Dataset built without a store reads: this machine's store, unless a caller holding the
# dataset's index elsewhere says so while it builds a recipe (:func:`reading_from`; an exported
# model folder carries the index its recipe's preprocessing needs). A context variable, not the
# process's settings: it ends with the call and is seen by no other thread.
_READ_FROM: ContextVar[Store | None] = ContextVar("tensorturn_dataset_store", default=None)


@contextmanager
def reading_from(store: Store) -> Iterator[None]:
    """Datasets built in this block without a store of their own read ``store``."""
    token = _READ_FROM.set(store)
    try:
        yield
    finally:
        _READ_FROM.reset(token)


# The dataset indexes a run pinned when it started (store key → sha256 of the index's bytes; the
# spec's ``datasets``, signed with it), while a recipe of the run is built: every index read then
# must be one of them, byte for byte — the index names the chunks a shard trains on, and the index
# itself is not sealed. Also what was read, for the run's start to pin.
_PINS: ContextVar[tuple[Mapping[str, str] | None, dict[str, str]] | None] = ContextVar(
    "tensorturn_dataset_pins", default=None)


@contextmanager
def pinned(indexes: Mapping[str, str] | None) -> Iterator[dict[str, str]]:
    """Datasets built in this block read only the indexes in ``indexes`` (key → sha256), with
    those bytes; anything else is refused (TamperedObject naming the index). ``None`` checks
    nothing: a run started before runs pinned their indexes (each index is still checked to name
    its own dataset and version, and each chunk against the sha256 the index gives it). Yields
    the indexes read in the block, key → sha256: what a starting run pins."""
    read_here: dict[str, str] = {}
    token = _PINS.set((indexes, read_here))
    try:
        yield read_here
    finally:
        _PINS.reset(token)


def check_pinned(key: str, sha256: str) -> None:
    """TamperedObject unless the index at ``key`` whose bytes hash to ``sha256`` is one the
    :func:`pinned` block around this call allows; records it as read."""
    from tensorturn.store.seals import TamperedObject

    pins = _PINS.get()
    if pins is None:
        return
    expected, read_here = pins
    read_here[key] = sha256
    if expected is None or expected.get(key) == sha256:
        return
    if key in expected:
        raise TamperedObject(f"the dataset index {key} is not the one the run read when it started "
                             f"(sha256 {sha256[:12]}…, pinned {str(expected[key])[:12]}…): tampered with "
                             f"or rewritten; refused")
    raise TamperedObject(f"the dataset index {key} is not one the run read when it started (it pinned "
                         f"{', '.join(sorted(expected)) or 'none'}); refused")


class Dataset:
    """A version of a pushed dataset, read from this machine's store and cache."""

    def __init__(self, name: str, version: int | None = None, store: Store | None = None,
                 cache: ChunkCache | None = None):
        from tensorturn.store.objects import open_store

        self.store = store or _READ_FROM.get() or open_store(config.current().resolved_store_url())
        self.cache = cache or machine_cache()
        self.index: dict[str, Any]
        self.index, key, sha256 = read(self.store, name, version)
        check_pinned(key, sha256)
        self._bounds: dict[tuple[str, int], list[int]] = {}

    def rows(self, split: str) -> int:
        return int(self.index["rows"][split])

    def shard_range(self, split: str, shards: int, k: int) -> tuple[int, int]:
        """Rows ``[start, stop)`` of shard k of ``shards`` (:func:`shard_bounds`)."""
        key = (split, shards)
        if key not in self._bounds:
            self._bounds[key] = shard_bounds([c["rows"] for c in self.index["splits"][split]], shards)
        return self._bounds[key][k], self._bounds[key][k + 1]

    def chunks(self, split: str, start: int = 0, stop: int | None = None
               ) -> Iterator[tuple[dict[str, Any], int, int]]:
        """(chunk, first row of it, row after its last) of the chunks holding ``[start, stop)``."""
        stop = self.rows(split) if stop is None else stop
        offset = 0
        for chunk in self.index["splits"][split]:
            lo, hi = offset, offset + chunk["rows"]
            offset = hi
            if hi > start and lo < stop:
                yield chunk, lo, hi

    def read(self, split: str, start: int = 0, stop: int | None = None) -> pa.Table:
        """Rows ``[start, stop)`` of ``split`` as one table, from the chunks that hold them."""
        import pyarrow as pa

        stop = self.rows(split) if stop is None else stop
        parts = []
        for chunk, lo, hi in self.chunks(split, start, stop):  # only these are downloaded
            table = self.cache.read(self.store, chunk)
            parts.append(table.slice(max(start - lo, 0), min(stop, hi) - max(start, lo)))
        if not parts:
            return pa.table({})
        return pa.concat_tables(parts)

    def cached(self, split: str, start: int = 0, stop: int | None = None) -> bool:
        """Whether every chunk of rows ``[start, stop)`` is in this machine's cache."""
        return all(self.cache.has(chunk) for chunk, _, _ in self.chunks(split, start, stop))

    def prefetch(self, split: str, start: int = 0, stop: int | None = None) -> None:
        """Bring the chunks of rows ``[start, stop)`` into the cache (a task about to read them);
        nothing when the cache cannot hold twice as much — the shard just read and this one —
        since fetching then evicts what the round still reads, and costs bytes instead of saving them."""
        wanted = [chunk for chunk, _, _ in self.chunks(split, start, stop)]
        if 2 * sum(int(c.get("bytes", 0)) for c in wanted) <= self.cache.budget:
            self.cache.warm(self.store, wanted)

    def batches(self, split: str) -> Iterator[pa.Table]:
        """The split chunk by chunk (what evaluation streams over)."""
        for chunk in self.index["splits"][split]:
            yield self.cache.read(self.store, chunk)
