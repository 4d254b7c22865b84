"""The inference API as the Open Inference Protocol's official clients see it, at their defaults
(binary tensor data on): Triton's HTTP client and KServe's REST client against real `tensorturn
serve` processes — a digits model, a digits ensemble of three and a small charlm — and the
OpenAPI document and /docs page those servers publish."""

from __future__ import annotations

import asyncio
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from conftest import Server, bearer

from tensorturn import layout, trust
from tensorturn.predictor import load_result
from tensorturn.recipes import resolve
from tensorturn.serve import tokens
from tensorturn.store.objects import open_store
from tensorturn.store.tensors import ensemble_bytes, model_bytes

CHARLM = {"vocabulary": "abcdefghijklmnopqrstuvwxyz ,.", "context": 16, "n_layer": 1, "n_head": 2, "n_embd": 32}


def store_run(store, run_id: str, recipe_name: str, options: dict | None = None, members: int = 0) -> None:
    """A signed, succeeded run of ``recipe_name`` (untrained weights, a seed each: members
    answer differently), fused, or an ensemble of ``members``."""
    recipe = resolve(recipe_name, options or {})
    cfg = recipe.default_config()

    def weights(seed: int) -> dict:
        torch.manual_seed(seed)
        return recipe.model(cfg).state_dict()

    if members:
        data = ensemble_bytes([(m, weights(m), cfg) for m in range(members)], recipe_name, "soft", options)
        mode, final = "ensemble", "final_ensemble"
    else:
        data, mode, final = model_bytes(weights(0), recipe_name, cfg, options), "fused", "final_model"
    sha = store.put_bytes(layout.key(final, run_id), data)
    store.put_json(layout.key("manifest", run_id), trust.pool_key().sign_doc("manifest", {
        "run_id": run_id, "mode": mode, "state": "succeeded", "recipe": recipe_name,
        "model_uri": store.uri(layout.key(final, run_id)), "model_sha256": sha, "metrics": {}}))


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    """Three servers on one store, started side by side: ``digits`` (a fused digits model, also
    called ``digits``), ``ensemble`` (three members) and ``charlm``; and a token."""
    work = tmp_path_factory.mktemp("oip")
    store = open_store((work / "store").as_uri())
    store_run(store, "fused1", "digits-mlp")
    store_run(store, "ens1", "digits-mlp", members=3)
    store_run(store, "lm1", "charlm", CHARLM)
    token, _ = tokens.create(store, "clients")
    flags = {"digits": ("fused1", "--name", "digits"), "ensemble": ("ens1",), "charlm": ("lm1",)}
    with ThreadPoolExecutor(len(flags)) as threads:
        starting = {name: threads.submit(Server, str(work / "store"), *args) for name, args in flags.items()}
    started = {name: f.result() for name, f in starting.items() if f.exception() is None}
    try:
        assert len(started) == len(flags), [f.exception() for f in starting.values()]
        yield store, token, started
    finally:
        for server in started.values():
            server.stop()


def triton_client(server):
    import tritonclient.http as triton

    return triton.InferenceServerClient(url=f"127.0.0.1:{server.port}")


def digits(rows: int) -> np.ndarray:
    from sklearn.datasets import load_digits

    return load_digits().data[:rows].astype(np.float32)


def expected(store, run_id: str, x: np.ndarray):
    """What the run's model gives for raw rows ``x``, computed here."""
    predictor, _ = load_result(store, run_id)
    return predictor.serve_rows(x)


def close(served: np.ndarray, computed: np.ndarray) -> None:
    """The same values, but for float32 rounding (the server runs torch on one thread)."""
    assert served.dtype == computed.dtype
    np.testing.assert_allclose(served, computed, rtol=1e-5, atol=1e-7)


def test_triton_client_sees_a_live_ready_model_and_its_metadata(api):
    _, token, servers = api
    client = triton_client(servers["digits"])
    assert client.is_server_live() and client.is_server_ready()
    server = client.get_server_metadata()
    assert server["name"] == "tensorturn" and "binary_tensor_data" in server["extensions"]
    for name in ("digits", "fused1"):
        assert client.is_model_ready(name, headers=bearer(token))
    assert not client.is_model_ready("digits")  # the token is needed
    assert not client.is_model_ready("other", headers=bearer(token))
    meta = client.get_model_metadata("digits", headers=bearer(token))
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}]
    assert [o["name"] for o in meta["outputs"]] == ["label", "probabilities"]
    version = meta["versions"][0]
    assert client.is_model_ready("digits", model_version=version, headers=bearer(token))
    assert client.get_model_metadata("digits", model_version=version, headers=bearer(token))["name"] == "digits"
    assert not client.is_model_ready("digits", model_version="v0", headers=bearer(token))


def test_triton_client_infers_one_row_and_a_batch_in_binary(api):
    store, token, servers = api
    client = triton_client(servers["digits"])
    import tritonclient.http as triton

    for rows in (1, 50):
        x = digits(rows)
        given = triton.InferInput("input", list(x.shape), "FP32")
        given.set_data_from_numpy(x)  # binary data: the client's default
        result = client.infer("digits", [given], headers=bearer(token))
        want = expected(store, "fused1", x)
        assert result.get_response()["outputs"][0]["parameters"]["binary_data_size"] == rows * 8
        close(result.as_numpy("probabilities"), want.combined)
        np.testing.assert_array_equal(result.as_numpy("label"), want.combined.argmax(-1))


def test_triton_client_selects_one_output_and_an_ensembles_members(api):
    store, token, servers = api
    import tritonclient.http as triton

    x = digits(5)
    given = triton.InferInput("input", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    client = triton_client(servers["digits"])
    only = client.infer("digits", [given], outputs=[triton.InferRequestedOutput("label")], headers=bearer(token))
    assert [o["name"] for o in only.get_response()["outputs"]] == ["label"]
    ensemble = triton_client(servers["ensemble"])
    meta = ensemble.get_model_metadata("ens1", headers=bearer(token))
    members = [f"member_{m}_probabilities" for m in range(3)]
    assert [o["name"] for o in meta["outputs"]] == ["label", "probabilities", *members]
    asked = [triton.InferRequestedOutput(name) for name in ("probabilities", "member_2_probabilities")]
    result = ensemble.infer("ens1", [given], outputs=asked, headers=bearer(token))
    want = expected(store, "ens1", x)
    assert [o["name"] for o in result.get_response()["outputs"]] == ["probabilities", "member_2_probabilities"]
    close(result.as_numpy("member_2_probabilities"), want.per_member[2])
    close(result.as_numpy("probabilities"), want.combined)
    assert not np.array_equal(want.per_member[0], want.per_member[2])  # members that differ


def test_unknown_input_and_output_names_are_400s_naming_what_exists(api):
    _, token, servers = api
    import tritonclient.http as triton
    from tritonclient.utils import InferenceServerException

    client = triton_client(servers["digits"])
    x = digits(1)
    wrong = triton.InferInput("INPUT__0", [1, 64], "FP32")
    wrong.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("digits", [wrong], headers=bearer(token))
    assert refused.value.status() == "400"
    assert refused.value.message() == "no input 'INPUT__0' in this model: its inputs are 'input' (FP32 [-1, 64])"
    given = triton.InferInput("input", [1, 64], "FP32")
    given.set_data_from_numpy(x)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("digits", [given], outputs=[triton.InferRequestedOutput("OUTPUT__0")], headers=bearer(token))
    assert refused.value.status() == "400"
    assert refused.value.message() == "no output 'OUTPUT__0' in this model: its outputs are 'label', 'probabilities'"
    with pytest.raises(InferenceServerException, match="the classification extension is not served"):
        client.infer("digits", [given], outputs=[triton.InferRequestedOutput("label", class_count=3)],
                     headers=bearer(token))


def test_a_text_model_answers_strings(api):
    """charlm takes its token ids (``input``, INT64) or text (``text``, BYTES): a text is read as
    the ids of its last ``context`` characters, and texts of any length share a request."""
    store, token, servers = api
    import tritonclient.http as triton

    client = triton_client(servers["charlm"])
    meta = client.get_model_metadata("lm1", headers=bearer(token))
    assert meta["inputs"] == [{"name": "input", "datatype": "INT64", "shape": [-1, 16]},
                              {"name": "text", "datatype": "BYTES", "shape": [-1]}]
    texts = ["to be or not to be, that is the question", "abc", "a"]
    given = triton.InferInput("text", [len(texts)], "BYTES")
    given.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object))
    result = client.infer("lm1", [given], headers=bearer(token))
    recipe = resolve("charlm", CHARLM)
    for i, text in enumerate(texts):
        ids = recipe.encode(text)[-16:].numpy().astype(np.float32)[None]
        want = expected(store, "lm1", ids)
        close(result.as_numpy("probabilities")[i], want.combined[0])
        assert result.as_numpy("label")[i] == want.combined[0].argmax()
    ids = triton.InferInput("input", [1, 16], "INT64")  # the ids themselves, as INT64
    ids.set_data_from_numpy(recipe.encode(texts[0])[-16:].numpy()[None])
    by_ids = client.infer("lm1", [ids], headers=bearer(token))
    close(by_ids.as_numpy("probabilities")[0], result.as_numpy("probabilities")[0])
    unknown = triton.InferInput("text", [1], "BYTES")
    unknown.set_data_from_numpy(np.array([b"To Be!"], dtype=object))
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match="text 0: character 'T' is not in the vocabulary"):
        client.infer("lm1", [unknown], headers=bearer(token))


def test_kserve_rest_client_checks_health_and_infers_in_binary(api):
    store, token, servers = api
    from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig
    from kserve.protocol.infer_type import RequestedOutput

    async def scenario():
        url = servers["ensemble"].url
        client = InferenceRESTClient(RESTConfig(protocol="v2"))
        try:
            assert await client.is_server_live(url) and await client.is_server_ready(url)
            assert await client.is_model_ready(url, "ens1", headers=bearer(token))
            assert not await client.is_model_ready(url, "ens1")
            answers = []
            for rows, outputs in ((1, None), (20, None), (20, [RequestedOutput("member_1_probabilities")])):
                given = InferInput("input", [rows, 64], "FP32")
                given.set_data_from_numpy(digits(rows))  # binary data: the client's default
                request = InferRequest("ens1", [given], request_outputs=outputs)
                answers.append(await client.infer(url, request, "ens1", headers=bearer(token)))
            wrong = InferInput("pixels", [1, 64], "FP32")
            wrong.set_data_from_numpy(digits(1))
            with pytest.raises(httpx.HTTPStatusError) as refused:
                await client.infer(url, InferRequest("ens1", [wrong]), "ens1", headers=bearer(token))
            return answers, refused.value
        finally:
            await client.close()

    answers, refused = asyncio.run(scenario())
    for answer, rows in zip(answers[:2], (1, 20)):
        outputs = {o.name: o.as_numpy() for o in answer.outputs}
        want = expected(store, "ens1", digits(rows))
        close(outputs["probabilities"], want.combined)
        np.testing.assert_array_equal(outputs["label"], want.combined.argmax(-1))
    [member] = answers[2].outputs
    assert member.name == "member_1_probabilities"
    close(member.as_numpy(), expected(store, "ens1", digits(20)).per_member[1])
    assert refused.response.status_code == 400
    assert "no input 'pixels' in this model: its inputs are 'input' (FP32 [-1, 64])" in str(refused)


def test_the_openapi_document_validates_and_names_the_bearer_scheme(api):
    from openapi_spec_validator import validate

    _, _, servers = api
    doc = httpx.get(f"{servers['ensemble'].url}/openapi.json").json()
    validate(doc)
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer",
        "description": "a token from `tensorturn token create`, sent as `Authorization: Bearer <token>`"}
    for path, methods in doc["paths"].items():
        for operation in methods.values():
            assert "422" not in operation["responses"], path
            if path.startswith("/v2/models/"):
                assert operation["security"] == [{"bearer": []}], path
                assert {"401", "404"} <= set(operation["responses"]), path
    assert set(doc["paths"]) >= {"/v2", "/v2/models/{name}/ready", "/v2/models/{name}/versions/{version}/infer"}


def test_the_docs_page_loads_nothing_from_another_host(api):
    _, _, servers = api
    url = servers["digits"].url
    page = httpx.get(f"{url}/docs")
    assert page.status_code == 200
    sources = re.findall(r"""(?:src|href)=["']([^"']+)""", page.text) + re.findall(r"url: ?'([^']+)'", page.text)
    assert sources and all(s.startswith("/") for s in sources), sources
    for source in sources:
        assert httpx.get(f"{url}{source}").status_code == 200, source


def test_binary_outputs_read_back_with_each_clients_own_parser():
    """Strings (a classifier's class names) and numbers after the JSON, framed as the binary
    tensor data extension says, decode with Triton's and KServe's parsers."""
    from kserve import InferResponse
    from tritonclient.http import InferResult

    from tensorturn.recipes.answer import encode_outputs
    from tensorturn.recipes.kinds import Output

    outputs = [Output("label", "INT64", np.array([3, 0])), Output("probabilities", "FP32", np.eye(2, dtype=np.float32)),
               Output("class_name", "BYTES", np.array(["three", "zéro"], dtype=object))]
    body, length = encode_outputs("m", "v", "id", outputs, {"label", "class_name"})
    triton = InferResult.from_response_body(body, header_length=length)
    kserve = {o.name: o.as_numpy() for o in InferResponse.from_bytes(body, length).outputs}
    for decoded in (triton.as_numpy, kserve.get):
        assert decoded("label").tolist() == [3, 0]
        assert decoded("probabilities").tolist() == [[1.0, 0.0], [0.0, 1.0]]
    assert triton.as_numpy("class_name").tolist() == [b"three", "zéro".encode()]
    assert kserve["class_name"].tolist() == ["three", "zéro"]
    assert encode_outputs("m", "v", "id", outputs)[1] is None  # all JSON: no header
