"""Weight soups: an ensemble whose members were fine-tuned from one model, averaged into one.

Wortsman et al. (2022, arXiv 2203.05482): models fine-tuned from the same pre-trained weights lie
in one basin of the loss, so the average of their weights is a model — often better than any of
them, at one model's inference cost. Members that started from their own random
initialisations do not (their average is not a model), so a soup needs an ensemble trained with
``--init-from RUN``; anything else is refused with the reason.

``tensorturn soup RUN`` runs here, on the machine that asks (it reads the members from the store;
averaging and a validation pass take seconds), and stores the soup as a run of its own — an
ordinary one-model run, served like a fused model, whose manifest names the ensemble, the rule
and the members in the soup.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tensorturn import layout, trust
from tensorturn.predictor import load_result
from tensorturn.recipes import Recipe
from tensorturn.recipes.contract import check_contract
from tensorturn.spec import RunState, new_run_id
from tensorturn.state.manifest import finished_ensemble
from tensorturn.store.objects import Store
from tensorturn.store.tensors import model_bytes
from tensorturn.train.distill import SoupRefused, check_soupable, greedy_soup, uniform_soup

RULES = ("best", "greedy", "uniform")


def soup(store: Store, run_id: str, rule: str = "best", eval_batches: int | None = None
         ) -> dict[str, Any]:
    """Make the soup of ensemble ``run_id`` by ``rule`` (``best``: the greedy or the uniform
    soup, whichever scores higher on validation; greedy on a tie), store it as a new one-model
    run and return that run's manifest (its metrics: test figures of the soup, and the
    validation score of every member and of both soups)."""
    if rule not in RULES:
        raise SoupRefused(f"--rule {rule!r} is not one of {', '.join(RULES)}")
    manifest = finished_ensemble(store, run_id, "a soup")
    opts = manifest["spec"].get("options") or {}
    if not opts.get("init_from"):
        raise SoupRefused(f"the members of run {run_id} started from their own random "
                          f"initialisations: the average of their weights is not a model. A soup "
                          f"needs members fine-tuned from one model (an ensemble run with "
                          f"--init-from RUN); `tensorturn distill {run_id}` merges any ensemble")
    predictor, _ = load_result(store, run_id)
    recipe = predictor.recipe
    check_contract(manifest["recipe"], recipe, "no soup was made", data=False)
    states = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in predictor.models]
    check_soupable(states)
    config = predictor.members[0]["config"]
    model = recipe.model(config)

    def score(state: dict[str, torch.Tensor]) -> float:
        model.load_state_dict(state)
        return validation_score(recipe, model, eval_batches)

    t0 = time.time()
    member_scores = [score(s) for s in states]
    uniform = uniform_soup(states)
    greedy, chosen = greedy_soup(states, score)
    scores = {"uniform": score(uniform), "greedy": score(greedy)}
    if rule == "best":
        rule = "greedy" if scores["greedy"] >= scores["uniform"] else "uniform"
    state = greedy if rule == "greedy" else uniform
    in_soup = [predictor.members[m]["member"] for m in (chosen if rule == "greedy" else range(len(states)))]
    model.load_state_dict(state)
    metrics = {f"test_{k}": v for k, v in recipe.evaluate_split(model.eval(), "test",
                                                                  max_batches=eval_batches).items()}
    metrics.update({f"val_score_{name}": value for name, value in scores.items()})
    metrics["best_member_val_score"] = max(member_scores)
    metrics["members_in_soup"] = len(in_soup)
    return store_soup(store, manifest, recipe, state, config, metrics, t0, {
        "souped_from": run_id, "rule": rule, "members": in_soup,
        "member_val_scores": dict(zip((m["member"] for m in predictor.members), member_scores)),
        "init_from": opts["init_from"]})


def validation_score(recipe: Recipe, model: torch.nn.Module, eval_batches: int | None) -> float:
    """Validation accuracy (classification), or minus the validation loss; SoupRefused when the
    recipe has no validation rows (a soup is chosen on them)."""
    val = recipe.evaluate_split(model.eval(), "val", max_batches=eval_batches)
    if not val:
        raise SoupRefused("the recipe's data has no validation rows: a soup is chosen on "
                          "validation (push the dataset with a validation fraction)")
    return val["accuracy"] if "accuracy" in val else -val["loss"]


def store_soup(store: Store, ensemble: dict[str, Any], recipe: Recipe, state: dict[str, torch.Tensor],
               config: dict[str, Any], metrics: dict[str, Any], started: float,
               lineage: dict[str, Any]) -> dict[str, Any]:
    """Store the soup's model and a signed manifest: a finished one-model run of its own."""
    run_id = new_run_id()
    spec = ensemble["spec"]
    blob = model_bytes(state, spec["recipe"], config, spec.get("recipe_options") or {},
                       spec.get("recipe_state") or {})
    key = layout.key("final_model", run_id)
    sha = store.put_bytes(key, blob)
    doc = {"run_id": run_id, "mode": "fused", "state": RunState.SUCCEEDED, "recipe": spec["recipe"],
           "metrics": metrics, "model_uri": store.uri(key), "model_sha256": sha, "rounds": [],
           "attempts": [], "incidents": [], "warnings": [], "bytes_up": len(blob), "bytes_down": 0,
           "created_at": started, "started_at": started, "finished_at": time.time(),
           "error": None, "lineage": lineage,
           "spec": {"mode": "fused", "recipe": spec["recipe"], "run_id": run_id,
                    "recipe_options": spec.get("recipe_options") or {},
                    "recipe_state": spec.get("recipe_state") or {}, "options": {}}}
    store.put_json(layout.key("manifest", run_id), trust.pool_key().sign_doc("manifest", doc))
    return doc
