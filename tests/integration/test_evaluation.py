"""Bounded evaluation: a fused round's validation figures and the final test figures read, by
default, as many rows as one shard trains in a round (nanoGPT's eval_iters, scaled to the
round), the whole split when it is that small or the user asks (``--eval-batches 0``), and
every figure says how many rows it used."""

from __future__ import annotations

import pytest
import torch
from conftest import run_rounds

from tensorturn import runs
from tensorturn.modes.fused.options import eval_passes
from tensorturn.recipes import resolve
from tensorturn.recipes.digits import DigitsMLP
from tensorturn.spec import RunSpec
from tensorturn.train.diloco import initial_state
from tensorturn.train.loop import load_model


def fused_spec(tmp_path, **options) -> RunSpec:
    return RunSpec.create(mode="fused", recipe="digits-mlp", store_url=(tmp_path / "s").as_uri(),
                          shards=2, **options).validate()


@pytest.mark.parametrize("sync_every, batch, accumulate, eval_batch_size, given, passes", [
    (2, 8, 1, 16, None, 1),      # gpt2-small's 1 round × 2 steps: one pass of 16 rows
    (100, 8, 1, 16, None, 50),   # what a shard trains: H × batch rows, in passes
    (3, 10, 2, 16, None, 4),     # accumulated minibatches are trained rows too; passes round up
    (1, 1, 1, 512, None, 1),     # at least one pass
    (2, 8, 1, 16, 7, 7),         # --eval-batches N
    (2, 8, 1, 16, 0, None),      # --eval-batches 0: the whole split
])
def test_the_default_budget_is_what_a_shard_trains_in_a_round(tmp_path, monkeypatch, sync_every, batch,
                                                                accumulate, eval_batch_size, given, passes):
    spec = fused_spec(tmp_path, sync_every=sync_every, batch_size=batch, accumulate=accumulate,
                      eval_batches=given)
    recipe = resolve("digits-mlp")
    monkeypatch.setattr(recipe, "eval_batch_size", eval_batch_size)
    assert eval_passes(spec, recipe) == passes


def test_evaluate_counted_reads_the_passes_asked_and_says_how_many_rows(monkeypatch):
    recipe = resolve("digits-mlp")
    monkeypatch.setattr(recipe, "eval_batch_size", 16)
    model = load_model(recipe, initial_state(recipe, 0), recipe.default_config(), torch.device("cpu"))
    whole = len(recipe.sample_rows("val", 10 ** 6)[1])
    assert whole > 32
    for passes, rows in ((1, 16), (2, 32), (None, whole), (0, whole)):
        metrics, read = recipe.evaluate_counted(model, "val", max_batches=passes)
        assert read == rows and set(metrics) == {"loss", "accuracy"}
    # evaluate_split is the same figures without the count
    assert recipe.evaluate_split(model, "val", max_batches=2) == recipe.evaluate_counted(model, "val", max_batches=2)[0]


@pytest.mark.parametrize("given, bounded", [(None, True), (0, False)])
def test_a_fused_runs_figures_say_how_many_rows_they_read(world, monkeypatch, given, bounded):
    """One round of 2 shards × 2 steps of 8 rows: by default one pass of 16 rows for the round's
    validation and the final test figures; with --eval-batches 0 the whole splits."""
    monkeypatch.setattr(DigitsMLP, "eval_batch_size", 16)
    spec = world.submit(mode="fused", recipe="digits-mlp", rounds=1, shards=2, sync_every=2,
                        batch_size=8, eval_batches=given)
    run_rounds(spec)
    doc = runs.describe(spec.run_id, world.broker, spec.store_url)
    recipe = resolve("digits-mlp")
    whole_val, whole_test = (len(recipe.sample_rows(split, 10 ** 6)[1]) for split in ("val", "test"))
    (round0,) = doc["rounds"]
    assert doc["state"] == "succeeded"
    assert (round0["val_rows"], doc["metrics"]["test_rows"]) == ((16, 16) if bounded else (whole_val, whole_test))
    assert round0["val_loss"] is not None and doc["metrics"]["test_loss"] is not None
