"""Kinds of task: what a model's outputs are, how an ensemble combines them, how they are measured
and what the API serves. A recipe names its kind in ``Recipe.task``; everything downstream (the
ensemble vote, evaluation, ``tensorturn serve``, ``check-recipe``) asks the kind, never assumes
classification.

* ``classification`` (and ``language_model``, whose "classes" are the next token after a window):
  outputs are class probabilities; the ensemble takes their mean (``soft``) or a majority (``hard``); metrics
  are accuracy and NLL; the API serves ``label`` and ``probabilities``.
* ``regression``: outputs are the predicted values; the ensemble takes their mean (the vote rule
  does not apply); metrics are MSE (the loss) and MAE; the API serves ``prediction``.

A recipe of another kind overrides :meth:`Recipe.predict`, :meth:`Recipe.combine` and
:meth:`Recipe.evaluate` (and names a kind these tables know for serving).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

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

    def outputs(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Per-row outputs of one model on preprocessed ``x`` (here: class probabilities)."""
        return torch.softmax(model(x).float(), dim=-1)

    def combine(self, per_member: torch.Tensor, vote: str) -> torch.Tensor:
        """One output per row from every member's (``[members, rows, ...]``).

        Soft: the mean probability. Hard: each member's top class is one vote; the result is the
        vote shares, with ties going to the class of higher mean probability."""
        mean = per_member.mean(0)
        if vote != "hard":
            return mean
        votes = F.one_hot(per_member.argmax(-1), mean.shape[-1]).float().mean(0)
        return votes + 1e-6 * mean

    def metrics(self, combined: torch.Tensor, y: torch.Tensor, probabilities: torch.Tensor | None = None
                ) -> dict[str, float]:
        """``accuracy`` and ``loss`` (NLL of ``probabilities``, default ``combined``)."""
        p = combined if probabilities is None else probabilities
        return {"accuracy": float((combined.argmax(-1) == y).float().mean()),
                "loss": float(F.nll_loss(torch.log(p.clamp_min(1e-12)), y))}

    def served(self, combined: Any) -> list[Output]:
        return [Output("label", "INT64", combined.argmax(-1)), Output("probabilities", "FP32", combined)]

    def member_output(self, member: int) -> str:
        return f"member_{member}_probabilities"


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

    def outputs(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).float()

    def combine(self, per_member: torch.Tensor, vote: str) -> torch.Tensor:
        return per_member.mean(0)

    def metrics(self, combined: torch.Tensor, y: torch.Tensor, probabilities: torch.Tensor | None = None
                ) -> dict[str, float]:
        pred = combined.reshape(y.shape) if combined.numel() == y.numel() else combined
        err = pred - y.float()
        return {"loss": float((err ** 2).mean()), "mae": float(err.abs().mean())}

    def served(self, combined: Any) -> list[Output]:
        data = combined[..., 0] if combined.ndim == 2 and combined.shape[-1] == 1 else combined
        return [Output("prediction", "FP32", data)]

    def member_output(self, member: int) -> str:
        return f"member_{member}_prediction"


_KINDS: dict[str, Kind] = {"classification": Kind(), "language_model": LanguageModel(),
                           "regression": Regression()}


def kind_of(task: str) -> Kind:
    try:
        return _KINDS[task]
    except KeyError:
        raise ValueError(f"unknown task kind {task!r}: use one of {', '.join(KINDS)}") from None
