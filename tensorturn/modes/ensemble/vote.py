"""The ensemble's vote: the task that ends an ensemble run, and what it measures.

Once every member has finished (succeeded or dropped, :func:`tensorturn.modes.ensemble.all_finished`),
one vote task (queued once, :data:`tensorturn.layout.VOTE_CLAIM`) merges the finished members into
one ensemble file, measures the vote on the test split with the recipe's own ``evaluate``
(:func:`vote_metrics`) and finishes the run. The run fails only when fewer than ``min_members``
finished, naming every dropped member's reason.

The rule that combines members' outputs is the recipe's kind's (``Recipe.combine``, soft or
hard: :mod:`tensorturn.recipes.vote`); a model file is loaded and served by
:class:`~tensorturn.predictor.Predictor`, the same code here as in ``serve`` and ``export``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from tensorturn import layout
from tensorturn.config import mask_text
from tensorturn.data.source import pinned
from tensorturn.modes.ensemble import all_finished, options
from tensorturn.pool.celery_app import app
from tensorturn.predictor import Predictor
from tensorturn.recipes import recipe_of
from tensorturn.recipes.base import code_of_the_recipe
from tensorturn.recipes.kinds import Explained
from tensorturn.spec import MemberState, Outcome, RunState
from tensorturn.store import seals
from tensorturn.store.tensors import ensemble_bytes, from_bytes
from tensorturn.tasks.attempt import SUCCEEDED, Unit, execute


@app.task(bind=True, name="tensorturn.ensemble.vote", max_retries=None)
def vote(self, run_id: str, sig: str | None = None) -> dict[str, Any]:
    """Merge the finished members into one ensemble file, evaluate the vote, finish the run."""
    return execute(self, run_id, layout.vote_label(), VoteUnit, sig)


# metrics where higher is better (the best member's is the largest); any other: the smallest
HIGHER_IS_BETTER = ("accuracy", "r2", "f1", "auc", "precision", "recall")


def vote_metrics(predictor: Predictor, pieces: Iterable[tuple[torch.Tensor, torch.Tensor]]
                 ) -> dict[str, float]:
    """The ensemble's test metrics by the recipe's own ``evaluate`` — the same function, of the
    same meaning, as a fused run's — applied to the ensemble as one model
    (:meth:`Predictor.as_model`), beside the members' mean and best; for classification, how
    often members disagree. Under ``--vote hard`` the ``loss`` is the mean probability's (vote
    shares are not probabilities). For regression, each member's ``r2`` over the whole split
    (:class:`~tensorturn.recipes.kinds.Explained`) where the recipe's metrics have none — below
    0, worse than predicting the targets' mean —, in the members' mean and best (the ensemble's
    own figures stay those of ``evaluate``). The test split comes in ``pieces`` (one forward
    pass each); every other figure is a mean over rows."""
    recipe = predictor.recipe
    kind = recipe.kind
    ensemble = predictor.as_model()
    soft = predictor.as_model("soft") if predictor.vote == "hard" and not kind.scaled else None
    sums: dict[str, float] = {}
    per_member_sums: list[dict[str, float]] = [{} for _ in predictor.models]
    explained = [Explained() for _ in predictor.models] if kind.scaled else []
    rows = 0

    def add(into: dict[str, float], figures: dict[str, float], n: int) -> None:
        for name, value in figures.items():
            into[name] = into.get(name, 0.0) + value * n

    for x, y in pieces:
        n = len(y)
        if n == 0:
            continue
        with code_of_the_recipe("evaluate"):  # (the data read around it is not the recipe's code)
            figures = recipe.evaluate(ensemble, x, y)
            if soft is not None and "loss" in figures:
                figures["loss"] = recipe.evaluate(soft, x, y)["loss"]
            each = [recipe.evaluate(model, x, y) for model in predictor.models]
        add(sums, {f"test_{k}": v for k, v in figures.items()}, n)
        for into, member in zip(per_member_sums, each):
            add(into, member, n)
        for r2, model in zip(explained, predictor.models):
            r2.add(recipe.unscale_targets(recipe.predict(model, x)), recipe.unscale_targets(y.float()))
        if not kind.scaled:
            preds = predictor.member_outputs(x).argmax(-1)
            pairs = [(a, b) for a in range(len(preds)) for b in range(a + 1, len(preds))]
            add(sums, {"disagreement": sum(float((preds[a] != preds[b]).float().mean())
                                           for a, b in pairs) / len(pairs) if pairs else 0.0}, n)
        rows += n
    if not rows:
        return {}
    out = {name: total / rows for name, total in sums.items()}
    members = [{name: total / rows for name, total in m.items()} for m in per_member_sums]
    scores = [e.value() for e in explained]
    if scores and "r2" not in members[0]:
        for m, score in zip(members, scores):
            if score is not None:
                m["r2"] = score
    for name in members[0]:
        values = [m[name] for m in members]
        out[f"member_mean_test_{name}"] = sum(values) / len(values)
        out[f"best_member_test_{name}"] = max(values) if name in HIGHER_IS_BETTER else min(values)
    out["test_rows"] = rows  # as a fused run's result says how many rows its test figures read
    return out


class VoteUnit(Unit):
    def done(self) -> bool:
        return False  # a finished run (the vote's only output) returns before this

    def run(self) -> str:
        spec, store, board = self.spec, self.store, self.board
        opts, run_id = options(spec), spec.run_id
        if not all_finished(spec, board):  # a member was re-queued (a resume) since this was queued
            board.claims.release(run_id, layout.VOTE_CLAIM)  # the last member to finish queues it again
            return Outcome.REFUSED.says("members still training")
        members = board.members.all(run_id)
        done = [e for e in members if e["state"] == MemberState.SUCCEEDED]
        dropped = [e for e in members if e["state"] == MemberState.DROPPED]
        if len(done) < opts.min_members:
            reasons = "; ".join(f"member {e['member']}: {e['reason']}" for e in dropped)
            self.finish_run(RunState.FAILED, error=mask_text(f"only {len(done)} of {opts.members} members "
                                                      f"finished (--min-members {opts.min_members}): {reasons}"))
            return SUCCEEDED
        entries = []
        for e in done:
            m = e["member"]
            state = from_bytes(seals.get_bytes(store, layout.key("segment", run_id, m, opts.segments - 1)))
            entries.append((m, state, e["config"]["model"]))
        blob = ensemble_bytes(entries, spec.recipe, opts.vote, spec.recipe_options, spec.recipe_state)
        final = layout.key("final_ensemble", run_id)
        self.a.check_cancelled(now=True)
        sha = store.put_bytes(final, blob)
        pieces = recipe_of(spec).eval_pieces("test", spec.eval_batches)
        with pinned(spec.datasets):  # the file's recipe reads the run's dataset index, as checked
            metrics = vote_metrics(Predictor.from_bytes(blob), pieces)
        metrics.update(members_succeeded=len(done), members_dropped=len(dropped))
        self.finish_run(RunState.SUCCEEDED, metrics=metrics, model_uri=store.uri(final), model_sha256=sha)
        return SUCCEEDED
