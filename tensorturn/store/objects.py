"""The object store: where weights, pseudo-gradients and manifests live.

Two backends behind one small interface: ``file:///abs/dir`` (a directory; atomic by rename) and
``s3://bucket/prefix`` (boto3; endpoint and credentials from boto3's own ``AWS_*`` environment, so
MinIO, R2 and B2 work). Keys are ``/``-separated relative paths such as
``runs/<id>/global/r0001.safetensors``. Every put returns the sha256 of the bytes as stored, and
transient errors are retried with exponential backoff before they surface as one clear
:class:`StoreError`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import mimetypes
import os
import secrets
import shutil
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TypeVar
from urllib.parse import unquote, urlsplit

from tensorturn import config, layout
from tensorturn.config import mask_url
from tensorturn.errors import StoreError, StoreURLError
from tensorturn.store.links import DOWN, PIECE, UP, Transfer, meter

log = logging.getLogger(__name__)
T = TypeVar("T")


class ObjectMissing(StoreError):
    """The key does not exist in the store."""


def check_key(key: str) -> str:
    """Keys are relative ``/``-separated paths that stay inside the store."""
    if key.startswith("/") or ".." in key.split("/"):
        raise StoreError(f"invalid store key {key!r}")
    return key


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: Path) -> str:
    """The sha256 of a file, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 20):
            digest.update(piece)
    return digest.hexdigest()


_moved = [0, 0]            # bytes this process stored and fetched (object bodies), all stores
_moved_lock = threading.Lock()


_apart = threading.local()   # a thread counting its transfers on its own (counted_apart)


def _count(up: int, down: int) -> None:
    own = getattr(_apart, "moved", None)
    if own is not None:
        own[0] += up
        own[1] += down
        return
    with _moved_lock:
        _moved[0] += up
        _moved[1] += down


@contextlib.contextmanager
def counted_apart() -> Iterator[list[int]]:
    """Bytes this thread moves inside the block are counted in the list it yields ([stored,
    fetched]), not in :func:`moved`: a transfer in the background, beside whatever task the
    process runs meanwhile, whose bytes its own code records."""
    _apart.moved = [0, 0]
    try:
        yield _apart.moved
    finally:
        del _apart.moved


def moved() -> tuple[int, int]:
    """(bytes stored, bytes fetched) by this process so far: every object body through any
    store, whatever the task (a task's share is the difference across it)."""
    with _moved_lock:
        return _moved[0], _moved[1]


class Store(ABC):
    """A flat key → bytes map with atomic puts."""

    url: str
    retries: int = 6           # set from the settings by open_store
    backoff_s: float = 0.5

    @abstractmethod
    def _put(self, key: str, data: bytes, sha256: str) -> None: ...

    @abstractmethod
    def _get(self, key: str) -> bytes: ...

    @abstractmethod
    def _get_range(self, key: str, start: int, stop: int) -> bytes: ...

    @abstractmethod
    def _put_file(self, key: str, path: Path, sha256: str) -> None: ...

    @abstractmethod
    def _get_file(self, key: str, path: Path) -> None: ...

    @abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abstractmethod
    def _list(self, prefix: str) -> list[str]: ...

    @abstractmethod
    def _delete(self, key: str) -> None: ...

    @abstractmethod
    def _sizes(self, prefix: str) -> dict[str, int]: ...

    @abstractmethod
    def _modified(self, prefix: str) -> dict[str, float]: ...

    @abstractmethod
    def _delete_folder(self, prefix: str) -> None: ...

    @abstractmethod
    def uri(self, key: str) -> str:
        """Where an ordinary client finds the object (``s3://bucket/key`` or ``file:///path``)."""

    def _transient(self, exc: BaseException) -> bool:
        return False

    def _retrying(self, what: str, key: str, fn: Callable[[], T]) -> T:
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                return fn()
            except ObjectMissing:
                raise
            except Exception as exc:  # noqa: BLE001 - classified just below
                if not self._transient(exc) or attempt == self.retries:
                    raise StoreError(
                        f"store {mask_url(self.url)}: cannot {what} {key}: {exc}"
                    ) from exc
                log.warning("store %s: %s %s failed (%s); retrying in %.1fs",
                            mask_url(self.url), what, key, exc, delay)
                time.sleep(delay)
                delay = min(delay * 2, 8.0)
        raise AssertionError("unreachable")

    def put_bytes(self, key: str, data: bytes, sha256: str | None = None) -> str:
        """Store ``data``; returns its sha256 (``sha256``, when the caller computed it already)."""
        digest = sha256 or sha256_hex(data)
        with Transfer(UP, len(data)):
            self._retrying("write", key, lambda: self._put(key, data, digest))
        _count(len(data), 0)
        return digest

    def get_bytes(self, key: str) -> bytes:
        with Transfer(DOWN) as moving:
            data = self._retrying("read", key, lambda: self._get(key))
            moving.nbytes = len(data)
        _count(0, len(data))
        return data

    def put_file(self, key: str, path: Path | str, sha256: str | None = None) -> str:
        """Store a local file's bytes without reading them into memory (S3: a multipart upload,
        its parts retried; the object appears whole or not at all). Returns their sha256
        (``sha256``, when the caller hashed the file already: a model-sized file is read once)."""
        path = Path(path)
        digest = sha256 or file_sha256(path)
        size = path.stat().st_size
        with Transfer(UP, size):
            self._retrying("write", key, lambda: self._put_file(key, path, digest))
        _count(size, 0)
        return digest

    def get_file(self, key: str, path: Path | str) -> None:
        """Write an object to a local file without holding it in memory (S3: ranged parts)."""
        with Transfer(DOWN) as moving:
            self._retrying("read", key, lambda: self._get_file(key, Path(path)))
            moving.nbytes = Path(path).stat().st_size
        _count(0, moving.nbytes)

    def get_range(self, key: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of an object (unverified: its sha256 covers the whole)."""
        with Transfer(DOWN) as moving:
            data = self._retrying("read", key, lambda: self._get_range(key, start, stop))
            moving.nbytes = len(data)
        _count(0, len(data))
        return data

    def exists(self, key: str) -> bool:
        return self._retrying("look up", key, lambda: self._exists(key))

    def list(self, prefix: str) -> list[str]:
        """Keys under ``prefix``, sorted."""
        return sorted(self._retrying("list", prefix, lambda: self._list(prefix)))

    def delete(self, key: str) -> None:
        self._retrying("delete", key, lambda: self._delete(key))

    def sizes(self, prefix: str) -> dict[str, int]:
        """Keys under ``prefix`` with their sizes in bytes."""
        return self._retrying("list", prefix, lambda: self._sizes(prefix))

    def modified(self, prefix: str) -> dict[str, float]:
        """Keys under ``prefix`` with when they were last written, on the store's own clock
        (S3's LastModified; a file's mtime, which its file server sets)."""
        return self._retrying("list", prefix, lambda: self._modified(prefix))

    def now(self) -> float:
        """The store's clock now: the time it gives an empty object written for the purpose
        (then removed). What a time a machine wrote is compared with, on another machine."""
        probe = layout.key("clock", secrets.token_hex(8))
        self.put_bytes(probe, b"")
        try:
            return self.modified(probe)[probe]
        finally:
            self.delete(probe)

    def delete_folder(self, prefix: str) -> None:
        """Delete every object under ``prefix``, a folder (``runs/<id>/``)."""
        if not prefix.endswith("/"):  # `runs/ab` would also be the start of `runs/abc/...`
            raise StoreError(f"invalid store folder {prefix!r}: it must end with /")
        self._retrying("delete", prefix, lambda: self._delete_folder(check_key(prefix)))

    def put_json(self, key: str, obj: Any) -> str:
        return self.put_bytes(key, json.dumps(obj, indent=2, sort_keys=True).encode())

    def get_json(self, key: str) -> Any:
        return json.loads(self.get_bytes(key))

    def check(self) -> None:
        """Write, read and delete a probe object; raise StoreError if the store is unusable."""
        key = f"probe/{os.getpid()}-{time.time_ns()}"
        self.put_bytes(key, b"ok")
        if self.get_bytes(key) != b"ok":
            raise StoreError(f"store {mask_url(self.url)}: a probe object read back wrong")
        self.delete(key)


class FileStore(Store):
    """A directory. Puts write a temporary file beside the target and rename it into place."""

    def __init__(self, url: str):
        self.url = url
        self.root = Path(unquote(urlsplit(url).path))

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _put(self, key: str, data: bytes, sha256: str) -> None:
        def write(f: BinaryIO) -> None:
            view = memoryview(data)
            for i in range(0, len(view), PIECE):  # at the owner's cap, piece by piece
                meter.pace(UP, len(view[i:i + PIECE]))
                f.write(view[i:i + PIECE])

        self._write(key, write)

    def _put_file(self, key: str, path: Path, sha256: str) -> None:
        def copy(f: BinaryIO) -> None:
            with open(path, "rb") as source:
                if meter.cap(UP):
                    _paced_copy(source, f, UP)
                else:
                    shutil.copyfileobj(source, f, PIECE)

        self._write(key, copy)

    def _write(self, key: str, fill: Callable[[BinaryIO], Any]) -> None:
        """Write an object through a temporary file renamed into place: it appears whole."""
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _get_file(self, key: str, path: Path) -> None:
        try:
            if not meter.cap(DOWN):
                shutil.copyfile(self._path(key), path)
                return
            with open(self._path(key), "rb") as source, open(path, "wb") as target:
                _paced_copy(source, target, DOWN)
        except FileNotFoundError:
            raise ObjectMissing(f"store {self.url}: no object {key}") from None

    def _get(self, key: str) -> bytes:
        try:
            if not meter.cap(DOWN):
                return self._path(key).read_bytes()
            with open(self._path(key), "rb") as f:
                out = bytearray()
                _paced_copy(f, out, DOWN)
                return bytes(out)
        except FileNotFoundError:
            raise ObjectMissing(f"store {self.url}: no object {key}") from None

    def _get_range(self, key: str, start: int, stop: int) -> bytes:
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                data = f.read(stop - start)
        except FileNotFoundError:
            raise ObjectMissing(f"store {self.url}: no object {key}") from None
        meter.pace(DOWN, len(data))
        return data

    def _exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def _list(self, prefix: str) -> list[str]:
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        if base.is_file():
            return [prefix]
        if not base.is_dir():
            return []
        return [p.relative_to(self.root).as_posix() for p in base.rglob("*")
                if p.is_file() and not p.name.startswith(".")]

    def _delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def _sizes(self, prefix: str) -> dict[str, int]:
        return {key: self._path(key).stat().st_size for key in self._list(prefix)}

    def _modified(self, prefix: str) -> dict[str, float]:
        return {key: self._path(key).stat().st_mtime for key in self._list(prefix)}

    def _delete_folder(self, prefix: str) -> None:
        folder = self._path(prefix.rstrip("/"))
        if folder.is_dir():  # the temporary files of an interrupted put with it
            shutil.rmtree(folder)

    def uri(self, key: str) -> str:
        return self._path(key).as_uri()


class S3Store(Store):
    """An S3-compatible bucket (AWS, MinIO, R2, B2) through boto3."""

    def __init__(self, url: str):
        import boto3
        from botocore.config import Config

        self.url = url
        parts = urlsplit(url)
        self.bucket = parts.netloc
        self.prefix = parts.path.strip("/")
        self.client = boto3.client("s3", config=Config(
            connect_timeout=5, read_timeout=60,
            retries={"max_attempts": 2, "mode": "standard"},
        ))

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _transient(self, exc: BaseException) -> bool:
        from boto3.exceptions import RetriesExceededError, S3UploadFailedError
        from botocore.exceptions import ClientError, ConnectionError, HTTPClientError

        if isinstance(exc, (ConnectionError, HTTPClientError, RetriesExceededError)):
            return True
        if isinstance(exc, S3UploadFailedError):  # the transfer manager wraps the part's error
            inner = exc.__cause__ or exc.__context__
            return inner is None or self._transient(inner)
        if isinstance(exc, ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            code = exc.response.get("Error", {}).get("Code", "")
            return status >= 500 or code in {"SlowDown", "RequestTimeout", "Throttling"}
        return False

    def _put(self, key: str, data: bytes, sha256: str) -> None:
        if meter.cap(UP) and len(data) > PIECE:  # under a cap, streamed at it (s3transfer's limiter)
            self.client.upload_fileobj(io.BytesIO(data), self.bucket, self._key(key), Config=transfer_config(),
                                       ExtraArgs=_object_args(key, sha256), Callback=_pacer(UP))
            return
        meter.pace(UP, len(data))  # a small body is paced as a whole, before it goes
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, **_object_args(key, sha256))

    def _get(self, key: str) -> bytes:
        from botocore.exceptions import ClientError

        try:
            if meter.cap(DOWN):  # under a cap, streamed at it (s3transfer's limiter)
                body = io.BytesIO()
                self.client.download_fileobj(self.bucket, self._key(key), body, Config=transfer_config(),
                                             Callback=_pacer(DOWN))
                return body.getvalue()
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in {"NoSuchKey", "404", "NotFound"}:
                raise ObjectMissing(f"store {self.url}: no object {key}") from None
            raise

    def _put_file(self, key: str, path: Path, sha256: str) -> None:
        self.client.upload_file(str(path), self.bucket, self._key(key), Config=transfer_config(),
                                Callback=_pacer(UP),
                                ExtraArgs=_object_args(key, sha256))

    def _get_file(self, key: str, path: Path) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.download_file(self.bucket, self._key(key), str(path), Config=transfer_config(),
                                      Callback=_pacer(DOWN))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in {"NoSuchKey", "404", "NotFound"}:
                raise ObjectMissing(f"store {self.url}: no object {key}") from None
            raise

    def _get_range(self, key: str, start: int, stop: int) -> bytes:
        from botocore.exceptions import ClientError

        try:
            data = self.client.get_object(Bucket=self.bucket, Key=self._key(key),
                                          Range=f"bytes={start}-{stop - 1}")["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in {"NoSuchKey", "404"}:
                raise ObjectMissing(f"store {self.url}: no object {key}") from None
            raise
        meter.pace(DOWN, len(data))
        return data

    def _exists(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in {"NoSuchKey", "404", "NotFound"}:
                return False
            raise

    def _list(self, prefix: str) -> list[str]:
        return list(self._sizes(prefix))

    def _delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def _sizes(self, prefix: str) -> dict[str, int]:
        return {key: int(obj["Size"]) for key, obj in self._objects(prefix)}

    def _modified(self, prefix: str) -> dict[str, float]:
        return {key: obj["LastModified"].timestamp() for key, obj in self._objects(prefix)}

    def _objects(self, prefix: str) -> list[tuple[str, dict[str, Any]]]:
        strip = len(self.prefix) + 1 if self.prefix else 0
        return [(obj["Key"][strip:], obj)
                for page in self.client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=self._key(prefix))
                for obj in page.get("Contents", [])]

    def _delete_folder(self, prefix: str) -> None:
        keys = [self._key(key) for key in self._sizes(prefix)]
        for i in range(0, len(keys), 1000):  # S3 deletes at most 1000 keys a request
            answer = self.client.delete_objects(Bucket=self.bucket, Delete={
                "Objects": [{"Key": key} for key in keys[i:i + 1000]], "Quiet": True})
            if answer.get("Errors"):
                error = answer["Errors"][0]
                raise RuntimeError(f"{error.get('Key')}: {error.get('Code')} {error.get('Message')}")

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"


_BACKENDS: dict[str, Callable[[str], Store]] = {"file": FileStore, "s3": S3Store}


def _object_args(key: str, sha256: str) -> dict[str, Any]:
    """What an S3 object is stored with besides its body: its sha256, and its content type from
    its name (``application/json`` for a record, so a browser or the AWS console shows it as
    such; ``application/octet-stream`` for weights and anything unknown)."""
    kind = mimetypes.guess_type(key, strict=False)[0] or "application/octet-stream"
    return {"Metadata": {"sha256": sha256}, "ContentType": kind}


def transfer_config() -> Any:
    """boto3's transfer manager: objects over 4 parts move in parts of ``TENSORTURN_PART_MB``
    (16 MiB), 4 at a time, each part retried on its own; memory holds a few parts, never the
    object. An upload interrupted half way leaves no object (S3 assembles it only at the end)."""
    from boto3.s3.transfer import TransferConfig

    part = int(max(config.current().part_mb, 5) * 1024 ** 2)  # S3's smallest part is 5 MiB
    return TransferConfig(multipart_threshold=4 * part, multipart_chunksize=part,
                          max_concurrency=4, use_threads=True)


def _pacer(direction: str) -> Callable[[int], None] | None:
    """The transfer manager's progress callback, under an owner's cap: it runs on the thread
    that moves the bytes, as they go (an upload's as they are sent, not while botocore reads
    the body for its checksum; a download's as they arrive), so waiting in it holds the
    transfer to the cap — one bucket for every part in flight and for the folder store's
    pieces, whose rate a cap changed mid-transfer sets at once (s3transfer's ``max_bandwidth``
    is fixed per transfer; measured on moto the two rates were the same). A retried part
    reports its bytes back as negative: nothing is given back."""
    if not meter.cap(direction):
        return None
    return lambda n: meter.pace(direction, n)


def _paced_copy(source: BinaryIO, target: Any, direction: str) -> None:
    """Copy ``source`` into ``target`` (a file, or a bytearray) in pieces, each under the cap."""
    while piece := source.read(PIECE):
        meter.pace(direction, len(piece))
        if isinstance(target, bytearray):
            target += piece
        else:
            target.write(piece)


def check_store_url(url: str) -> None:
    """StoreURLError, in one line, unless ``url`` names a store this could open (a known scheme;
    S3: a bucket) — looked at before anything starts: nothing is reached."""
    parts = urlsplit(url)
    if parts.scheme not in _BACKENDS:
        raise StoreURLError(f"unsupported store URL {mask_url(url)!r}: use file:///dir or s3://bucket/prefix")
    if parts.scheme == "s3" and not parts.netloc:
        raise StoreURLError(f"store URL {mask_url(url)!r} names no bucket (expected s3://bucket/prefix)")


def open_store(url: str, settings: config.Settings | None = None) -> Store:
    """The store for ``url``, retrying as ``settings`` say; StoreURLError for a URL written wrong
    (:func:`check_store_url`)."""
    check_store_url(url)
    settings = settings or config.current()
    store = _BACKENDS[urlsplit(url).scheme](url)
    store.retries, store.backoff_s = settings.store_retries, settings.store_backoff_s
    return store
