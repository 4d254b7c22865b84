"""A machine's cache of dataset chunks: only the chunks asked for, verified, under a byte budget.

Chunks are content-addressed (their name is their sha256), so a cached file is either exactly
the chunk or damaged — never stale. A file is checked against its sha256 when it is downloaded;
a damaged download is fetched once more, then it is one clear error naming the chunk (the store
holds a bad copy). The least recently used chunks are removed when the cache would exceed its
budget; several processes of one machine share the cache (a lock file serialises changes).

The cache holds what the store keeps private, so it is as private: its folder 0700 and its files
0600 from their first byte, and a cache left by an older version is made so when it is opened.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from filelock import FileLock

from tensorturn import layout, platforms
from tensorturn.errors import StoreError
from tensorturn.store.objects import Store

log = logging.getLogger(__name__)

ORPHAN_AGE_S = 3600
DEFAULT_DIR = platforms.cache_dir()
SHA256 = re.compile(r"[0-9a-f]{64}")


class ChunkError(StoreError):
    """A chunk that cannot be had intact."""


class ChunkCache:
    def __init__(self, directory: Path | str = DEFAULT_DIR, budget_bytes: int = 4 * 1024 ** 3):
        self.dir = Path(directory)
        self.budget = int(budget_bytes)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._make_private()
        self.hits = self.misses = self.bytes_downloaded = 0
        self._mine = threading.local()  # this thread's figures (prefetching runs beside training)
        self._remove_orphans()

    def _make_private(self) -> None:
        """The folder 0700 and every file in it 0600 (mkdir's mode only applies to a new folder,
        and an older version left them 755/644); a folder of another user's is left as it is."""
        try:
            self.dir.chmod(0o700)
            for p in self.dir.iterdir():
                with suppress(FileNotFoundError):  # evicted by another process meanwhile
                    mode = p.lstat().st_mode
                    if stat.S_ISREG(mode) and mode & 0o077:
                        p.chmod(0o600)
        except PermissionError:
            log.warning("the chunk cache %s belongs to another user: its modes are left as they are", self.dir)

    def _remove_orphans(self) -> None:
        """Remove partial downloads (``.<sha>.<pid>``) of processes that died writing them — an
        hour old at least, since a cache folder shared between containers sees other PIDs."""
        for tmp in self.dir.glob(".*.*"):
            pid = tmp.name.rpartition(".")[2]
            try:
                if not pid.isdigit() or time.time() - tmp.stat().st_mtime < ORPHAN_AGE_S:
                    continue
            except FileNotFoundError:
                continue
            if not platforms.pid_alive(int(pid)):
                tmp.unlink(missing_ok=True)

    def thread_bytes(self) -> tuple[int, int]:
        """(downloaded, read): bytes this thread has downloaded into the cache, and bytes of
        chunks it has read from it (cached or not)."""
        return getattr(self._mine, "downloaded", 0), getattr(self._mine, "read", 0)

    @contextmanager
    def _locked(self):
        with FileLock(self.dir / ".lock", mode=0o600):  # flock on POSIX, LockFileEx on Windows
            yield

    def path(self, store: Store, chunk: dict[str, Any]) -> Path:
        """The local file of ``chunk`` (an index entry: sha256, bytes), downloaded if needed.
        Another process may evict it once this returns: :meth:`read` holds on to it."""
        with self._locked():
            return self._get(store, chunk)

    def _get(self, store: Store, chunk: dict[str, Any]) -> Path:
        sha = chunk.get("sha256")
        if not isinstance(sha, str) or not SHA256.fullmatch(sha):  # the index is not signed
            raise ChunkError(f"a dataset index names a chunk {str(sha)[:70]!r}, not a sha256")
        target = self.dir / f"{sha}.parquet"
        if target.exists():
            os.utime(target)  # most recently used
            self.hits += 1
            return target
        self.misses += 1
        data = self._download(store, sha)
        self._make_room(len(data))
        tmp = target.with_name(f".{sha}.{os.getpid()}")
        tmp.unlink(missing_ok=True)  # a leftover of this PID's namesake, which O_EXCL would refuse
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(data)
        os.replace(tmp, target)
        return target

    def _download(self, store: Store, sha: str) -> bytes:
        for _ in range(2):  # a damaged transfer is fetched once more
            data = store.get_bytes(layout.key("chunk", sha))
            self.bytes_downloaded += len(data)
            self._mine.downloaded = self.thread_bytes()[0] + len(data)
            if hashlib.sha256(data).hexdigest() == sha:
                return data
        raise ChunkError(f"dataset chunk {sha[:12]}… in the store does not match its sha256 "
                         f"(downloaded twice): the store holds a damaged copy; push the dataset again")

    def _make_room(self, incoming: int) -> None:
        files = sorted((p for p in self.dir.glob("*.parquet")), key=lambda p: p.stat().st_mtime)
        used = sum(p.stat().st_size for p in files)
        while files and used + incoming > self.budget:
            oldest = files.pop(0)
            used -= oldest.stat().st_size
            oldest.unlink(missing_ok=True)

    def used_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.dir.glob("*.parquet"))

    def has(self, chunk: dict[str, Any]) -> bool:
        """Whether ``chunk`` is in the cache now (another process may evict it later)."""
        sha = chunk.get("sha256")
        return isinstance(sha, str) and SHA256.fullmatch(sha) is not None and \
            (self.dir / f"{sha}.parquet").exists()

    def warm(self, store: Store, chunks: list[dict[str, Any]]) -> None:
        """Download ``chunks`` into the cache unless there (prefetching: nothing is read)."""
        for chunk in chunks:
            with self._locked():
                self._get(store, chunk)

    def read(self, store: Store, chunk: dict[str, Any]):
        """The chunk as an Arrow table, memory-mapped from the cache (opened under the lock: once
        mapped, the table outlives an eviction of its file)."""
        import pyarrow.parquet as pq

        with self._locked():
            path = self._get(store, chunk)
            self._mine.read = self.thread_bytes()[1] + path.stat().st_size
            return pq.read_table(path, memory_map=True)
