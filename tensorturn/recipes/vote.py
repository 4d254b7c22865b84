"""The vote: how an ensemble's members' outputs become one answer, the same wherever it is taken —
served (:meth:`tensorturn.predictor.Predictor.predict`), measured (:class:`EnsembleModel`,
the ensemble as one model for a recipe's ``evaluate``), checked (``check-recipe``).

A recipe's kind picks the rule (``Kind.combine``; a recipe may override ``Recipe.combine``):
classification takes the mean probability (:func:`soft`, the default; Lakshminarayanan et al.
2017, arXiv 1612.01474) or a majority of top classes (:func:`hard`); regression the mean of the
values. The ensemble mode's vote task, which stores the ensemble and measures it, is
:mod:`tensorturn.modes.ensemble.vote`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from tensorturn.recipes.base import Recipe

# a hard vote's winner is raised by this much of its share: far above float32's resolution
# (2**-24), so it stays the largest through log and softmax, and small enough to read as a share
TIE_MARGIN = 2.0 ** -16


def soft(per_member: torch.Tensor) -> torch.Tensor:
    """The members' mean output (``[members, rows, ...]`` → ``[rows, ...]``)."""
    return per_member.mean(0)


def hard(per_member: torch.Tensor) -> torch.Tensor:
    """A majority vote of class probabilities (``[members, rows, classes]``): each member's top
    class is one vote; the result is the vote shares, the winner's raised by :data:`TIE_MARGIN` of
    itself. The winner is chosen exactly — most votes, then the higher mean probability, then the
    lower class number — and the margin is one float32 keeps through ``log`` and ``softmax``, so
    the label served (argmax here) and the one an ensemble's ``evaluate`` measures (argmax after
    ``Kind.ensemble_forward`` and the recipe's softmax) are the same class. (A tie-break added as
    ``1e-6 * mean`` was below float32's resolution at a vote share: ties went to the first class
    when served and to another after the log, and the two disagreed.)"""
    mean = per_member.mean(0)
    counts = F.one_hot(per_member.argmax(-1), mean.shape[-1]).float().sum(0)  # exact integers
    leading = counts == counts.amax(-1, keepdim=True)
    winner = torch.where(leading, mean.float(), -torch.inf).argmax(-1, keepdim=True)
    votes = counts / per_member.shape[0]
    return votes.scatter(-1, winner, votes.gather(-1, winner) * (1 + TIE_MARGIN))


class EnsembleModel(nn.Module):
    """An ensemble as one model, so that a recipe's ``evaluate`` measures its vote the way it
    measures a fused model: the forward pass returns what one member's would, with the vote in
    it (the recipe's kind says how: ``Kind.ensemble_forward`` — for classification, logits whose
    softmax is the combined probability; for regression, the combined values). Members' outputs
    are combined by ``Recipe.combine``, as when served."""

    def __init__(self, recipe: Recipe, models: list[nn.Module], vote: str):
        super().__init__()
        self.members = nn.ModuleList(models)
        self.recipe, self.vote = recipe, vote

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raw = torch.stack([m(x) for m in self.members])
        return self.recipe.kind.ensemble_forward(raw, lambda p: self.recipe.combine(p, self.vote))
