"""`--format transformers` makes the exported folder itself one that transformers loads: its
tokenizer encodes text as the recipe does (charlm: characters; gpt2-small: UTF-8 bytes), and
`AutoModelForCausalLM` and `pipeline("text-generation")` continue a prompt with what `predict`
answers. Small models of each recipe's layout, at random weights: no run, no pool."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tensorturn.export.formats import write_gpt2
from tensorturn.export.loaded import ExportedModel
from tensorturn.predictor import Predictor
from tensorturn.recipes import resolve
from tensorturn.store.tensors import model_bytes

transformers = pytest.importorskip("transformers")

TEXT = "def main():\n    return {'a': 1, \"b\": [2, 3]}  # ok.\n"
VOCABULARY = sorted(set(TEXT))
CONTEXT = 16


def exported(tmp_path, recipe: str, options: dict) -> ExportedModel:
    """A model of ``recipe`` at random weights, as ``tensorturn.load`` gives it, its folder
    written as ``--format transformers`` writes it."""
    torch.manual_seed(0)
    r = resolve(recipe, options)
    config = r.default_config()
    data = model_bytes(r.model(config).state_dict(), recipe, config, options)
    predictor = Predictor.from_bytes(data)
    written = write_gpt2(predictor, tmp_path)
    assert written == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                       "tokenizer_config.json"]
    return ExportedModel(tmp_path, {"input": {"shape": [CONTEXT]}}, predictor)


@pytest.fixture(params=["charlm", "gpt2-small"])
def folder(request, tmp_path):
    sizes = {"n_layer": 1, "context": CONTEXT}
    if request.param == "charlm":
        options = {**sizes, "n_head": 2, "n_embd": 64, "vocabulary": VOCABULARY}
    else:  # 256 bytes fold into a model at least as wide
        options = {**sizes, "n_head": 4, "n_embd": 256}
    return exported(tmp_path, request.param, options)


def test_the_tokenizer_encodes_text_as_the_recipe_does(folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder.path)
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == folder.recipe.encode(TEXT).tolist()
    assert tokenizer.decode(ids) == TEXT and len(tokenizer) == len(folder.recipe.vocab())
    if folder.recipe.name == "gpt2-small":  # bytes: any text, one token per UTF-8 byte
        assert tokenizer("héllo ✓")["input_ids"] == list("héllo ✓".encode())
    else:  # a character outside the vocabulary is refused, as charlm refuses it
        with pytest.raises(Exception, match="(?i)unk|missing"):
            tokenizer("é")


def test_transformers_generates_what_predict_answers(folder):
    """Greedy generation, one token after each full window, is `predict`'s label; the next-token
    distribution is its probabilities; a prompt generates a continuation token by token that
    matches the TensorTurn model's own greedy steps."""
    from transformers import AutoModelForCausalLM, pipeline

    model = AutoModelForCausalLM.from_pretrained(folder.path).eval()
    windows = [TEXT[i:i + CONTEXT] for i in range(0, len(TEXT) - CONTEXT, 7)]
    rows = np.stack([folder.recipe.encode(w).numpy() for w in windows])
    served = folder.predict(rows)
    ids = torch.from_numpy(rows)
    with torch.no_grad():
        logits = model(ids).logits[:, -1]
    assert np.allclose(torch.softmax(logits, -1).numpy(), served["probabilities"], atol=1e-5)
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1)
    assert generated[:, -1].tolist() == served["label"].tolist()
    generate = pipeline("text-generation", model=str(folder.path))
    for window, row, label in zip(windows, rows, served["label"]):  # text in, text out
        (out,) = generate(window, max_new_tokens=1)
        assert out["generated_text"] == folder.recipe.decode([*row, label])
    # a short prompt, continued to the context: each step is the module's argmax
    prompt = folder.recipe.encode(TEXT[:6])
    (continued,) = model.generate(prompt[None], attention_mask=torch.ones(1, 6, dtype=torch.long),
                                  max_new_tokens=CONTEXT - 6)
    steps = prompt
    with torch.no_grad():
        while len(steps) < CONTEXT:
            steps = torch.cat([steps, folder.module(steps[None])[0, -1].argmax()[None]])
    assert continued.tolist() == steps.tolist()


def test_the_generation_config_declares_its_tokens(folder):
    config = json.loads((folder.path / "generation_config.json").read_text())
    assert config["pad_token_id"] == 0 and config.get("do_sample") is False
    assert config.get("eos_token_id") is None  # the vocabulary has no end-of-text token
    assert json.loads((folder.path / "config.json").read_text())["model_type"] == "gpt2"
