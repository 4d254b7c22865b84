"""Mistakes a user can make, through the real CLI: one clear line, no traceback, nothing queued."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
import redis
from conftest import assert_clean_error, clean_env, error_lines, queued_messages, tt

from tensorturn.pool.embedded import free_port

RUN = ("run",)
SMALL = ("--rounds", "1", "--shards", "2", "--sync-every", "2")


def assert_usage_error(proc, option: str) -> None:
    """click's own usage error for a bad choice or a non-number."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Usage: tensorturn run" in proc.stderr
    assert f"Invalid value for '{option}'" in proc.stderr
    assert proc.stdout == ""


def assert_nothing_queued(broker_url: str, store_dir) -> None:
    r = redis.Redis.from_url(broker_url, decode_responses=True)
    assert r.zcard("tt:runs") == 0
    assert r.keys("*") == []  # no run hash, no Celery queue, no chord state
    assert not (store_dir / "runs").exists()


# ---- invalid options, with a live broker that must stay empty -----------------------------------

@pytest.mark.parametrize("args,expected", [
    (("--recipe", "nope"), "unknown recipe 'nope': use one of charlm, digits-mlp, gpt2-small, image-folder, tabular, "
                              "textlm or package.module:Class"),  # (not distill: `tensorturn distill` names it)
    (("--recipe", "distill"), "recipe 'distill': the distill recipe is what `tensorturn distill RUN` trains"),
    (("--recipe", "nosuchmod:thing"), "recipe 'nosuchmod:thing' failed to import: ModuleNotFoundError"),
    (("--recipe", "digits-mlp", "--rounds", "0"), "--rounds must be a whole number ≥ 1 (got 0)"),
    (("--recipe", "digits-mlp", "--shards", "-1"), "--shards must be a whole number ≥ 1 (got -1)"),
    (("--recipe", "digits-mlp", "--sync-every", "0"), "--sync-every must be a whole number ≥ 1 (got 0)"),
    (("--recipe", "digits-mlp", "--outer-momentum", "1.5"), "--outer-momentum must be in [0, 1) (got 1.5)"),
    (("--recipe", "digits-mlp", "--local-workers", "9999"), "--local-workers must be at most 64 (got 9,999)"),
])
def test_invalid_run_options_are_one_line_errors(redis_server, tmp_path, args, expected):
    store = tmp_path / "store"
    proc = tt(*RUN, "--broker", redis_server.url, "--store", str(store), *args)
    line = assert_clean_error(proc, exit_code=2)
    assert expected in line
    assert redis_server.password not in proc.stderr
    assert_nothing_queued(redis_server.url, store)


@pytest.mark.parametrize("args,option", [
    (("--mode", "foo"), "--mode"),
    (("--rounds", "abc"), "--rounds"),
])
def test_bad_choices_and_numbers_are_click_usage_errors(redis_server, tmp_path, args, option):
    store = tmp_path / "store"
    proc = tt(*RUN, "--broker", redis_server.url, "--store", str(store), "--recipe", "digits-mlp", *args)
    assert_usage_error(proc, option)
    assert_nothing_queued(redis_server.url, store)


def test_local_workers_zero_starts_no_embedded_pool(tmp_path):
    store = tmp_path / "store"
    proc = tt(*RUN, "--recipe", "digits-mlp", "--local-workers", "0", "--store", str(store), cwd=tmp_path)
    line = assert_clean_error(proc, exit_code=2)
    assert "--local-workers must be a whole number ≥ 1 (got 0)" in line
    assert "embedded pool" not in proc.stderr.replace(line, "")
    assert not store.exists()


@pytest.mark.parametrize("store,expected", [
    ("s3://", "store URL 's3://' names no bucket"),
    ("ftp://user:secret@host/x", "unsupported store URL"),
])
def test_a_store_url_written_wrong_is_refused_before_a_pool_starts(tmp_path, store, expected):
    proc = tt(*RUN, "--recipe", "digits-mlp", "--store", store, cwd=tmp_path)
    line = assert_clean_error(proc, exit_code=2)
    assert expected in line and "secret" not in proc.stderr
    assert "embedded pool" not in proc.stderr
    shown = tt("status", "20260101-000000-abcdef", "--store", store, cwd=tmp_path)  # the same: exit 2
    assert expected in assert_clean_error(shown, exit_code=2)


def test_detach_without_broker_is_an_error(tmp_path):
    store = tmp_path / "store"
    proc = tt(*RUN, "--recipe", "digits-mlp", "--detach", "--store", str(store), cwd=tmp_path)
    line = assert_clean_error(proc, exit_code=2)
    assert "--detach needs a pool (--broker)" in line
    assert "starting an embedded pool" not in proc.stderr
    assert not store.exists()


def test_recipe_whose_constructor_raises_is_a_clean_error(redis_server, tmp_path):
    (tmp_path / "badinit.py").write_text(textwrap.dedent("""
        from tensorturn.recipes.digits import DigitsMLP

        class Bad(DigitsMLP):
            def __init__(self):
                raise ValueError("this recipe needs DATA_DIR set")
    """))
    store = tmp_path / "store"
    proc = tt(*RUN, "--broker", redis_server.url, "--store", str(store), "--recipe", "badinit:Bad",
              env=clean_env(PYTHONPATH=str(tmp_path)))
    assert_nothing_queued(redis_server.url, store)
    line = assert_clean_error(proc, exit_code=2)
    assert "badinit:Bad" in line and "needs DATA_DIR set" in line


# ---- unreachable broker and store ---------------------------------------------------------------

def test_unreachable_broker_names_masked_url_and_hides_password(tmp_path):
    port = free_port()  # nothing listens there
    url = f"redis://:hunter2@127.0.0.1:{port}/0"
    store = tmp_path / "store"
    proc = tt(*RUN, "--broker", url, "--store", str(store), "--recipe", "digits-mlp", *SMALL)
    line = assert_clean_error(proc, exit_code=3)
    assert f"cannot reach broker redis://:***@127.0.0.1:{port}/0" in line
    assert "hunter2" not in proc.stderr and "hunter2" not in proc.stdout
    assert not store.exists()


def test_unreachable_broker_from_env_for_status_and_agent(tmp_path):
    port = free_port()
    env = clean_env(TENSORTURN_BROKER_URL=f"redis://user:hunter2@127.0.0.1:{port}/3",
                    TENSORTURN_STORE_URL=str(tmp_path / "store"))
    for args in (("status", "some-run"), ("agent", "--name", "x")):
        proc = tt(*args, env=env)
        line = assert_clean_error(proc, exit_code=3)
        assert f"redis://user:***@127.0.0.1:{port}/3" in line, args
        assert "hunter2" not in proc.stderr + proc.stdout, args


def test_unreachable_store_fails_before_the_run_is_recorded(redis_server, tmp_path):
    port = free_port()
    env = clean_env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="testing",
                    AWS_SECRET_ACCESS_KEY="testing-secret", AWS_DEFAULT_REGION="us-east-1",
                    TENSORTURN_STORE_RETRIES="1", TENSORTURN_STORE_BACKOFF_S="0.05")
    proc = tt(*RUN, "--broker", redis_server.url, "--store", "s3://bucket/x", "--recipe", "digits-mlp",
              *SMALL, env=env)
    assert proc.returncode == 3, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: store s3://bucket/x: cannot write probe/")
    assert f"127.0.0.1:{port}" in lines[0]
    assert "testing-secret" not in proc.stderr
    assert proc.stdout == ""
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    assert r.zcard("tt:runs") == 0
    assert r.keys("*") == []


def test_status_of_unknown_run_is_an_error(redis_server, tmp_path):
    store = tmp_path / "store"
    proc = tt("status", "nosuchrun", cwd=tmp_path)  # the default store: ./tensorturn-store
    line = assert_clean_error(proc, exit_code=2)
    assert "no run 'nosuchrun'" in line
    assert not (tmp_path / "tensorturn-store").exists()  # looking does not create it
    proc = tt("status", "nosuchrun", "--json", "--broker", redis_server.url, "--store", str(store))
    line = assert_clean_error(proc, exit_code=2)
    assert "no run 'nosuchrun' on the broker or in the store" in line


# ---- a recipe that imports here but not on the workers ------------------------------------------


# ---- the inference API: values the declared datatype cannot hold, an input of another name ------

def signature():
    from tensorturn.serve.protocol import Signature

    return Signature([2], ("label", "probabilities"), max_rows=10)


@pytest.mark.parametrize("name,datatype,data,said", [
    ("input", "INT8", [300, 0], "data holds 300, outside INT8's range -128..127"),
    ("input", "INT8", [2.5, 0], "data holds a fraction, which is no INT8 value (declare FP32)"),
    ("input", "UINT8", [-7, 0], "data holds -7, outside UINT8's range 0..255"),
    ("input", "FP16", [70000.0, 0], "data holds numbers beyond the FP16 range (±65504)"),
    ("input", "INT64", [2 ** 24 + 1, 0], "data holds 1.67772e+07: the model reads float32, which holds whole "
                                         "numbers exactly only up to ±16,777,216"),
    ("input", "BOOL", [1, 0], "data must contain true or false only (found int)"),
    ("input", "BYTES", ["a", "b"], "unsupported datatype 'BYTES' for input 'input': send numbers (this "
                                   "model's is FP32)"),
    ("../../etc/passwd", "FP32", [0.0, 1.0], "no input '../../etc/passwd' in this model: its inputs are "
                                               "'input' (FP32 [-1, 2])"),
    (None, "FP32", [0.0, 1.0], "no input 'None' in this model"),
])
def test_the_api_checks_values_against_their_datatype_and_the_input_by_name(name, datatype, data, said):
    from tensorturn.serve.protocol import BadRequest, parse_request

    spec = {"shape": [1, 2], "datatype": datatype, "data": data, **({"name": name} if name else {})}
    with pytest.raises(BadRequest) as refused:
        parse_request(json.dumps({"inputs": [spec]}).encode(), signature())
    assert refused.value.status == 400 and refused.value.message.startswith(said)


@pytest.mark.parametrize("datatype,data", [("INT8", [-128, 127]), ("UINT8", [0, 255]), ("INT64", [-5, 7]),
                                           ("UINT64", [0, 2 ** 24]), ("BOOL", [True, False]),
                                           ("FP16", [0.5, -65504.0]), ("FP32", [2.5, 1024.0])])
def test_values_within_their_datatype_are_taken(datatype, data):
    from tensorturn.serve.protocol import parse_request

    body = {"inputs": [{"name": "input", "shape": [1, 2], "datatype": datatype, "data": data}]}
    assert parse_request(json.dumps(body).encode(), signature()).x.tolist() == [[float(v) for v in data]]


@pytest.mark.parametrize("datatype,data", [("INT64", [-5, 7]), ("UINT8", [0, 255]), ("BOOL", [True, False]),
                                           ("FP16", [0.5, -65504.0]), ("FP64", [2.5, 1e30])])
def test_binary_tensor_data_is_read_as_json_data_is(datatype, data):
    """The binary tensor data extension: the JSON's length in a header, then each input's bytes,
    little-endian and row-major."""
    from tensorturn.recipes.answer import NUMPY_DTYPES
    from tensorturn.serve.protocol import parse_request

    raw = np.array(data, NUMPY_DTYPES[datatype]).tobytes()
    head = json.dumps({"inputs": [{"name": "input", "shape": [1, 2], "datatype": datatype,
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()
    parsed = parse_request(head + raw, signature(), str(len(head)))
    assert parsed.x.tolist() == [np.float32(data).tolist()]


@pytest.mark.parametrize("cut,header,said", [
    (0, "9999", "Inference-Header-Content-Length is '9999': it must be the length of the JSON part"),
    (0, "x", "Inference-Header-Content-Length is 'x'"),
    (3, None, "input 'input' declares 16 bytes of binary data; 13 follow the JSON"),
    (-3, None, "input 'input' declares 16 bytes of binary data; 19 follow the JSON"),
])
def test_binary_data_that_does_not_add_up_is_a_400(cut, header, said):
    from tensorturn.serve.protocol import BadRequest, parse_request

    raw = np.zeros(2, "<f8").tobytes()
    head = json.dumps({"inputs": [{"name": "input", "shape": [1, 2], "datatype": "FP64",
                                   "parameters": {"binary_data_size": 16}}]}).encode()
    body = head + (raw[:-cut] if cut > 0 else raw + b"\0" * -cut)
    with pytest.raises(BadRequest) as refused:
        parse_request(body, signature(), header or str(len(head)))
    assert refused.value.message.startswith(said)


@pytest.mark.parametrize("args,message", [
    (["--members", "0"], "--members must be a whole number"),
    (["--members", "2", "--min-members", "3"], "--min-members (3) cannot exceed --members (2)"),
    (["--members", "2", "--segments", "0"], "--segments must be a whole number"),
])
def test_bad_ensemble_options_queue_nothing(redis_server, tmp_path, args, message):
    proc = tt("run", "--mode", "ensemble", "--recipe", "digits-mlp", "--broker", redis_server.url,
              "--store", str(tmp_path / "s"), *args)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
    r = redis.Redis.from_url(redis_server.url)
    assert r.zcard("tt:runs") == 0 and queued_messages(r) == []
    assert not (tmp_path / "s").exists()


def test_unknown_vote_rule_is_refused(redis_server):
    proc = tt("run", "--mode", "ensemble", "--recipe", "digits-mlp", "--broker", redis_server.url,
              "--vote", "plurality")
    assert proc.returncode == 2 and "'plurality' is not one of" in proc.stderr
    assert redis.Redis.from_url(redis_server.url).zcard("tt:runs") == 0


def test_a_request_id_longer_than_the_cap_is_a_400():
    from tensorturn.serve.protocol import MAX_ID_CHARS, BadRequest, parse_request

    def body(request_id: str) -> bytes:
        return json.dumps({"id": request_id, "inputs": [
            {"name": "input", "shape": [1, 2], "datatype": "FP32", "data": [0.0, 1.0]}]}).encode()

    assert parse_request(body("x" * MAX_ID_CHARS), signature()).id == "x" * MAX_ID_CHARS
    with pytest.raises(BadRequest) as refused:
        parse_request(body("x" * 3_000_000), signature())
    assert refused.value.status == 400
    assert refused.value.message == f"'id' is 3,000,000 characters; at most {MAX_ID_CHARS} are echoed back"
