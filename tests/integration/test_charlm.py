"""The built-in ``charlm`` recipe: its fixed split, vocabulary, model, and one fused run."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys

import pytest
import torch

from tensorturn.errors import RecipeError
from tensorturn.pool.capacity import estimate
from tensorturn.recipes import charlm, load_splits, resolve

# A small text with a learnable structure (and a non-ASCII character) for custom-data tests.
SMALL_TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog {i * 7 % 13} — ok\n"
                     for i in range(80))

SPLIT_DIGEST = """
import hashlib, torch
from tensorturn.recipes import resolve
h = hashlib.sha256()
for t in resolve("charlm").raw_data():
    h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode() + t.numpy().tobytes())
print(h.hexdigest())
"""


def split_digest(recipe) -> str:
    h = hashlib.sha256()
    for t in recipe.raw_data():
        h.update(str(t.dtype).encode() + str(tuple(t.shape)).encode() + t.numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def recipe():
    return resolve("charlm")


@pytest.fixture(scope="module")
def splits(recipe):
    return load_splits(recipe)


def test_split_is_deterministic_across_instances_and_processes():
    first = resolve("charlm")
    a = first.raw_data()
    for cache in (charlm.load_text, charlm._vocab, charlm._ids):  # nothing shared but the code
        cache.cache_clear()
    b = resolve("charlm").raw_data()
    assert len(a) == len(b) == 6
    for ta, tb in zip(a, b):
        assert ta.dtype == tb.dtype == torch.int64
        assert torch.equal(ta, tb)
    fresh = subprocess.run([sys.executable, "-c", SPLIT_DIGEST], capture_output=True, text=True,
                           timeout=120, check=True)
    assert fresh.stdout.strip() == split_digest(first)


def test_windows_vocab_and_split_sizes(recipe, splits):
    text, vocab = recipe.text(), recipe.vocab()
    assert 300_000 <= len(text) <= 500_000
    assert vocab == sorted(set(text)) and len(vocab) == len(set(vocab))
    assert recipe.decode(recipe.encode(text[:2000])) == text[:2000]
    ctx = recipe.context
    assert ctx == 64
    for x, y in ((splits.x_train, splits.y_train), (splits.x_val, splits.y_val),
                 (splits.x_test, splits.y_test)):
        assert x.shape == y.shape and x.shape[1] == ctx and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])            # targets are the next characters
        assert torch.equal(x[1:, 0], y[:-1, -1])            # windows are consecutive, stride = ctx
        assert int(x.min()) >= 0 and int(x.max()) < len(vocab)
    assert len(splits.x_val) <= charlm.MAX_EVAL_WINDOWS and len(splits.x_test) <= charlm.MAX_EVAL_WINDOWS
    # train is the first 90 % of the text, validation the next 5 %, test the last 5 %
    assert recipe.decode(splits.x_train[0]) == text[:ctx]
    assert recipe.decode(splits.x_val[0]) == text[int(len(text) * 0.9):][:ctx]
    assert recipe.decode(splits.x_test[0]) == text[int(len(text) * 0.95):][:ctx]
    assert len(splits.x_train) == (int(len(text) * 0.9) - 1) // ctx


def test_loss_at_init_is_about_ln_vocab(recipe, splits):
    torch.manual_seed(0)
    model = recipe.model(recipe.default_config())
    metrics = recipe.evaluate(model, splits.x_val, splits.y_val)
    expected = math.log(len(recipe.vocab()))
    assert abs(metrics["loss"] - expected) < 0.15 * expected, (metrics, expected)
    assert 0 <= metrics["accuracy"] <= 1
    probs = recipe.predict_proba(model, recipe.preprocess(splits.x_test[:5].float()))
    assert probs.shape == (5, len(recipe.vocab()))
    assert torch.allclose(probs.sum(-1), torch.ones(5), atol=1e-5)


def test_overfits_one_small_batch(recipe, splits):
    torch.manual_seed(0)
    model = recipe.model(recipe.default_config())
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    x, y = splits.x_train[:8], splits.y_train[:8]
    first = recipe.evaluate(model, x, y)["loss"]
    model.train()
    for _ in range(40):
        loss = recipe.loss(model, x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    last = recipe.evaluate(model, x, y)["loss"]
    assert last < 0.6 * first, (first, last)


def test_memory_estimate_runs_the_model_on_meta_with_int64_input(recipe):
    need = estimate(recipe, recipe.default_config(), recipe.batch_size)
    assert need["parameters_bytes"] == 4 * sum(p.numel() for p in recipe.model(recipe.default_config()).parameters())
    assert need["activations_bytes"] > 0      # the forward pass ran (it counts 0 when it fails)
    # the outer step's share: the running average, then the new weights and an evaluation batch
    assert need["outer_step_bytes"] == 2 * need["parameters_bytes"] + need["eval_activations_bytes"]
    assert need["total_bytes"] >= max(need["training_bytes"], need["outer_step_bytes"])


def test_gpt2_small_is_gpt2_smalls_shape_over_bytes():
    big = resolve("gpt2-small")
    need = estimate(big, big.default_config(), big.batch_size)  # on meta: nothing allocated
    d, layers, vocab, context = 768, 12, 256, 256
    per_block = 12 * d * d + 13 * d  # attention 4d² + 4d, MLP 8d² + 5d, two LayerNorms 4d
    expected = layers * per_block + vocab * d + context * d + 2 * d + d * vocab + vocab
    assert need["parameters_bytes"] == 4 * expected and len(big.vocab()) == 256
    assert big.default_config() == {"n_layer": 12, "n_head": 12, "n_embd": 768, "dropout": 0.0}


def test_custom_data_file_and_options(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text(SMALL_TEXT, encoding="utf-8")
    recipe = resolve("charlm", {"data": str(path), "context": 16, "n_embd": 32, "n_head": 2})
    assert recipe.vocab() == sorted(set(SMALL_TEXT)) and "—" in recipe.vocab()
    s = load_splits(recipe)
    assert s.x_train.shape[1] == 16 and len(s.x_train) == (int(len(SMALL_TEXT) * 0.9) - 1) // 16
    assert recipe.decode(s.x_train[0]) == SMALL_TEXT[:16]
    torch.manual_seed(0)
    model = recipe.model(recipe.default_config())
    assert model.tok.weight.shape == (len(recipe.vocab()), 32)
    assert math.isfinite(recipe.evaluate(model, s.x_val, s.y_val)["loss"])

    (tmp_path / "tiny.txt").write_text("far too short", encoding="utf-8")
    with pytest.raises(ValueError, match="too short"):
        resolve("charlm", {"data": str(tmp_path / "tiny.txt")}).raw_data()
    with pytest.raises(RecipeError, match="does not accept"):
        resolve("charlm", {"vocab": 3})
    with pytest.raises(RecipeError, match="n_head"):
        resolve("charlm", {"n_embd": 30, "n_head": 4})


def test_a_fixed_vocabulary_builds_the_model_without_the_text(tmp_path):
    """``vocabulary`` (what an exported folder loads with): the model, its input check and its
    input shape need no text; a text with a character outside it is refused in one line."""
    (tmp_path / "small.txt").write_text(SMALL_TEXT, encoding="utf-8")
    from_text = resolve("charlm", {"data": str(tmp_path / "small.txt"), "context": 16})
    vocabulary = from_text.standalone_options()["vocabulary"]
    assert vocabulary == sorted(set(SMALL_TEXT))
    fixed = resolve("charlm", {"data": str(tmp_path / "gone.txt"), "context": 16, "vocabulary": vocabulary})
    assert fixed.vocab() == vocabulary and fixed.input_shape() == [16]
    assert fixed.model(fixed.default_config()).tok.weight.shape[0] == len(vocabulary)
    assert fixed.check_input(torch.tensor([[len(vocabulary)]]).numpy()) is not None
    assert resolve("charlm", {"vocabulary": "".join(vocabulary)}).vocab() == vocabulary  # a string too
    short = resolve("charlm", {"data": str(tmp_path / "small.txt"), "vocabulary": "abc"})
    with pytest.raises(ValueError, match="not in the vocabulary"):
        short.raw_data()
    for bad in ("", ["ab"], "aa", 3):
        with pytest.raises(RecipeError, match="vocabulary"):
            resolve("charlm", {"vocabulary": bad})
    assert resolve("gpt2-small", {"n_layer": 1}).standalone_options() == {}  # 256 bytes: nothing to carry
    student = {"teacher": "20990101-000000-abcdef", "recipe": "charlm",
               "recipe_options": {"data": str(tmp_path / "small.txt"), "context": 16}}
    carried = resolve("distill", student).standalone_options()
    assert carried == {"recipe_options": {**student["recipe_options"], "vocabulary": vocabulary}}
    (tmp_path / "small.txt").unlink()
    for cache in (charlm.load_text, charlm._vocab, charlm._ids):  # what was read of it is gone too
        cache.cache_clear()
    rebuilt = resolve("distill", {**student, **carried})  # as an exported student loads
    assert rebuilt.model(from_text.default_config()).tok.weight.shape[0] == len(vocabulary)


