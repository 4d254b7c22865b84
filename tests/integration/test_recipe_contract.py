"""The recipe contract, enforced where it matters: what `check-recipe` refuses, `run`, `serve`,
`distill` and `soup` refuse too, in one line; a hook a task kind never calls is refused; targets
scaled by the recipe come back in the user's units; both modes measure by the recipe's
`evaluate`; classification answers carry class names (recipes in tests/contract_recipes.py)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
import torch
from click.testing import CliRunner
from conftest import bearer, clean_env, tt_many
from contract_recipes import NamedDigits

from tensorturn import config, layout, trust
from tensorturn.cli import cli
from tensorturn.predictor import Predictor
from tensorturn.recipes import resolve
from tensorturn.recipes.contract import CheckFailed, check, check_contract
from tensorturn.store.objects import open_store
from tensorturn.store.tensors import ensemble_bytes

ALLOW = "contract_recipes:*"
NO_TASK = "contract_recipes:NoTask"
REFUSED_NO_TASK = ("failed at data: task 'classification' needs integer class targets, got "
                   "torch.float32 (a regression recipe sets task = 'regression')")
# serving and souping read no training data (it may live only on the trainers): the model's one
# output per row gives the recipe away there
SERVED_NO_TASK = ("failed at predict: 1 class per row; a classifier needs at least 2 (a "
                  "regression recipe sets task = 'regression')")


@pytest.fixture(autouse=True)
def _allowed():
    config.use(trust.with_allowed(config.current(), [ALLOW]))


def refusal(name: str) -> str:
    with pytest.raises(CheckFailed) as caught:
        check_contract(name, resolve(name), "nothing was queued")
    return str(caught.value)


@pytest.mark.parametrize("name,problem", [
    ("NoTask", REFUSED_NO_TASK),
    ("ProbaRegression", "failed at hooks: predict_proba is not used for task 'regression': override predict"),
    ("ScaledDigits", "failed at hooks: unscale_targets is not used for task 'classification'"),
    ("TwoNames", "failed at classes: 2 names for the model's 10 classes"),
    ("WideRegression", "failed at predict: 3 values per row, but the targets have 1"),
    ("WrongWidth", "failed at predict: RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
])
def test_a_broken_contract_is_one_line_naming_the_step(name, problem):
    message = refusal(f"contract_recipes:{name}")
    assert message.startswith(f"recipe 'contract_recipes:{name}' {problem}")
    assert message.endswith("; nothing was queued") and "\n" not in message


def test_the_contract_holds_for_the_builtin_and_test_recipes():
    for name in ("digits-mlp", "charlm", "contract_recipes:Diabetes", "contract_recipes:DiabetesR2",
                 "contract_recipes:NamedDigits"):
        check_contract(name, resolve(name), "nothing was queued")
        check_contract(name, resolve(name), "it is not served", data=False)  # as serve checks


def test_check_recipe_refuses_an_ignored_override_and_notes_unscaled_standardised_targets():
    result = CliRunner().invoke(cli, ["check-recipe", "contract_recipes:ProbaRegression"])
    assert result.exit_code == 2
    assert result.stderr == ("error: recipe 'contract_recipes:ProbaRegression' failed at hooks: "
                             "predict_proba is not used for task 'regression': override predict\n")
    config.use(trust.with_allowed(config.current(), ["regress:*"]))
    assert "define unscale_targets" in check("regress:Diabetes")["notes"][0]  # standardised, not said
    assert check("contract_recipes:Diabetes")["notes"] == []


def store_ensemble(store, run_id: str, recipe_name: str, members: int = 2, **spec_options) -> None:
    """A finished ensemble of ``recipe_name`` in ``store`` (untrained members, from one seed: a
    soup's average is a model), with its signed manifest."""
    recipe = resolve(recipe_name)
    config_ = recipe.default_config()
    torch.manual_seed(0)
    state = recipe.model(config_).state_dict()
    blob = ensemble_bytes([(m, {k: v.clone() for k, v in state.items()}, config_)
                           for m in range(members)], recipe_name, "soft")
    key = layout.key("final_ensemble", run_id)
    sha = store.put_bytes(key, blob)
    doc = {"run_id": run_id, "mode": "ensemble", "state": "succeeded", "recipe": recipe_name,
           "model_uri": store.uri(key), "model_sha256": sha, "metrics": {},
           "members": [{"member": m, "state": "succeeded", "config": {"model": config_}}
                       for m in range(members)],
           "spec": {"mode": "ensemble", "recipe": recipe_name, "recipe_options": {}, "run_id": run_id,
                    "options": spec_options}}
    store.put_json(layout.key("manifest", run_id), trust.pool_key().sign_doc("manifest", doc))


def test_serve_distill_and_soup_refuse_a_recipe_that_breaks_the_contract(tmp_path):
    from tensorturn.merge.distill import distill_spec
    from tensorturn.merge.soup import soup

    store = open_store((tmp_path / "store").as_uri())
    store_ensemble(store, "old", NO_TASK, init_from="base")  # stored before the contract was enforced
    keys = set(store.list(layout.RUNS))
    served = CliRunner().invoke(cli, ["serve", "old", "--store", store.url, "--allow-recipe", ALLOW])
    assert served.exit_code == 2
    assert served.stderr == f"error: recipe '{NO_TASK}' {SERVED_NO_TASK}; run old is not served\n"
    with pytest.raises(CheckFailed, match=re.escape(f"{REFUSED_NO_TASK}; nothing was queued")):
        distill_spec("old", store.url)
    with pytest.raises(CheckFailed, match=re.escape(f"{SERVED_NO_TASK}; no soup was made")):
        soup(store, "old")
    assert set(store.list(layout.RUNS)) == keys  # nothing stored


def test_an_ensemble_is_measured_by_the_recipes_evaluate_as_one_model(tmp_path):
    """vote_metrics is the recipe's evaluate of the ensemble as one model: the same function a
    fused run's model is measured by; the default evaluate and the served values are in the
    user's units."""
    from tensorturn.modes.ensemble.vote import vote_metrics

    store = open_store((tmp_path / "store").as_uri())
    for name in ("contract_recipes:Diabetes", "contract_recipes:DiabetesR2"):
        store_ensemble(store, name.split(":")[1], name, members=3)
        predictor = Predictor.from_bytes(store.get_bytes(layout.key("final_ensemble", name.split(":")[1])))
        for i, m in enumerate(predictor.models):  # members that differ
            with torch.no_grad():
                m.get_parameter("2.bias").fill_(0.1 * i)
        recipe = predictor.recipe
        pieces = list(recipe.eval_pieces("test"))
        figures = vote_metrics(predictor, pieces)
        x, y = pieces[0]
        assert {k: v for k, v in figures.items() if k.startswith("test_") and k != "test_rows"} == pytest.approx(
            {f"test_{k}": v for k, v in recipe.evaluate(predictor.as_model(), x, y).items()})
        assert figures["test_rows"] == len(y)  # the rows its figures read
        combined, per_member = predictor.predict(x)
        # in the user's units: the score runs from 25 to 346; the model's units are near 0
        assert combined.shape == (len(y), 1) and 100 < float(combined.mean()) < 200
        assert torch.allclose(combined, per_member.mean(0), atol=1e-4)
        user_y = recipe.unscale_targets(y)
        assert figures["test_mae"] == pytest.approx(float((combined[:, 0] - user_y).abs().mean()), rel=1e-5)
        assert set(figures) >= {"test_loss", "member_mean_test_mae", "best_member_test_loss"}
    assert "test_r2" in figures and figures["best_member_test_r2"] == max(
        recipe.evaluate(m, x, y)["r2"] for m in predictor.models)


def test_a_regression_ensemble_whose_members_all_do_worse_than_the_mean_says_so(tmp_path):
    """Each member's R² over the test rows, where the recipe's evaluate gives none, is in the
    vote's figures (the ensemble's own stay evaluate's); when even the best member's is below 0
    the result says so in a line."""
    from tensorturn.modes.ensemble.vote import vote_metrics
    from tensorturn.runs.display import result_lines

    store = open_store((tmp_path / "store").as_uri())
    store_ensemble(store, "bad", "contract_recipes:Diabetes", members=3)
    predictor = Predictor.from_bytes(store.get_bytes(layout.key("final_ensemble", "bad")))
    for i, m in enumerate(predictor.models):  # members that differ: 0, ⅓ and ⅔ of a std off
        with torch.no_grad():
            m.get_parameter("2.bias").fill_(i / 3)
    pieces = list(predictor.recipe.eval_pieces("test"))
    [(x, y)] = pieces
    by_evaluate = [resolve("contract_recipes:DiabetesR2").evaluate(m, x, y)["r2"] for m in predictor.models]
    figures = vote_metrics(predictor, pieces)
    assert figures["best_member_test_r2"] == pytest.approx(max(by_evaluate), rel=1e-4)
    assert figures["member_mean_test_r2"] == pytest.approx(sum(by_evaluate) / 3, rel=1e-4)
    assert "test_r2" not in figures
    doc = {"run_id": "bad", "state": "succeeded", "metrics": {**figures, "best_member_test_r2": 0.02}}
    assert not [line for line in result_lines(doc) if "R²" in line]  # one member better than the mean
    for m in predictor.models:  # every member 3 std off: worse than the mean, each
        with torch.no_grad():
            m.get_parameter("2.bias").fill_(3.0)
    figures = vote_metrics(predictor, pieces)
    assert figures["best_member_test_r2"] < 0
    best = f"{figures['best_member_test_r2']:.4g}"
    assert [line for line in result_lines({**doc, "metrics": figures}) if "R²" in line] == [
        f"  warning: every member's R² on the test rows is below 0 (the best: {best}): each predicts "
        f"worse than the targets' mean (a learning rate too high? too few steps?)"]

def test_a_hard_votes_figures_are_of_its_vote_and_its_loss_of_the_mean_probability():
    from tensorturn.modes.ensemble.vote import vote_metrics

    recipe = resolve("digits-mlp")
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(recipe.model(recipe.default_config()).eval())
    members = [{"member": m} for m in range(3)]
    soft = vote_metrics(Predictor(recipe, models, "soft", members), recipe.eval_pieces("test"))
    hard = vote_metrics(Predictor(recipe, models, "hard", members), recipe.eval_pieces("test"))
    x, y = next(recipe.eval_pieces("test"))
    served, per_member = Predictor(recipe, models, "hard", members).predict(x)
    assert hard["test_accuracy"] == pytest.approx(float((served.argmax(-1) == y).float().mean()))
    # untrained members disagree on most rows: the label is the class of most votes, then of the
    # higher mean probability (counts step by 2, a mean difference is below 1)
    counts = torch.nn.functional.one_hot(per_member.argmax(-1), served.shape[-1]).sum(0).double()
    assert torch.equal(served.argmax(-1), (2 * counts + per_member.double().mean(0)).argmax(-1))
    assert hard["test_loss"] == pytest.approx(soft["test_loss"])


def test_classification_answers_carry_class_names():
    import numpy as np
    import orjson

    from tensorturn.recipes.answer import Prediction, encode_answer

    recipe = resolve("contract_recipes:NamedDigits")
    found = check("contract_recipes:NamedDigits")
    assert found["outputs"]["class_name"] == {"datatype": "BYTES", "shape": ["N"]}
    probabilities = np.eye(10, dtype=np.float32)[[3, 0, 9]]
    answer = orjson.loads(encode_answer("m", "v", "id", Prediction(probabilities, probabilities[None]),
                                        None, recipe.kind, recipe.classes))
    outputs = {o["name"]: o for o in answer["outputs"]}
    assert outputs["label"]["data"] == [3, 0, 9]
    assert outputs["class_name"] == {"name": "class_name", "datatype": "BYTES", "shape": [3],
                                     "data": ["three", "zero", "nine"]}
    digits = resolve("digits-mlp")  # no names: no class_name
    plain = orjson.loads(encode_answer("m", "v", "id", Prediction(probabilities, probabilities[None]),
                                       None, digits.kind, digits.classes))
    assert [o["name"] for o in plain["outputs"]] == ["label", "probabilities"]


def test_the_api_serves_class_names_and_lists_them_in_its_metadata(tmp_path):
    from tensorturn.serve import tokens
    from tensorturn.serve.app import create_app

    store = open_store((tmp_path / "store").as_uri())
    store_ensemble(store, "named", "contract_recipes:NamedDigits")
    token, _ = tokens.create(store, "tests")
    x = resolve("digits-mlp").raw_data()[4][:4]
    body = {"inputs": [{"name": "input", "shape": [4, 64], "datatype": "FP32", "data": x.flatten().tolist()}]}

    async def ask() -> tuple[dict, httpx.Response]:
        app = create_app(store, "named")
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://api") as api:
            meta = (await api.get("/v2/models/named", headers=bearer(token))).json()
            return meta, await api.post("/v2/models/named/infer", headers=bearer(token), json=body)

    meta, r = asyncio.run(ask())
    assert {"name": "class_name", "datatype": "BYTES", "shape": [-1]} in meta["outputs"]
    assert r.status_code == 200, r.text
    outputs = {o["name"]: o for o in r.json()["outputs"]}
    assert outputs["class_name"]["data"] == [NamedDigits.classes[i] for i in outputs["label"]["data"]]


def test_a_pushed_tables_text_labels_are_its_class_names(tmp_path):
    import pyarrow as pa
    import pyarrow.csv as pacsv

    from tensorturn import data as datasets

    rows = 60
    table = pa.table({"a": [float(i % 7) for i in range(rows)], "b": [float(i % 5) for i in range(rows)],
                      "kind": [("cat", "dog", "eel")[i % 3] for i in range(rows)]})
    pacsv.write_csv(table, tmp_path / "pets.csv")
    store = open_store((tmp_path / "store").as_uri())
    config.use(config.current().with_(store_url=store.url))
    datasets.push(store, str(tmp_path / "pets.csv"), "pets", label="kind")
    recipe = resolve("tabular", {"dataset": "pets"})
    assert recipe.task == "classification" and recipe.classes == ["cat", "dog", "eel"]
    check_contract("tabular", recipe, "nothing was queued")
    found = check("tabular", {"dataset": "pets"})
    assert found["outputs"]["class_name"] == {"datatype": "BYTES", "shape": ["N"]}


def test_distill_allows_the_recipe_its_signed_ensemble_names(tmp_path):
    """The user's own ensemble of the user's own recipe distills without --allow-recipe, as
    `resume` continues a run of it: the recipe comes from the manifest signed with the pool key."""
    store = open_store((tmp_path / "store").as_uri())
    store_ensemble(store, "ens", "contract_recipes:NamedDigits")
    config.reload()  # this process no longer allows contract_recipes (the test's fixture did)
    result = CliRunner().invoke(cli, ["distill", "ens", "--store", store.url,
                                      "--broker", "redis://127.0.0.1:1/0", "--rounds", "1"])
    assert "not allowed" not in result.stderr
    assert result.exit_code == 3 and "cannot reach broker" in result.stderr  # it got as far as the pool


def test_check_recipe_passes_good_recipes_and_names_the_first_problem():
    # five checks, each a process that loads torch: all at once
    ok, digits, wrong, broken, missing = tt_many(
        ("check-recipe", "regress:Diabetes", "--json"), ("check-recipe", "digits-mlp", "--json"),
        ("check-recipe", "regress:WrongTarget"), ("check-recipe", "failing:Failing"),
        ("check-recipe", "nosuchmodule:Thing"),
        envs=[None, None, None, clean_env(TT_FAIL_IN="evaluate"), None])
    ok = json.loads(ok.stdout)
    assert ok["task"] == "regression" and ok["outputs"] == {"prediction": {"datatype": "FP32", "shape": ["N"]}}
    assert set(ok["val_metrics"]) == {"loss", "mae"}
    digits = json.loads(digits.stdout)
    assert set(digits["outputs"]) == {"label", "probabilities"}

    assert wrong.returncode == 2
    assert wrong.stderr.strip() == (
        "error: recipe 'regress:WrongTarget' failed at data: task 'classification' needs integer "
        "class targets, got torch.float32 (a regression recipe sets task = 'regression')")
    assert broken.returncode == 2 and len(broken.stderr.strip().splitlines()) == 1
    assert "failed at evaluate: ValueError: boom in evaluate" in broken.stderr
    assert missing.returncode == 2 and "failed at build" in missing.stderr
