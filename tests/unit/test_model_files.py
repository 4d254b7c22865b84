"""A model file, or a folder `tensorturn export` wrote, that is not what it says: loaded with
`tensorturn.load`, it is one TensorTurnError line naming the file — never a raw KeyError,
TypeError, JSONDecodeError or SafetensorError — and a config that asks for more than the weights
file holds is refused before any of it is allocated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tensorturn.export
from tensorturn.errors import TensorTurnError
from tensorturn.recipes.digits import DigitsMLP
from tensorturn.store.objects import sha256_hex
from tensorturn.store.tensors import ensemble_bytes, model_bytes, to_bytes

CONFIG = {"hidden": [8], "dropout": 0.0}


def weights(config: dict = CONFIG) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return DigitsMLP().model(config).state_dict()


def folder(path: Path, data: bytes, edit=None, old: bool = False) -> Path:
    """An exported folder holding model file ``data``, its ``tensorturn.json`` naming it by sha256
    (as a crafter would write it: the pair agrees), changed by ``edit(config)``; ``old``: laid
    out as exports were before (``config.json``, ``model.safetensors``)."""
    path.mkdir(parents=True, exist_ok=True)
    model_file, config_file = ("model.safetensors", "config.json") if old else MODEL_AND_CONFIG
    (path / model_file).write_bytes(data)
    config = {"format": "tensorturn-export/1" if old else "tensorturn-export/2", "model_file": model_file,
              "model_sha256": sha256_hex(data),
              "recipe": {"name": "digits-mlp", "options": {}}, "input": {"shape": [64], "datatype": "FP32"},
              "task": "classification", "model": {"kind": "single", "config": CONFIG}}
    if edit:
        edit(config)
    (path / config_file).write_text(json.dumps(config))
    return path


MODEL_AND_CONFIG = ("tensorturn.safetensors", "tensorturn.json")


def test_a_folder_exported_before_the_layout_changed_still_loads(tmp_path):
    """Exports once kept TensorTurn's files as config.json and model.safetensors (now the names
    transformers reads): such a folder loads as it is, and a transformers config.json beside a
    tensorturn.json is never taken for TensorTurn's."""
    data = model_bytes(weights(), "digits-mlp", CONFIG)
    old = tensorturn.export.load(folder(tmp_path / "old", data, old=True))
    new = folder(tmp_path / "new", data)
    (new / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    rows = torch.rand(3, 64).numpy() * 16
    assert (old.predict(rows)["label"] == tensorturn.export.load(new).predict(rows)["label"]).all()


def refused(path: Path, *expected: str) -> str:
    """``load(path)`` fails in one line naming ``expected`` (the file); the line."""
    with pytest.raises(TensorTurnError) as caught:
        tensorturn.export.load(path)
    said = str(caught.value)
    assert "\n" not in said, said
    for words in expected:
        assert words in said, said
    return said


def file_with(meta_edit) -> bytes:
    """A model file whose metadata ``meta_edit(meta)`` changed (the weights as they are)."""
    from tensorturn.store.tensors import model_metadata

    meta = model_metadata("digits-mlp", CONFIG)
    meta_edit(meta)
    return to_bytes(weights(), meta)


def drop(name):
    return lambda d: d.pop(name)


def put(name, value):
    return lambda d: d.__setitem__(name, value)


CONFIG_CASES = {
    "not JSON": lambda p: (p / "tensorturn.json").write_text("{not json"),
    "no recipe": lambda p: folder(p, model_bytes(weights(), "digits-mlp", CONFIG), drop("recipe")),
    "recipe a string": lambda p: folder(p, model_bytes(weights(), "digits-mlp", CONFIG), put("recipe", "digits-mlp")),
    "recipe without name": lambda p: folder(p, model_bytes(weights(), "digits-mlp", CONFIG), put("recipe", {})),
    "standalone options a list": lambda p: folder(p, model_bytes(weights(), "digits-mlp", CONFIG),
                                                  put("recipe", {"name": "digits-mlp", "standalone_options": [1]})),
    "no input": lambda p: folder(p, model_bytes(weights(), "digits-mlp", CONFIG), drop("input")),
    "input shape a string": lambda p: folder(p, model_bytes(weights(), "digits-mlp", CONFIG),
                                             put("input", {"shape": "64"})),
    "sha256 a number": lambda p: folder(p, model_bytes(weights(), "digits-mlp", CONFIG), put("model_sha256", 7)),
    "dataset elsewhere": lambda p: folder(p, model_bytes(weights(), "digits-mlp", CONFIG), put("dataset", "../..")),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_a_malformed_description_is_one_line_naming_it(case, tmp_path):
    path = folder(tmp_path / "m", model_bytes(weights(), "digits-mlp", CONFIG))
    CONFIG_CASES[case](path)
    refused(path, str(path / "tensorturn.json"))


def truncated(data: bytes) -> bytes:
    return data[:len(data) - 100]


MODEL_CASES = {
    "empty": lambda: b"",
    "garbage": lambda: bytes(range(256)) * 4,
    "header cut short": lambda: model_bytes(weights(), "digits-mlp", CONFIG)[:200],
    "tensors cut short": lambda: truncated(model_bytes(weights(), "digits-mlp", CONFIG)),
    "header not an object": lambda: (2).to_bytes(8, "little") + b"[]",
    "no config": lambda: file_with(drop("config")),
    "config not JSON": lambda: file_with(put("config", "{hidden")),
    "config a list": lambda: file_with(put("config", "[1, 2]")),
    "config of wrong types": lambda: file_with(put("config", json.dumps({"hidden": "abc", "dropout": 0.0}))),
    "config missing a key": lambda: file_with(put("config", json.dumps({"dropout": 0.0}))),
    "options not JSON": lambda: file_with(put("recipe_options", "{")),
    "state not learned": lambda: file_with(put("recipe_state", json.dumps({"mean": {"__tensor__": {}}}))),
    "unknown format": lambda: file_with(put("format", "something/9")),
    "ensemble without members": lambda: file_with(lambda m: m.update(format="tensorturn-ensemble/1", vote="soft")),
    "ensemble members not members": lambda: file_with(lambda m: m.update(
        format="tensorturn-ensemble/1", vote="soft", members=json.dumps([{"member": "x"}]))),
}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_a_malformed_model_file_is_one_line_naming_it(case, tmp_path):
    path = folder(tmp_path / "m", MODEL_CASES[case]())
    refused(path, str(path / "tensorturn.safetensors"))


def test_a_config_asking_for_more_than_the_file_holds_is_refused_before_it_is_built(tmp_path, monkeypatch):
    """A config asking ``hidden [30000, 30000]`` of a 77 kB weights file once allocated
    3.6 GB before the mismatch was found. The model is built on the meta device first: the
    crafted one never on a real device, and the line names the tensor and both shapes."""
    greedy = {"hidden": [30000, 30000], "dropout": 0.0}
    path = folder(tmp_path / "greedy", model_bytes(weights(), "digits-mlp", greedy))
    ensemble = folder(tmp_path / "ensemble", ensemble_bytes([(0, weights(), CONFIG), (1, weights(), greedy)],
                                                            "digits-mlp", "soft"))
    built: list[tuple[list, str]] = []
    model = DigitsMLP.model

    def spy(self, config):
        out = model(self, config)
        built.append((list(config["hidden"]), next(out.parameters()).device.type))
        return out

    monkeypatch.setattr(DigitsMLP, "model", spy)
    said = refused(path, str(path / "tensorturn.safetensors"),
                   "tensor '0.bias' is [8] in the file, [30000] in the model")
    assert "refused before building it" in said
    assert built == [([30000, 30000], "meta")]  # never on a real device
    # an ensemble's members are checked each, under their prefix, all before any is built
    built.clear()
    refused(ensemble, "tensor 'm1.0.bias' is [8] in the file, [30000] in the model")
    assert built == [([8], "meta"), ([30000, 30000], "meta")]


def test_a_file_missing_a_tensor_or_holding_another_is_refused_naming_it(tmp_path):
    state = weights()
    state.pop("3.bias")
    refused(folder(tmp_path / "missing", model_bytes(state, "digits-mlp", CONFIG)),
            "tensor '3.bias' is absent in the file, [10] in the model")
    state = {**weights(), "extra": torch.zeros(3)}
    refused(folder(tmp_path / "extra", model_bytes(state, "digits-mlp", CONFIG)),
            "tensor 'extra' is [3] in the file, absent in the model")


def test_a_whole_folder_of_these_files_loads_and_predicts(tmp_path):
    """The checks refuse only what is wrong: the same helpers' honest folder loads."""
    loaded = tensorturn.export.load(folder(tmp_path / "ok", model_bytes(weights(), "digits-mlp", CONFIG)))
    assert loaded.predict([[0.0] * 64])["probabilities"].shape == (1, 10)
