"""Kinds of task: what a model's outputs are, how an ensemble combines them, how they are measured
and what the API serves. A recipe names its kind in ``Recipe.task``; everything downstream (the
ensemble vote, evaluation, ``tensorturn serve``, ``check-recipe``) asks the kind, never assumes
classification.

* ``classification`` (and ``language_model``, whose "classes" are the next token after a window):
  outputs are class probabilities; the ensemble takes their mean (``soft``) or a majority (``hard``,
  :mod:`tensorturn.recipes.vote`); metrics
  are accuracy and NLL; the API serves ``label`` and ``probabilities`` (and ``class_name`` when the
  recipe names its ``classes``).
* ``regression``: outputs are the predicted values; the ensemble takes their mean (the vote rule
  does not apply); metrics are MSE (the loss) and MAE; the API serves ``prediction``. Values pass
  through ``Recipe.unscale_targets`` before they are served or measured: the user's units.

Which recipe hooks each kind calls is in :class:`tensorturn.recipes.base.Recipe`'s docstring;
a hook a kind never calls (:attr:`Kind.ignores`) is refused at submit and by ``check-recipe``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tensorturn.recipes.vote import hard, soft

KINDS = ("classification", "language_model", "regression")


@dataclass(frozen=True)
class Output:
    """One named output tensor of the inference API."""

    name: str
    datatype: str
    data: Any          # a numpy array (rows first) or a tensor


class Kind:
    """Classification: probabilities in, label + probabilities out."""

    name = "classification"
    # recipe hooks this kind never calls → what to do instead; (hook, caller): ignored unless the
    # recipe overrides the caller too (its own code may call the hook)
    ignores: dict[tuple[str, str | None], str] = {
        ("unscale_targets", None): "class targets have no units to restore"}
    scaled = False  # whether outputs and targets pass through Recipe.unscale_targets

    def outputs(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Per-row outputs of one model on preprocessed ``x`` (here: class probabilities)."""
        return torch.softmax(model(x).float(), dim=-1)

    def ensemble_forward(self, raw: torch.Tensor, combine: Any) -> torch.Tensor:
        """What an ensemble's forward pass returns, from its members' (``raw``: ``[members, ...]``
        model outputs, logits here): the log of the combined probabilities, so that a softmax —
        the recipe's own ``predict_proba`` or ``evaluate`` — sees the vote."""
        return torch.log(combine(torch.softmax(raw.float(), dim=-1)).clamp_min(1e-12))

    def combine(self, per_member: torch.Tensor, vote: str) -> torch.Tensor:
        """One output per row from every member's (``[members, rows, ...]``): the mean
        probability (``soft``) or the vote shares (``hard``, :func:`tensorturn.recipes.vote.hard`)."""
        return hard(per_member) if vote == "hard" else soft(per_member)

    def metrics(self, combined: torch.Tensor, y: torch.Tensor, probabilities: torch.Tensor | None = None
                ) -> dict[str, float]:
        """``accuracy`` and ``loss`` (NLL of ``probabilities``, default ``combined``)."""
        p = combined if probabilities is None else probabilities
        return {"accuracy": float((combined.argmax(-1) == y).float().mean()),
                "loss": float(F.nll_loss(torch.log(p.clamp_min(1e-12)), y))}

    def served(self, combined: Any, classes: list[str] | None = None) -> list[Output]:
        """``label`` and ``probabilities``; ``class_name`` too when the recipe names its classes."""
        import numpy as np

        label = combined.argmax(-1)
        out = [Output("label", "INT64", label), Output("probabilities", "FP32", combined)]
        if classes:
            names = np.asarray(list(classes), dtype=object)
            out.append(Output("class_name", "BYTES", names[np.asarray(label, dtype=np.int64)]))
        return out

    def member_output(self, member: int) -> str:
        return f"member_{member}_probabilities"

    def member_values(self, values: Any) -> Any:
        """A member's output as served (its probabilities, as they are)."""
        return values


class LanguageModel(Kind):
    """A language model: a classification over the next token. Its targets may hold every
    position of a window (``[rows, context]``); served and combined outputs are the distribution
    of the token after the window, measured against the last position."""

    name = "language_model"

    def metrics(self, combined: torch.Tensor, y: torch.Tensor, probabilities: torch.Tensor | None = None
                ) -> dict[str, float]:
        return super().metrics(combined, y[:, -1] if y.ndim == combined.ndim else y, probabilities)


class Regression(Kind):
    """Regression: predicted values; the ensemble's mean; MSE and MAE; ``prediction`` served."""

    name = "regression"
    ignores = {("predict_proba", "predict"): "override predict"}
    scaled = True

    def outputs(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).float()

    def ensemble_forward(self, raw: torch.Tensor, combine: Any) -> torch.Tensor:
        return combine(raw.float())

    def combine(self, per_member: torch.Tensor, vote: str) -> torch.Tensor:
        return soft(per_member)  # the vote rule does not apply to values

    def metrics(self, combined: torch.Tensor, y: torch.Tensor, probabilities: torch.Tensor | None = None
                ) -> dict[str, float]:
        pred = combined.reshape(y.shape) if combined.numel() == y.numel() else combined
        err = pred - y.float()
        return {"loss": float((err ** 2).mean()), "mae": float(err.abs().mean())}

    def served(self, combined: Any, classes: list[str] | None = None) -> list[Output]:
        return [Output("prediction", "FP32", self.member_values(combined))]

    def member_output(self, member: int) -> str:
        return f"member_{member}_prediction"

    def member_values(self, values: Any) -> Any:
        """One value a row (``[rows]``) where the model predicts one: a member's shape is the vote's."""
        return values[..., 0] if values.ndim == 2 and values.shape[-1] == 1 else values


class Explained:
    """R² (``1 − Σ(pred − y)² / Σ(y − ȳ)²``) over a split read in pieces, exact whatever the
    pieces: a mean of each piece's R² is not the split's. Below 0, the predictions do worse than
    the targets' own mean. Values in the user's units (``Recipe.unscale_targets``)."""

    def __init__(self) -> None:
        self.errors = self.sum = self.squares = 0.0
        self.rows = 0
        self.origin: float | None = None  # sums taken from a first target: no cancellation far from 0

    def add(self, predicted: torch.Tensor, y: torch.Tensor) -> None:
        y = y.double()
        pred = (predicted.reshape(y.shape) if predicted.numel() == y.numel() else predicted).double()
        if self.origin is None and y.numel():
            self.origin = float(y.reshape(-1)[0])
        shifted = y - (self.origin or 0.0)
        self.errors += float(((pred - y) ** 2).sum())
        self.sum, self.squares = self.sum + float(shifted.sum()), self.squares + float((shifted ** 2).sum())
        self.rows += y.numel()

    def value(self) -> float | None:
        """R²; None without rows or without spread in the targets."""
        spread = self.squares - self.sum ** 2 / self.rows if self.rows else 0.0
        return 1.0 - self.errors / spread if spread > 0 else None


_KINDS: dict[str, Kind] = {"classification": Kind(), "language_model": LanguageModel(),
                           "regression": Regression()}


def kind_of(task: str) -> Kind:
    try:
        return _KINDS[task]
    except KeyError:
        raise ValueError(f"unknown task kind {task!r}: use one of {', '.join(KINDS)}") from None
