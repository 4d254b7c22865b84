"""The object store: FileStore on a directory, S3Store on a real moto S3 server, error paths."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from urllib.parse import unquote, urlsplit

import boto3
import pytest

from tensorturn import config
from tensorturn.errors import StoreError
from tensorturn.pool.embedded import free_port
from tensorturn.store.objects import FileStore, ObjectMissing, S3Store, open_store, sha256_hex

PAYLOAD = bytes(range(256)) * 9 + b"\x00tail"


def all_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


# ---- FileStore --------------------------------------------------------------------------------

@pytest.fixture
def fstore(tmp_path) -> FileStore:
    return open_store((tmp_path / "store dir").as_uri())  # a space: the URL is percent-encoded


def test_open_store_picks_backend_and_rejects_unknown_scheme(tmp_path):
    assert isinstance(open_store(tmp_path.as_uri()), FileStore)
    with pytest.raises(StoreError, match="unsupported store URL"):
        open_store("ftp://user:pw@example.com/x")
    try:
        open_store("ftp://user:pw@example.com/x")
    except StoreError as exc:
        assert "pw" not in str(exc)


def test_file_put_get_round_trip_returns_sha256(fstore):
    digest = fstore.put_bytes("runs/abc/global/r0000.safetensors", PAYLOAD)
    assert digest == hashlib.sha256(PAYLOAD).hexdigest() == sha256_hex(PAYLOAD)
    assert fstore.get_bytes("runs/abc/global/r0000.safetensors") == PAYLOAD
    assert fstore.exists("runs/abc/global/r0000.safetensors")
    assert not fstore.exists("runs/abc/global/r0001.safetensors")
    # overwrite: the new bytes and their digest
    assert fstore.put_bytes("runs/abc/global/r0000.safetensors", b"v2") == sha256_hex(b"v2")
    assert fstore.get_bytes("runs/abc/global/r0000.safetensors") == b"v2"


def test_file_json_round_trip(fstore):
    doc = {"b": [1, 2.5, None], "a": "x"}
    digest = fstore.put_json("runs/x/manifest.json", doc)
    assert fstore.get_json("runs/x/manifest.json") == doc
    assert digest == sha256_hex(fstore.get_bytes("runs/x/manifest.json"))


def test_file_put_is_atomic_and_leaves_no_temp_files(fstore):
    for i in range(3):
        fstore.put_bytes("a/b/model.bin", PAYLOAD + bytes([i]))
    fstore.put_bytes("a/other.bin", b"x")
    assert all_files(fstore.root) == ["a/b/model.bin", "a/other.bin"]
    assert fstore.get_bytes("a/b/model.bin") == PAYLOAD + b"\x02"


def test_file_uri_points_at_the_file(fstore):
    fstore.put_bytes("runs/r/final/model.safetensors", PAYLOAD)
    uri = fstore.uri("runs/r/final/model.safetensors")
    assert uri.startswith("file:///")
    path = Path(unquote(urlsplit(uri).path))
    assert path.read_bytes() == PAYLOAD


def test_file_list_under_prefix(fstore):
    for key in ["runs/r1/spec.json", "runs/r1/global/r0000.safetensors", "runs/r2/spec.json",
                "other/x.bin"]:
        fstore.put_bytes(key, key.encode())
    # a stale temp file from a crashed writer is not an object
    (fstore.root / "runs" / "r1" / ".spec.json.abc123").write_bytes(b"partial")
    assert fstore.list("runs/") == ["runs/r1/global/r0000.safetensors", "runs/r1/spec.json",
                                    "runs/r2/spec.json"]
    assert fstore.list("runs/r1/") == ["runs/r1/global/r0000.safetensors", "runs/r1/spec.json"]
    assert fstore.list("") == sorted(["other/x.bin", "runs/r1/global/r0000.safetensors",
                                      "runs/r1/spec.json", "runs/r2/spec.json"])
    assert fstore.list("nothing/here/") == []


def test_file_missing_key_raises_object_missing(fstore):
    with pytest.raises(ObjectMissing) as info:
        fstore.get_bytes("runs/none/manifest.json")
    assert isinstance(info.value, StoreError)
    assert "runs/none/manifest.json" in str(info.value)


@pytest.mark.parametrize("key", ["../escape.bin", "runs/../../escape.bin", "a/../b", "/etc/passwd"])
def test_file_rejects_keys_outside_the_store(fstore, tmp_path, key):
    with pytest.raises(StoreError, match="invalid store key"):
        fstore.put_bytes(key, b"x")
    with pytest.raises(StoreError, match="invalid store key"):
        fstore.get_bytes(key)
    with pytest.raises(StoreError, match="invalid store key"):
        fstore.exists(key)
    assert not (tmp_path / "escape.bin").exists()
    assert not fstore.root.exists() or all_files(fstore.root) == []


def test_file_check_probe(fstore):
    fstore.check()
    assert all_files(fstore.root) == []


def test_file_non_transient_error_is_not_retried(fstore, caplog):
    fstore.put_bytes("blocker", b"a file, not a directory")
    with caplog.at_level(logging.WARNING, logger="tensorturn.store.objects"):
        with pytest.raises(StoreError) as info:
            fstore.put_bytes("blocker/child.bin", b"x")
    assert not isinstance(info.value, ObjectMissing)
    assert "cannot write blocker/child.bin" in str(info.value)
    assert "\n" not in str(info.value)
    assert not [r for r in caplog.records if "retrying" in r.getMessage()]


# ---- S3Store against moto -----------------------------------------------------------------------

@pytest.fixture
def s3store(s3_bucket) -> S3Store:
    return open_store(f"s3://{s3_bucket}/pre/fix")


def test_s3_put_get_round_trip_and_sha256_metadata(s3store, s3_bucket):
    digest = s3store.put_bytes("runs/abc/global/r0000.safetensors", PAYLOAD)
    assert digest == hashlib.sha256(PAYLOAD).hexdigest()
    assert s3store.get_bytes("runs/abc/global/r0000.safetensors") == PAYLOAD
    head = boto3.client("s3").head_object(Bucket=s3_bucket,
                                          Key="pre/fix/runs/abc/global/r0000.safetensors")
    assert head["Metadata"]["sha256"] == digest
    assert head["ContentLength"] == len(PAYLOAD)
    assert s3store.exists("runs/abc/global/r0000.safetensors")
    assert not s3store.exists("runs/abc/global/r0001.safetensors")
    # overwrite updates bytes and metadata
    d2 = s3store.put_bytes("runs/abc/global/r0000.safetensors", b"v2")
    head = boto3.client("s3").head_object(Bucket=s3_bucket,
                                          Key="pre/fix/runs/abc/global/r0000.safetensors")
    assert head["Metadata"]["sha256"] == d2 == sha256_hex(b"v2")


def test_s3_objects_carry_their_content_type(s3store, s3_bucket, tmp_path):
    """A stored record is ``application/json`` to S3 (the console, a browser, ``aws s3 cp``), by
    either path a body takes; weights and unknown kinds are ``application/octet-stream``."""
    spec = tmp_path / "spec.json"
    spec.write_text('{"seed": 0}')
    s3store.put_json("runs/abc/spec.json", {"seed": 0})
    s3store.put_file("runs/abc/manifest.json", spec)
    s3store.put_bytes("runs/abc/global/r0000.safetensors", PAYLOAD)
    kinds = {key: boto3.client("s3").head_object(Bucket=s3_bucket, Key=f"pre/fix/runs/abc/{key}")["ContentType"]
             for key in ("spec.json", "manifest.json", "global/r0000.safetensors")}
    assert kinds == {"spec.json": "application/json", "manifest.json": "application/json",
                     "global/r0000.safetensors": "application/octet-stream"}


def test_s3_uri_is_where_plain_boto3_finds_the_object(s3store):
    s3store.put_bytes("runs/r/final/model.safetensors", PAYLOAD)
    uri = s3store.uri("runs/r/final/model.safetensors")
    parts = urlsplit(uri)
    assert parts.scheme == "s3"
    body = boto3.client("s3").get_object(Bucket=parts.netloc, Key=parts.path.lstrip("/"))
    assert body["Body"].read() == PAYLOAD
    assert body["Metadata"]["sha256"] == sha256_hex(PAYLOAD)


def test_s3_list_under_prefix_strips_store_prefix(s3store, s3_bucket):
    for key in ["runs/r1/spec.json", "runs/r1/global/r0000.safetensors", "runs/r2/spec.json",
                "other/x.bin"]:
        s3store.put_bytes(key, key.encode())
    # an object beside the store's prefix is not the store's
    boto3.client("s3").put_object(Bucket=s3_bucket, Key="pre/fixother/runs/z.json", Body=b"z")
    assert s3store.list("runs/") == ["runs/r1/global/r0000.safetensors", "runs/r1/spec.json",
                                     "runs/r2/spec.json"]
    assert s3store.list("runs/r1/") == ["runs/r1/global/r0000.safetensors", "runs/r1/spec.json"]
    assert s3store.list("") == sorted(["other/x.bin", "runs/r1/global/r0000.safetensors",
                                       "runs/r1/spec.json", "runs/r2/spec.json"])
    assert s3store.list("nothing/here/") == []


def test_s3_store_without_prefix(s3_bucket):
    s = open_store(f"s3://{s3_bucket}")
    s.put_bytes("k/v.bin", b"data")
    assert s.uri("k/v.bin") == f"s3://{s3_bucket}/k/v.bin"
    assert s.list("k/") == ["k/v.bin"]
    assert boto3.client("s3").get_object(Bucket=s3_bucket, Key="k/v.bin")["Body"].read() == b"data"


def test_s3_missing_key_raises_object_missing(s3store):
    with pytest.raises(ObjectMissing) as info:
        s3store.get_bytes("runs/none/manifest.json")
    assert "runs/none/manifest.json" in str(info.value)


def test_s3_check_probe_cleans_up(s3store, s3_bucket):
    s3store.check()
    assert boto3.client("s3").list_objects_v2(Bucket=s3_bucket).get("KeyCount", 0) == 0


def test_s3_url_without_bucket_is_an_error():
    with pytest.raises(StoreError, match="names no bucket"):
        open_store("s3:///just/a/path")


@pytest.mark.parametrize("key", ["../escape.bin", "/abs.bin"])
def test_s3_rejects_keys_outside_the_store(s3store, s3_bucket, key):
    try:
        with pytest.raises(StoreError, match="invalid store key"):
            s3store.put_bytes(key, b"x")
    finally:
        keys = [o["Key"] for o in
                boto3.client("s3").list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    assert keys == []


def test_unreachable_s3_endpoint_raises_one_line_store_error(monkeypatch, caplog):
    port = free_port()  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s = open_store("s3://somebucket/prefix",
                   config.Settings(store_retries=1, store_backoff_s=0.05))
    with caplog.at_level(logging.WARNING, logger="tensorturn.store.objects"):
        with pytest.raises(StoreError) as info:
            s.put_bytes("runs/x/spec.json", b"{}")
    msg = str(info.value)
    assert not isinstance(info.value, ObjectMissing)
    assert "\n" not in msg
    assert msg.startswith("store s3://somebucket/prefix: cannot write runs/x/spec.json")
    assert f"127.0.0.1:{port}" in msg
    # a connection error is transient: retried exactly RETRIES times before it surfaces
    assert len([r for r in caplog.records if "retrying" in r.getMessage()]) == 1
    with pytest.raises(StoreError, match="cannot read runs/x/spec.json"):
        s.get_bytes("runs/x/spec.json")


# ---- masking secrets ----------------------------------------------------------------------------

@pytest.mark.parametrize("url,expected", [
    ("redis://:secret@h:1/0", "redis://:***@h:1/0"),
    ("redis://user:secret@h:1/0", "redis://user:***@h:1/0"),
    ("rediss://default:s3cr%40t@cache.example.com:6380/2", "rediss://default:***@cache.example.com:6380/2"),
    ("redis://h:1/0", "redis://h:1/0"),
    ("s3://bucket/prefix", "s3://bucket/prefix"),
])
def test_mask_url(url, expected):
    masked = config.mask_url(url)
    assert masked == expected
    assert "secret" not in masked and "s3cr" not in masked


def test_mask_url_none_and_empty():
    assert config.mask_url(None) == "None"
    assert config.mask_url("") == ""


def test_mask_text_hides_every_password_in_a_message():
    text = ("cannot reach redis://:secret@h:1/0 (fallback redis://admin:hunter2@10.0.0.2:6379/1); "
            "store s3://bucket/x is fine")
    masked = config.mask_text(text)
    assert "secret" not in masked and "hunter2" not in masked
    assert "redis://:***@h:1/0" in masked
    assert "redis://admin:***@10.0.0.2:6379/1" in masked
    assert "s3://bucket/x is fine" in masked
    assert config.mask_text("no urls here: a:b@c") == "no urls here: a:b@c"


# ---- files: streamed transfers, and uploads killed half way ------------------------------------

SMALL_PARTS = """
from boto3.s3.transfer import TransferConfig
import tensorturn.store.objects as st
st.transfer_config = lambda: TransferConfig(multipart_threshold=5 * 2 ** 20,
                                            multipart_chunksize=5 * 2 ** 20, max_concurrency=1)
"""


def test_s3_files_move_in_parts_and_round_trip(s3store, s3_bucket, tmp_path, monkeypatch):
    from boto3.s3.transfer import TransferConfig

    import tensorturn.store.objects as st

    monkeypatch.setattr(st, "transfer_config", lambda: TransferConfig(  # 5 MiB parts, as below
        multipart_threshold=5 * 2 ** 20, multipart_chunksize=5 * 2 ** 20, max_concurrency=1))
    data = bytes(range(256)) * (12 * 4096 + 7)  # 12 MiB and a bit: three parts
    (tmp_path / "big").write_bytes(data)
    digest = s3store.put_file("runs/x/global/r0001.safetensors", tmp_path / "big")
    head = boto3.client("s3").head_object(Bucket=s3_bucket, Key="pre/fix/runs/x/global/r0001.safetensors")
    assert digest == sha256_hex(data) == head["Metadata"]["sha256"]
    assert head["ETag"].strip('"').endswith("-3")  # a multipart upload of three parts
    s3store.get_file("runs/x/global/r0001.safetensors", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == data
    with pytest.raises(ObjectMissing):
        s3store.get_file("runs/x/global/r0002.safetensors", tmp_path / "none")


def _kill_mid_upload(tmp_path, url: str, key: str, patch: str) -> None:
    """Run put_file of a 12 MiB file in a child that stops after its first piece is written, and
    SIGKILL it there."""
    import os
    import signal
    import subprocess
    import sys

    (tmp_path / "big").write_bytes(os.urandom(12 * 2 ** 20))
    script = SMALL_PARTS + patch + f"""
st.open_store({url!r}).put_file({key!r}, {str(tmp_path / "big")!r})
"""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "one piece written"
    child.send_signal(signal.SIGKILL)
    child.wait()


def test_an_upload_killed_half_way_leaves_no_object_on_s3(s3store, s3_bucket, tmp_path):
    patch = """
import time
real = st.S3Store._put_file
def slow(self, key, path, sha256):
    upload_part = self.client.upload_part
    def part(**kw):
        out = upload_part(**kw)
        print("one piece written", flush=True)
        time.sleep(600)
        return out
    self.client.upload_part = part
    return real(self, key, path, sha256)
st.S3Store._put_file = slow
"""
    _kill_mid_upload(tmp_path, s3store.url, "runs/x/r0000/shard-000.safetensors", patch)
    assert not s3store.exists("runs/x/r0000/shard-000.safetensors")  # nothing a round could read
    pending = boto3.client("s3").list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["Key"] for u in pending] == ["pre/fix/runs/x/r0000/shard-000.safetensors"]


def test_an_upload_killed_half_way_leaves_no_object_on_disk(fstore, tmp_path):
    patch = """
import shutil, time
def copy(source, target, length=0):
    target.write(source.read(2 ** 20))
    target.flush()
    print("one piece written", flush=True)
    time.sleep(600)
shutil.copyfileobj = copy
"""
    _kill_mid_upload(tmp_path, fstore.url, "runs/x/r0000/shard-000.safetensors", patch)
    assert not fstore.exists("runs/x/r0000/shard-000.safetensors")
    assert fstore.list("runs/x/") == []


def test_a_failed_part_is_a_transient_error_and_the_upload_is_retried(s3store, tmp_path):
    """boto3's transfer manager wraps a part's 500 in S3UploadFailedError: still transient."""
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import ClientError

    (tmp_path / "f").write_bytes(PAYLOAD)
    real, calls = s3store.client.upload_file, []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            try:
                raise ClientError({"Error": {"Code": "InternalError"},
                                   "ResponseMetadata": {"HTTPStatusCode": 500}}, "UploadPart")
            except ClientError:
                raise S3UploadFailedError("Failed to upload: InternalError") from None
        return real(*args, **kwargs)

    s3store.client.upload_file = flaky
    s3store.backoff_s = 0.01
    assert s3store.put_file("runs/x/r0000/shard-000.safetensors", tmp_path / "f") == sha256_hex(PAYLOAD)
    assert len(calls) == 2 and s3store.get_bytes("runs/x/r0000/shard-000.safetensors") == PAYLOAD
    # a part refused for good (wrong credentials) stays an error at once
    try:
        try:
            raise ClientError({"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}},
                              "UploadPart")
        except ClientError:
            raise S3UploadFailedError("Failed to upload: AccessDenied")  # noqa: B904 - as boto3 does
    except S3UploadFailedError as denied:
        assert not s3store._transient(denied)


@pytest.mark.parametrize("kind", ["file", "s3"])
def test_the_stores_own_clock_dates_what_it_wrote(kind, tmp_path, request):
    """`modified` says when the store wrote each object, and `now` reads the store's clock by
    writing an empty object (then removes it): what a time written on one machine is compared
    with on another (a server's mark, read by `runs rm`)."""
    store = open_store((tmp_path / "store").as_uri()) if kind == "file" else request.getfixturevalue("s3store")
    store.put_bytes("runs/r/serving/a.json", b"{}")
    [(key, written)] = store.modified("runs/r/serving/").items()
    assert key == "runs/r/serving/a.json"
    now = store.now()
    assert now >= written - 1  # (S3 dates to the second)
    assert store.list("clock/") == []


def test_a_servers_mark_is_aged_on_the_stores_clock_not_the_servers(tmp_path):
    """A server whose clock is an hour behind marks a run served: the mark is live, since its
    age is when the store wrote it, not the time the server put in it."""
    from tensorturn.state.manifest import servers

    store = open_store((tmp_path / "store").as_uri())
    store.put_json("runs/r/serving/pc-1.json", {"where": "pc:8000", "host": "pc", "pid": 1, "at": 0.0})
    [mark] = servers(store, "r")
    assert mark["where"] == "pc:8000" and mark["age_s"] < 60
