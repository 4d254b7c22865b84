"""Data-plane format benchmark (issue 13): Parquet + our own store/LRU vs litdata, mosaicml-streaming,
webdataset and HF `datasets`, all against a local moto S3 server reached through a custom endpoint URL.

    python benchmarks/data_formats.py                 # all backends that are installed
    python benchmarks/data_formats.py --rows 200000 --text-mb 20 --only parquet,webdataset

What it does
  * starts `python -m moto.server` on a free loopback port and points AWS_ENDPOINT_URL (boto3),
    S3_ENDPOINT_URL (mosaicml-streaming) and litdata's storage_options at it;
  * makes two synthetic data sets in a temp dir: a table (ROWS x 32 float32 features + int64 label)
    and a text corpus (TEXT_MB of pseudo-words in 1-8 KB documents);
  * for every backend, in its own child process (so peak RSS is its own): writes the data as chunks of
    ~CHUNK_MB with the library's own writer (library defaults for compression), uploads them, then times
      - cold: read the rows of ONE chosen chunk (the middle one) into torch tensors, empty cache (S3 GET),
      - warm: the same chunk again, now from the library's / our local cache,
      - scan: every row of the data set, from an empty cache, in order,
    and samples the RSS of the process and its children every 5 ms while reading;
  * checks that the chunk read back equals the source rows (tabular) and prints a table; writes
    benchmarks/results/data_formats.json.

A library that is not installed, or fails, is reported as skipped/failed with the reason; nothing is fatal.
mosaicml-streaming (transformers -> huggingface-hub<1.0) cannot share an environment with datasets 5.x; run it
separately with `--only mosaic --append` (docs/data-plane.md).
Only loopback traffic is measured: moto keeps objects in memory and has no network latency or bandwidth limit.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
BUCKET = "tt-data-bench"
FEAT = 32
ROW_BYTES = FEAT * 4 + 8  # 32 float32 + int64 label
BACKENDS = ["parquet", "parquet-arrowfs", "hf-datasets", "webdataset", "litdata", "mosaic"]
WDS_ROWS_PER_SAMPLE = 256  # webdataset: one tar member per row costs >=1 KiB of tar headers; see docs


# --------------------------------------------------------------------------- helpers

def s3client():
    import boto3
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])


class PeakRSS:
    """Samples RSS of this process + children every 5 ms; .peak_mb after the block."""

    def __init__(self):
        import psutil
        self.proc = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()

    def _rss(self) -> int:
        import psutil
        total = self.proc.memory_info().rss
        for c in self.proc.children(recursive=True):
            try:
                total += c.memory_info().rss
            except (OSError, psutil.Error):
                pass
        return total

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.005)

    def __enter__(self):
        self.peak = self.base = self._rss()
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()
        return self

    def __exit__(self, *a):
        self._stop.set()
        self.t.join()
        self.peak = max(self.peak, self._rss())

    @property
    def peak_mb(self) -> float:
        return self.peak / 2**20


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def upload_dir(local: Path, prefix: str, keyfn=None) -> dict:
    """Upload every file under `local` to s3://BUCKET/prefix/...; returns {relpath: key}."""
    s3 = s3client()
    keys = {}
    for p in sorted(local.rglob("*")):
        if p.is_file():
            rel = p.relative_to(local).as_posix()
            key = f"{prefix}/{keyfn(p, rel) if keyfn else rel}"
            s3.upload_file(str(p), BUCKET, key)
            keys[rel] = key
    return keys


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def fetch(key: str, cache: Path, s3=None) -> Path:
    """The baseline's store layer: a whole-object GET through boto3 into the local cache (atomic rename)."""
    dst = cache / key.rsplit("/", 1)[-1]
    if not dst.exists():
        tmp = dst.with_suffix(dst.suffix + ".part")
        (s3 or s3client()).download_file(BUCKET, key, str(tmp))
        os.replace(tmp, dst)
    return dst


def load_source(work: Path, kind: str):
    if kind == "tab":
        return np.load(work / "X.npy", mmap_mode="r"), np.load(work / "y.npy", mmap_mode="r")
    buf = (work / "text.bin").read_bytes()
    off = np.load(work / "text_off.npy")
    return [buf[off[i]:off[i + 1]].decode() for i in range(len(off) - 1)]


def make_data(work: Path, rows: int, text_mb: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, FEAT), dtype=np.float32)
    y = rng.integers(0, 10, rows, dtype=np.int64)
    np.save(work / "X.npy", X)
    np.save(work / "y.npy", y)
    # text: pseudo-words from a Zipf-ish vocabulary, documents of 1-8 KB
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    vocab = [bytes(letters[rng.integers(0, 26, rng.integers(2, 10))]).decode() for _ in range(5000)]
    p = 1.0 / np.arange(1, 5001)
    p /= p.sum()
    target = text_mb * 2**20
    docs, total = [], 0
    while total < target:
        n = int(rng.integers(150, 1300))
        d = " ".join(vocab[i] for i in rng.choice(5000, n, p=p)) + "\n"
        docs.append(d.encode())
        total += len(docs[-1])
    off = np.cumsum([0] + [len(d) for d in docs]).astype(np.int64)
    (work / "text.bin").write_bytes(b"".join(docs))
    np.save(work / "text_off.npy", off)
    return {"rows": rows, "tab_raw_mb": rows * ROW_BYTES / 2**20, "docs": len(docs), "text_raw_mb": total / 2**20}


def plan_chunks(n: int, per_chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + per_chunk, n)) for a in range(0, n, per_chunk)]


def text_chunks(docs, chunk_bytes: int) -> list[tuple[int, int]]:
    out, a, size = [], 0, 0
    for i, d in enumerate(docs):
        size += len(d.encode()) if isinstance(d, str) else len(d)
        if size >= chunk_bytes:
            out.append((a, i + 1))
            a, size = i + 1, 0
    if a < len(docs):
        out.append((a, len(docs)))
    return out


def to_text_tensor(docs: list[str]):
    """Byte-level LM input: the chunk's documents as one uint8 tensor (tokenising is out of scope)."""
    import torch
    b = "".join(docs).encode()
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in (tensors if isinstance(tensors, tuple) else (tensors,)))


def table_to_tensors(table):
    import torch
    X = np.column_stack([table.column(f"f{i}").to_numpy() for i in range(FEAT)])
    return torch.from_numpy(X), torch.from_numpy(table.column("label").to_numpy())


# --------------------------------------------------------------------------- backends
# Each backend: write(src, out) -> None; publish(out, prefix) -> chunk list (what one chunk means for it);
# read_chunk(k, cache) -> (tensors, n_rows); scan(cache) -> (n_rows, n_bytes_of_tensors).

class ParquetBaseline:
    """Parquet files (pyarrow, zstd) as chunks, content-addressed by sha256, fetched whole with boto3,
    cached on disk (the LRU is the project's; here the cache never fills), read memory-mapped."""
    name = "parquet"

    def __init__(self, kind, chunk_bytes):
        self.kind, self.chunk_bytes = kind, chunk_bytes

    def write(self, src, out: Path):
        import pyarrow as pa
        import pyarrow.parquet as pq
        if self.kind == "tab":
            X, y = src
            ranges = plan_chunks(len(y), self.chunk_bytes // ROW_BYTES)
            for j, (a, b) in enumerate(ranges):
                cols = {f"f{i}": np.ascontiguousarray(X[a:b, i]) for i in range(FEAT)}
                cols["label"] = np.asarray(y[a:b])
                # zstd; no dictionary for float columns (pyarrow's default dictionary-encodes every column
                # and, on high-cardinality floats, stored 92 MB for 65 MB of raw rows with snappy)
                pq.write_table(pa.table(cols), out / f"part-{j:05d}.parquet", compression="zstd",
                               use_dictionary=["label"])
        else:
            for j, (a, b) in enumerate(text_chunks(src, self.chunk_bytes)):
                pq.write_table(pa.table({"text": src[a:b]}), out / f"part-{j:05d}.parquet", compression="zstd",
                               use_dictionary=False)

    def publish(self, out: Path, prefix: str):
        import pyarrow.parquet as pq
        chunks = []
        for p in sorted(out.glob("part-*.parquet")):
            h = sha256_file(p)
            chunks.append({"sha256": h, "key": f"{prefix}/chunks/{h}.parquet", "bytes": p.stat().st_size,
                           "rows": pq.ParquetFile(p).metadata.num_rows})
        s3 = s3client()
        for c, p in zip(chunks, sorted(out.glob("part-*.parquet"))):
            s3.upload_file(str(p), BUCKET, c["key"])
        s3.put_object(Bucket=BUCKET, Key=f"{prefix}/index.json", Body=json.dumps({"chunks": chunks}).encode())
        self.chunks = chunks
        return chunks

    def _read_path(self, path: Path):
        import pyarrow.parquet as pq
        t = pq.read_table(path, memory_map=True)
        if self.kind == "tab":
            return table_to_tensors(t), t.num_rows
        return to_text_tensor(t.column("text").to_pylist()), t.num_rows

    def read_chunk(self, k, cache: Path):
        return self._read_path(fetch(self.chunks[k]["key"], cache))

    def scan(self, cache: Path):
        rows = nbytes = 0
        s3 = s3client()
        with ThreadPoolExecutor(1) as pool:  # prefetch: the next chunk downloads while this one is read
            fut = pool.submit(fetch, self.chunks[0]["key"], cache, s3)
            for k in range(len(self.chunks)):
                path = fut.result()
                if k + 1 < len(self.chunks):
                    fut = pool.submit(fetch, self.chunks[k + 1]["key"], cache, s3)
                tensors, n = self._read_path(path)
                rows += n
                nbytes += tensor_bytes(tensors)
        return rows, nbytes


class ParquetArrowFS(ParquetBaseline):
    """Same Parquet objects, read straight from S3 by pyarrow's own C++ S3 client (no local cache)."""
    name = "parquet-arrowfs"

    def _fs(self):
        from pyarrow import fs
        ep = os.environ["AWS_ENDPOINT_URL"]
        return fs.S3FileSystem(endpoint_override=ep.split("://", 1)[1], scheme=ep.split("://", 1)[0],
                               access_key="testing", secret_key="testing", region="us-east-1")

    def read_chunk(self, k, cache):
        import pyarrow.parquet as pq
        t = pq.read_table(f"{BUCKET}/{self.chunks[k]['key']}", filesystem=self._fs())
        if self.kind == "tab":
            return table_to_tensors(t), t.num_rows
        return to_text_tensor(t.column("text").to_pylist()), t.num_rows

    def scan(self, cache):
        rows = nbytes = 0
        for k in range(len(self.chunks)):
            tensors, n = self.read_chunk(k, cache)
            rows += n
            nbytes += tensor_bytes(tensors)
        return rows, nbytes


class HFDatasets(ParquetBaseline):
    """`datasets.Dataset.save_to_disk(max_shard_size=...)` -> Arrow shards; fetched by our boto3 layer and opened
    with Dataset.from_file (memory-mapped). datasets' own s3:// path needs s3fs (see the docs)."""
    name = "hf-datasets"

    def write(self, src, out: Path):
        import datasets
        datasets.disable_progress_bars()
        if self.kind == "tab":
            X, y = src
            cols = {f"f{i}": np.ascontiguousarray(X[:, i]) for i in range(FEAT)}
            cols["label"] = np.asarray(y)
            ds = datasets.Dataset.from_dict(cols)
        else:
            ds = datasets.Dataset.from_dict({"text": src})
        ds.save_to_disk(str(out / "ds"), max_shard_size=self.chunk_bytes)

    def publish(self, out: Path, prefix: str):
        import pyarrow as pa
        keys = upload_dir(out / "ds", prefix)
        self.chunks = []
        for rel, key in keys.items():
            if rel.endswith(".arrow"):
                with pa.memory_map(str(out / "ds" / rel)) as f:
                    n = pa.ipc.open_stream(f).read_all().num_rows
                self.chunks.append({"key": key, "bytes": (out / "ds" / rel).stat().st_size, "rows": n})
        return self.chunks

    def _read_path(self, path: Path):
        import datasets
        import torch
        ds = datasets.Dataset.from_file(str(path))  # memory-mapped Arrow
        if self.kind == "tab":
            d = ds.with_format("numpy")[:]
            X = np.column_stack([d[f"f{i}"] for i in range(FEAT)])
            return (torch.from_numpy(X), torch.from_numpy(np.asarray(d["label"]))), len(ds)
        return to_text_tensor(ds["text"]), len(ds)


class WebDatasetBackend:
    """Tar shards written by wds.ShardWriter; read by wds.WebDataset from presigned HTTP URLs (its gopen runs
    `curl`), with its own cache_dir. Tabular samples hold WDS_ROWS_PER_SAMPLE rows each (see docs)."""
    name = "webdataset"

    def __init__(self, kind, chunk_bytes):
        self.kind, self.chunk_bytes = kind, chunk_bytes

    def write(self, src, out: Path):
        import webdataset as wds
        with wds.ShardWriter(str(out / "shard-%06d.tar"), maxsize=self.chunk_bytes, verbose=0) as w:
            if self.kind == "tab":
                X, y = src
                for i, (a, b) in enumerate(plan_chunks(len(y), WDS_ROWS_PER_SAMPLE)):
                    w.write({"__key__": f"{i:09d}", "x.npy": np.ascontiguousarray(X[a:b]), "y.npy": np.asarray(y[a:b])})
            else:
                for i, d in enumerate(src):
                    w.write({"__key__": f"{i:09d}", "txt": d})

    def publish(self, out: Path, prefix: str):
        keys = upload_dir(out, prefix)
        s3 = s3client()
        self.chunks = [{"key": k, "bytes": (out / r).stat().st_size,
                        "url": s3.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": k},
                                                         ExpiresIn=3600)}
                       for r, k in keys.items()]
        return self.chunks

    def _iter(self, urls, cache: Path):
        import webdataset as wds
        name = lambda url: url.split("?", 1)[0].rsplit("/", 1)[-1]  # presigned query string out of the file name
        ds = wds.WebDataset(urls, shardshuffle=False, cache_dir=str(cache), url_to_name=name, empty_check=False)
        for s in ds:
            if self.kind == "tab":
                yield np.load(io.BytesIO(s["x.npy"])), np.load(io.BytesIO(s["y.npy"]))
            else:
                yield s["txt"].decode()

    def _collect(self, it):
        import torch
        items = list(it)
        if self.kind == "tab":
            X = torch.from_numpy(np.concatenate([a for a, _ in items]))
            return (X, torch.from_numpy(np.concatenate([b for _, b in items]))), len(X)
        return to_text_tensor(items), len(items)

    def read_chunk(self, k, cache):
        return self._collect(self._iter([self.chunks[k]["url"]], cache))

    def scan(self, cache):
        rows = nbytes = 0
        for item in self._iter([c["url"] for c in self.chunks], cache):
            if self.kind == "tab":
                rows += len(item[0])
                nbytes += item[0].nbytes + item[1].nbytes
            else:
                rows += 1
                nbytes += len(item.encode())
        return rows, nbytes


def _litdata_rows(args):
    """litdata.optimize fn: yields the rows of one (start, stop) range (runs in litdata's worker process)."""
    work, kind, a, b = args
    if kind == "tab":
        X = np.load(Path(work) / "X.npy", mmap_mode="r")
        y = np.load(Path(work) / "y.npy", mmap_mode="r")
        for i in range(a, b):
            yield {"x": np.array(X[i]), "y": int(y[i])}
    else:
        for d in load_source(Path(work), "text")[a:b]:
            yield {"text": d}


class LitData:
    """litdata.optimize (its own worker processes + chunk writer) -> chunk-*.bin + index.json; read with
    litdata.StreamingDataset('s3://...', storage_options={'endpoint_url': ...}, max_cache_size=...)."""
    name = "litdata"

    def __init__(self, kind, chunk_bytes, work):
        self.kind, self.chunk_bytes, self.work = kind, chunk_bytes, work

    def write(self, src, out: Path):
        import litdata
        n = len(src[1]) if self.kind == "tab" else len(src)
        inputs = [(str(self.work), self.kind, a, b) for a, b in plan_chunks(n, max(1, n // 8))]
        litdata.optimize(fn=_litdata_rows, inputs=inputs, output_dir=str(out / "ld"),
                         chunk_bytes=self.chunk_bytes, num_workers=1, verbose=False, keep_data_ordered=True,
                         start_method="fork")

    def publish(self, out: Path, prefix: str):
        upload_dir(out / "ld", prefix)
        self.prefix = prefix
        idx = json.loads((out / "ld" / "index.json").read_text())
        self.chunks = [{"file": c["filename"], "rows": c["chunk_size"], "bytes": c["chunk_bytes"]}
                       for c in idx["chunks"]]
        return self.chunks

    def _ds(self, cache):
        from litdata import StreamingDataset
        from litdata.streaming import downloader
        # litdata GETs chunks through obstore (Rust), whose client refuses plain-http endpoints (moto, LAN MinIO)
        # unless allow_http is set; litdata exposes no option for it, so patch its private client options.
        downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
        ds = StreamingDataset(f"s3://{BUCKET}/{self.prefix}", cache_dir=str(cache), max_cache_size="2GB",
                              storage_options={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]})
        return ds

    def _collect(self, items):
        import torch
        if self.kind == "tab":
            X = torch.stack([torch.as_tensor(np.asarray(it["x"])) for it in items])
            return (X, torch.tensor([int(it["y"]) for it in items])), len(items)
        return to_text_tensor([it["text"] for it in items]), len(items)

    def read_chunk(self, k, cache):
        if getattr(self, "_cache", None) != cache:
            self._cache, self._dsi = cache, self._ds(cache)
        a = sum(c["rows"] for c in self.chunks[:k])
        # ds[i] (int) defaults to one ranged GET per item and caches nothing (a 16 MB chunk of 100k rows = 100k
        # requests; against moto the text items came back empty); a slice downloads whole chunks into cache_dir.
        return self._collect(self._dsi[a:a + self.chunks[k]["rows"]])

    def scan(self, cache):
        rows = nbytes = 0
        for it in self._ds(cache):
            rows += 1
            nbytes += (FEAT * 4 + 8) if self.kind == "tab" else len(it["text"].encode())
        return rows, nbytes


class Mosaic:
    """mosaicml-streaming: MDSWriter -> shard.*.mds + index.json; StreamingDataset(remote='s3://...', local=cache)
    with S3_ENDPOINT_URL for the custom endpoint."""
    name = "mosaic"

    def __init__(self, kind, chunk_bytes):
        self.kind, self.chunk_bytes = kind, chunk_bytes

    def write(self, src, out: Path):
        from streaming import MDSWriter
        cols = {"x": f"ndarray:float32:{FEAT}", "y": "int64"} if self.kind == "tab" else {"text": "str"}
        with MDSWriter(out=str(out / "mds"), columns=cols, size_limit=self.chunk_bytes, progress_bar=False) as w:
            if self.kind == "tab":
                X, y = src
                for i in range(len(y)):
                    w.write({"x": np.array(X[i]), "y": int(y[i])})
            else:
                for d in src:
                    w.write({"text": d})

    def publish(self, out: Path, prefix: str):
        upload_dir(out / "mds", prefix)
        self.prefix = prefix
        idx = json.loads((out / "mds" / "index.json").read_text())
        self.chunks = [{"file": s["raw_data"]["basename"], "rows": s["samples"], "bytes": s["raw_data"]["bytes"]}
                       for s in idx["shards"]]
        return self.chunks

    def _ds(self, cache):
        from streaming import StreamingDataset
        return StreamingDataset(remote=f"s3://{BUCKET}/{self.prefix}", local=str(cache), shuffle=False,
                                batch_size=256, cache_limit="2gb")  # predownload = 8 x batch_size samples

    _collect = LitData._collect

    def read_chunk(self, k, cache):
        if getattr(self, "_cache", None) != cache:
            self._cache, self._dsi = cache, self._ds(cache)
        a = sum(c["rows"] for c in self.chunks[:k])
        return self._collect([self._dsi[i] for i in range(a, a + self.chunks[k]["rows"])])

    scan = LitData.scan


def make_backend(name, kind, chunk_bytes, work):
    if name == "parquet":
        return ParquetBaseline(kind, chunk_bytes)
    if name == "parquet-arrowfs":
        return ParquetArrowFS(kind, chunk_bytes)
    if name == "hf-datasets":
        import datasets  # noqa: F401
        return HFDatasets(kind, chunk_bytes)
    if name == "webdataset":
        import webdataset  # noqa: F401
        return WebDatasetBackend(kind, chunk_bytes)
    if name == "litdata":
        import litdata  # noqa: F401
        return LitData(kind, chunk_bytes, work)
    if name == "mosaic":
        import streaming  # noqa: F401
        return Mosaic(kind, chunk_bytes)
    raise ValueError(name)


# --------------------------------------------------------------------------- child: one backend, one data kind

def child(name: str, kind: str, work: Path, chunk_bytes: int) -> dict:
    import torch
    torch.set_num_threads(1)
    res = {"backend": name, "kind": kind}
    try:
        be = make_backend(name, kind, chunk_bytes, work)
    except ImportError as e:
        return {**res, "status": "skipped", "why": f"not installed: {e}"}
    src = load_source(work, kind)
    root = Path(tempfile.mkdtemp(prefix=f"{name}-{kind}-", dir=work))
    out = root / "out"
    out.mkdir()
    if name == "parquet-arrowfs":
        res["write_s"] = None  # same objects as parquet; written again only to get them into the store
        be.write(src, out)
    else:
        t = time.perf_counter()
        be.write(src, out)
        res["write_s"] = time.perf_counter() - t
    t = time.perf_counter()
    chunks = be.publish(out, f"datasets/{name}-{kind}/v1")
    res["upload_s"] = time.perf_counter() - t
    res["stored_mb"] = dir_bytes(out) / 2**20
    res["n_chunks"] = len(chunks)
    k = len(chunks) // 2
    res["chunk_mb"] = chunks[k]["bytes"] / 2**20
    cache = root / "cache"
    cache.mkdir()
    with PeakRSS() as m1:
        t = time.perf_counter()
        tensors, n = be.read_chunk(k, cache)
        res["cold_chunk_s"] = time.perf_counter() - t
        t = time.perf_counter()
        tensors2, _ = be.read_chunk(k, cache)
        res["warm_chunk_s"] = time.perf_counter() - t
    res["chunk_rows"] = n
    if kind == "tab":  # the rows must be the source rows, in order (chunk k of a shard is always the same rows)
        X, y = src
        start = None
        if name in ("parquet", "parquet-arrowfs", "hf-datasets", "litdata", "mosaic"):
            start = sum(c["rows"] for c in chunks[:k]) if "rows" in chunks[0] else None
        if start is not None:
            res["exact"] = bool(torch.equal(tensors[0], torch.from_numpy(np.asarray(X[start:start + n])))
                                and torch.equal(tensors[1], torch.from_numpy(np.asarray(y[start:start + n]))))
        else:  # webdataset: locate the first row
            i = int(np.flatnonzero(np.asarray(X[:, 0]) == tensors[0][0, 0].item())[0])
            res["exact"] = bool(torch.equal(tensors[0], torch.from_numpy(np.asarray(X[i:i + n]))))
        res["repeat_equal"] = bool(torch.equal(tensors[0], tensors2[0]))
    del tensors, tensors2
    scache = root / "scan-cache"
    scache.mkdir()
    with PeakRSS() as m2:
        t = time.perf_counter()
        rows, nbytes = be.scan(scache)
        dt = time.perf_counter() - t
    res.update(scan_s=dt, scan_rows=rows, scan_rows_per_s=rows / dt, scan_mb_per_s=nbytes / 2**20 / dt,
               peak_rss_mb=max(m1.peak_mb, m2.peak_mb), rss_before_read_mb=m1.base / 2**20, status="ok")
    shutil.rmtree(root, ignore_errors=True)
    return res


# --------------------------------------------------------------------------- parent

def fmt(v, nd=2):
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if isinstance(v, float):
        return f"{v:.{nd}f}" if v < 1000 else f"{v:,.0f}"
    return str(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=500_000)
    ap.add_argument("--text-mb", type=int, default=50)
    ap.add_argument("--chunk-mb", type=int, default=16)
    ap.add_argument("--only", default=",".join(BACKENDS))
    ap.add_argument("--kinds", default="tab,text")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per backend and data kind")
    ap.add_argument("--out", default=str(HERE / "results" / "data_formats.json"))
    ap.add_argument("--append", action="store_true",
                    help="merge into an existing --out (e.g. mosaic run from another environment, see docs)")
    ap.add_argument("--child", nargs=4, metavar=("BACKEND", "KIND", "WORK", "CHUNK_BYTES"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        r = child(a.child[0], a.child[1], Path(a.child[2]), int(a.child[3]))
        print("RESULT " + json.dumps(r), flush=True)
        return

    # imported here, not at the top: the children measure their own RSS, without TensorTurn's
    sys.path.insert(0, str(HERE.parent))  # testbed/ sits beside the package, not installed
    from tensorturn.pool.embedded import stop_process_group
    from testbed.s3 import start_moto

    moto, aws = start_moto()
    os.environ.update(aws)
    endpoint = aws["AWS_ENDPOINT_URL"]
    os.environ["S3_ENDPOINT_URL"] = endpoint  # mosaicml-streaming reads this one
    results = []
    work = Path(tempfile.mkdtemp(prefix="tt-data-bench-"))
    try:
        s3client().create_bucket(Bucket=BUCKET)
        t = time.perf_counter()
        info = make_data(work, a.rows, a.text_mb)
        info["gen_s"] = time.perf_counter() - t
        print(f"moto S3 at {endpoint}; data: {info['rows']:,} rows ({info['tab_raw_mb']:.1f} MB raw), "
              f"{info['docs']:,} docs ({info['text_raw_mb']:.1f} MB); load avg {os.getloadavg()}", flush=True)
        for kind in a.kinds.split(","):
            for name in a.only.split(","):
                t = time.perf_counter()
                try:
                    p = subprocess.run([sys.executable, __file__, "--child", name, kind, str(work),
                                        str(a.chunk_mb * 2**20)], capture_output=True, text=True,
                                       timeout=a.timeout)
                    line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                    if line:
                        r = json.loads(line[-1][7:])
                    else:
                        err = (p.stderr.strip().splitlines() or ["no output"])[-1]
                        r = {"backend": name, "kind": kind, "status": "failed", "why": err[:300]}
                except subprocess.TimeoutExpired:
                    r = {"backend": name, "kind": kind, "status": "failed", "why": f"timed out after {a.timeout}s"}
                r["wall_s"] = time.perf_counter() - t
                r["loadavg_1m"] = os.getloadavg()[0]
                results.append(r)
                print(f"  {kind:4s} {name:16s} {r['status']:7s} {r.get('why', '')} ({r['wall_s']:.0f}s)", flush=True)
    finally:
        stop_process_group(moto, grace=5)
        shutil.rmtree(work, ignore_errors=True)

    cols = [("kind", "kind"), ("backend", "backend"), ("write_s", "write s"), ("upload_s", "upload s"),
            ("stored_mb", "stored MB"), ("n_chunks", "chunks"), ("chunk_rows", "chunk rows"),
            ("cold_chunk_s", "1 chunk cold s"), ("warm_chunk_s", "1 chunk warm s"),
            ("scan_rows_per_s", "scan rows/s"), ("scan_mb_per_s", "scan MB/s"),
            ("rss_before_read_mb", "RSS before MB"), ("peak_rss_mb", "peak RSS MB"),
            ("exact", "rows exact")]
    print()
    print(" | ".join(h for _, h in cols))
    for r in results:
        if r["status"] == "ok":
            print(" | ".join(fmt(r.get(k)) for k, _ in cols))
        else:
            print(f"{r['kind']} | {r['backend']} | {r['status']}: {r.get('why', '')}")
    import platform
    meta = {"data": info, "chunk_mb": a.chunk_mb, "endpoint": "moto.server on loopback", "cpus": os.cpu_count(),
            "python": platform.python_version(), "loadavg_end": os.getloadavg(),
            "versions": {}}
    from importlib.metadata import PackageNotFoundError, version
    for pkg in ["pyarrow", "boto3", "moto", "torch", "litdata", "mosaicml-streaming", "webdataset", "datasets"]:
        try:
            meta["versions"][pkg] = version(pkg)
        except PackageNotFoundError:
            meta["versions"][pkg] = None
    if a.append and Path(a.out).exists():
        prev = json.loads(Path(a.out).read_text())
        mine = {(r["backend"], r["kind"]) for r in results}
        results = [r for r in prev["results"] if (r["backend"], r["kind"]) not in mine] + results
        meta = {**prev["meta"], "appended": [meta, *prev["meta"].get("appended", [])]}
    Path(a.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
