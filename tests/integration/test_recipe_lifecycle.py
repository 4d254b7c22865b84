"""A recipe's lifecycle: what raw_data learns from the training data is kept with the run and set
on every instance before any hook — trainers, the outer step, the vote, serve, export and
`tensorturn.load`, none of which runs raw_data; a recipe that breaks it, or whose evaluate raises,
is refused at submit in one line; an evaluation that raises at a round fails the run there
(recipes in tests/learned_recipes.py and tests/failing.py)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from conftest import RECIPES, ROOT, as_agent_of, tt_here
from conftest import run_eval as evaluate
from conftest import run_outer as outer
from conftest import run_shard as shard

from tensorturn import config, layout, trust
from tensorturn.errors import RecipeError
from tensorturn.recipes import base as recipe_base
from tensorturn.recipes import recipe_of, resolve
from tensorturn.recipes.contract import CheckFailed, check
from tensorturn.recipes.learned import MAX_BYTES, encode, restore
from tensorturn.spec import RunSpec
from tensorturn.state.manifest import load_spec
from tensorturn.store.objects import open_store

ALLOW = "learned_recipes:*"


FUSED = dict(mode="fused", rounds=2, shards=2, sync_every=10)


@pytest.fixture(autouse=True)
def _allowed():
    config.use(trust.with_allowed(config.current(), [ALLOW, "failing:*"]))


# ---- the learned state: what it holds, what it refuses --------------------------------------------

def test_learned_state_comes_back_as_it_was_set():
    learned = {"mean": torch.arange(6, dtype=torch.float32).reshape(2, 3) / 7, "half": torch.ones(2).half(),
               "scale": 2.5, "n": 3, "vocab": ["a", "b"], "pair": (1, 2), "nested": {"k": [None, True]},
               "counts": np.array([[1, 2]], dtype=np.int64), "np_scalar": np.float32(0.25)}
    doc = json.loads(json.dumps(encode(learned)))  # as the spec stores it
    back = restore(type("R", (), {})(), doc)
    assert torch.equal(back.mean, learned["mean"]) and back.mean.dtype == torch.float32
    assert torch.equal(back.half, learned["half"]) and back.half.dtype == torch.float16
    assert (back.scale, back.n, back.vocab, back.pair, back.nested) == (2.5, 3, ["a", "b"], [1, 2], {"k": [None, True]})
    assert back.counts.dtype == np.int64 and back.counts.tolist() == [[1, 2]]
    assert back.np_scalar == 0.25


@pytest.mark.parametrize("value,said", [
    (object(), "self.bad to a builtins.object"),
    ({1: "x"}, "self.bad to a dict with keys that are not strings"),
    ([b"bytes"], "self.bad to a builtins.bytes"),
])
def test_learned_state_that_cannot_be_kept_is_named(value, said):
    with pytest.raises(RecipeError, match=f"raw_data set {said}, which cannot be kept with the run"):
        encode({"ok": 1.0, "bad": value})


def test_learned_state_over_the_limit_is_refused_naming_the_largest():
    with pytest.raises(RecipeError, match=r"MiB \(self.big the largest\)"):
        encode({"small": 1.0, "big": torch.zeros(MAX_BYTES // 4)})


def test_an_instance_that_finds_the_splits_loaded_gets_what_raw_data_set():
    first = resolve("learned_recipes:Diabetes")
    recipe_base.load_splits(first)
    second = resolve("learned_recipes:Diabetes")  # raw_data never runs on it: the splits are loaded
    assert not hasattr(second, "_ystd")
    recipe_base.load_splits(second)
    assert second._ystd == first._ystd and torch.equal(second._xmean, first._xmean)


# ---- refused at submit, in one line, nothing stored ------------------------------------------------

@pytest.mark.parametrize("recipe,said", [
    ("learned_recipes:SetByLoss", "failed at evaluate: AttributeError: 'SetByLoss' object has no attribute "
                                  "'_weight'; every machine"),
    ("learned_recipes:Unstorable", "failed at data: raw_data set self._scaler to a builtins.object"),
    ("failing:Failing", "failed at evaluate: ValueError: boom in evaluate (a second line: the user sees "
                        f"both, on one line) ({(RECIPES / 'failing.py').relative_to(ROOT)}:"),
])
@pytest.mark.parametrize("mode", ["fused", "ensemble"])
def test_a_recipe_that_would_fail_on_the_agents_is_refused_at_submit(world, monkeypatch, recipe, said, mode):
    monkeypatch.setenv("TT_FAIL_IN", "evaluate")
    options = FUSED if mode == "fused" else dict(mode="ensemble", members=2, segments=1, segment_steps=5)
    spec = RunSpec.create(store_url=(world.tmp / "s").as_uri(), recipe=recipe, **options)
    from tensorturn import runs

    with pytest.raises(RecipeError) as caught:
        runs.submit(spec, world.broker)
    message = str(caught.value)
    assert message.startswith(f"recipe {recipe!r} {said}") and message.endswith("nothing was queued")
    where = rf"\({RECIPES.relative_to(ROOT)}/\w+\.py:\d+ in \S+\); "  # the recipe's file and line
    assert "\n" not in message and ("Unstorable" in recipe or re.search(where, message))
    if "SetByLoss" in recipe:
        assert "a hook other than raw_data sets self._weight: set it in __init__ or in raw_data" in message
    assert not world.board.runs.exists(spec.run_id)
    assert not (world.tmp / "s" / layout.RUNS).exists() or not any((world.tmp / "s" / layout.RUNS).iterdir())


def test_check_recipe_tries_the_hooks_on_a_fresh_instance():
    assert check("learned_recipes:Diabetes")["val_metrics"]["mae"] > 1  # in points of the score
    with pytest.raises(CheckFailed, match="evaluate: AttributeError: .* no attribute '_weight'; every machine"):
        check("learned_recipes:SetByLoss")
    with pytest.raises(CheckFailed, match=r"^data: raw_data set self._scaler"):
        check("learned_recipes:Unstorable")


# ---- kept with the run: every instance gets it ----------------------------------------------------

def test_the_run_keeps_what_raw_data_learned_and_every_task_builds_the_recipe_with_it(world):
    spec = world.submit(recipe="learned_recipes:Diabetes", **FUSED)
    stored = load_spec(open_store(spec.store_url), spec.run_id)
    assert set(stored.recipe_state) == {"_ymean", "_ystd", "_xmean", "_xstd", "_range", "_tensorturn_input_shape"}
    recipe_base._SPLITS.clear()  # as on a fresh agent: nothing loaded, nothing learned here
    recipe = recipe_of(stored)
    assert abs(recipe._ymean - 152) < 5 and recipe._xmean.shape == (10,)  # before any hook ran
    for r in range(2):
        shard(spec, r, 0)
        shard(spec, r, 1)
        outer(spec, r)
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "succeeded", doc["error"]
    assert 20 < doc["metrics"]["test_mae"] < 150  # points of the score, not std units


# ---- an evaluation that raises at a round ------------------------------------------------------------

def test_an_evaluation_that_raises_fails_the_run_at_that_round_with_the_recipes_traceback(world, monkeypatch):
    """A bug that shows only on a whole split (not on the 16 rows tried at submit): the run fails
    at the first evaluation, on its first attempt, with the recipe's traceback; nothing of the
    round after the next starts."""
    spec = world.submit(recipe="failing:Failing", **{**FUSED, "rounds": 3})
    monkeypatch.setenv("TT_FAIL_IN", "evaluate")
    monkeypatch.setenv("TT_FAIL_OVER_ROWS", "16")
    shard(spec, 0, 0)
    shard(spec, 0, 1)
    outer(spec, 0, evaluate=False)
    evaluate(spec, 0)
    doc = world.board.describe(spec.run_id)
    assert doc["state"] == "failed"
    assert doc["error"].startswith("r0/eval failed: the recipe's evaluate raised ValueError: boom in evaluate")
    evals = [a for a in doc["attempts"] if a["task"] == "r0/eval"]
    assert len(evals) == 1 and 'failing.py", line' in evals[0]["traceback"]
    as_agent_of(spec)
    shard(spec, 1, 0)  # queued before the evaluation failed: refused, the run is finished
    assert not [a for a in world.board.describe(spec.run_id)["attempts"]
                if a["task"].startswith("r1/") and a["outcome"] == "succeeded"]
    status = tt_here("status", spec.run_id, "--broker", world.broker, "--store", spec.store_url, "--debug")
    assert status.returncode == 1 and "boom in evaluate" in status.stdout + status.stderr
    assert 'failing.py", line' in status.stdout + status.stderr


# ---- both modes, serve, export and load where the data is not ---------------------------------------

