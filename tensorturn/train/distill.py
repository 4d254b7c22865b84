"""From an ensemble to one model: the teacher's targets, the distillation loss, and weight soups.

The math of issue 17, kept apart from the tasks that will use it (a distillation run trains one
student on the pool against the ensemble's vote; a soup averages members that share an
initialisation):

* :func:`teacher_targets` — the ensemble's soft vote at temperature T (the mean of the members'
  softmax(logits / T)), kept as its ``top_k`` most likely classes, renormalised: for a language
  model's vocabulary the stored targets stay small (k values and indices per position) rather
  than a vocabulary-sized row.
* :func:`distill_loss` — Hinton, Vinyals & Dean (2015, arXiv 1503.02531): α · T² · the
  cross-entropy of the student's softmax(z / T) against the teacher's targets (the KL divergence
  up to the teacher's entropy, a constant: the same gradients) + (1 − α) · the cross-entropy
  with the true labels. T² keeps the soft term's gradients on the scale of the hard one's.
* :func:`uniform_soup` and :func:`greedy_soup` — Wortsman et al. (2022, "Model soups"): the
  average of the members' weights, and the greedy soup that adds members in order of their own
  validation score while the soup's does not get worse. Only members of one architecture can be
  averaged (:func:`check_soupable` says which tensor differs); whether they share an
  initialisation — what makes a soup work — is the caller's to know.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from tensorturn.errors import SpecError

StateDict = dict[str, torch.Tensor]


class SoupRefused(SpecError):
    """The members cannot be averaged into one model."""


def teacher_targets(member_logits: torch.Tensor, temperature: float, top_k: int | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The vote of ``member_logits`` (``[members, rows, classes]``) at ``temperature``, as
    (probabilities ``[rows, k]``, class indices ``[rows, k]``), the k most likely classes of each
    row renormalised to sum to 1 (every class when ``top_k`` is None or not smaller)."""
    if temperature <= 0:
        raise ValueError(f"the temperature must be positive (got {temperature})")
    vote = torch.softmax(member_logits.float() / temperature, dim=-1).mean(0)
    classes = vote.shape[-1]
    k = classes if top_k is None else max(1, min(top_k, classes))
    values, indices = vote.topk(k, dim=-1)
    return values / values.sum(-1, keepdim=True), indices


def distill_loss(student_logits: torch.Tensor, target_values: torch.Tensor,
                 target_indices: torch.Tensor, labels: torch.Tensor | None, temperature: float,
                 alpha: float) -> torch.Tensor:
    """α · T² · CE(teacher ‖ softmax(z / T)) + (1 − α) · CE(labels, softmax(z)), averaged over
    rows (the hard term over the rows that have a label: :data:`NO_LABEL` marks those without).
    ``labels`` may be None only when α is 1 (soft targets alone)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] (got {alpha})")
    loss = student_logits.new_zeros(())
    if alpha > 0:
        log_p = F.log_softmax(student_logits.float() / temperature, dim=-1)
        soft = -(target_values * log_p.gather(-1, target_indices)).sum(-1).mean()
        loss = loss + alpha * temperature ** 2 * soft
    if alpha < 1:
        if labels is None:
            raise ValueError("alpha < 1 mixes in the true labels: pass them")
        labelled = labels >= 0  # rows without a label (NO_LABEL: a mixed transfer row) have none
        if bool(labelled.all()):
            loss = loss + (1 - alpha) * F.cross_entropy(student_logits.float(), labels)
        elif bool(labelled.any()):
            loss = loss + (1 - alpha) * F.cross_entropy(student_logits[labelled].float(), labels[labelled])
    return loss


NO_LABEL = -1  # the label of a transfer row the teacher alone labels (see :func:`mixup_rows`)


def mixup_rows(x: torch.Tensor, copies: int, seed: int) -> torch.Tensor:
    """``copies × len(x)`` transfer rows, each a random convex mix λ·x_i + (1 − λ)·x_j of two
    rows of ``x`` (λ uniform in [0, 1]; seeded, so every machine makes the same). The teacher
    labels them; the student matches it there too — function matching on mixed inputs (Beyer et
    al. 2022, arXiv 2106.05237), which tells the student more than rows the members have fit."""
    n = len(x)
    if copies < 1 or n == 0:
        return x[:0]
    gen = torch.Generator().manual_seed(seed)
    i = torch.randint(n, (copies * n,), generator=gen)
    j = torch.randint(n, (copies * n,), generator=gen)
    lam = torch.rand((copies * n,) + (1,) * (x.dim() - 1), generator=gen)
    return lam * x[i].float() + (1 - lam) * x[j].float()


def check_soupable(states: Sequence[StateDict]) -> None:
    """Raise :class:`SoupRefused`, naming the first difference, unless every member has the same
    tensors with the same shapes and dtypes (one architecture)."""
    if len(states) < 2:
        raise SoupRefused(f"a soup needs at least 2 members (got {len(states)})")
    first = states[0]
    for m, state in enumerate(states[1:], start=1):
        if state.keys() != first.keys():
            extra = sorted(set(state) ^ set(first))[:3]
            raise SoupRefused(f"members differ in architecture: member {m} and member 0 do not "
                              f"have the same tensors (e.g. {', '.join(extra)}); a soup averages "
                              f"members of one architecture only")
        for name, value in first.items():
            if state[name].shape != value.shape or state[name].dtype != value.dtype:
                raise SoupRefused(f"members differ in architecture: {name} is {tuple(value.shape)} "
                                  f"{value.dtype} in member 0 but {tuple(state[name].shape)} "
                                  f"{state[name].dtype} in member {m}")


def uniform_soup(states: Sequence[StateDict]) -> StateDict:
    """The mean of the members' floating-point tensors (summed in member order, in float32 or
    wider); other tensors (step counters, integer buffers) are member 0's."""
    check_soupable(states)
    out: StateDict = {}
    for name, value in states[0].items():
        if value.is_floating_point():
            acc = torch.zeros_like(value, dtype=torch.promote_types(value.dtype, torch.float32))
            for state in states:
                acc += state[name]
            out[name] = (acc / len(states)).to(value.dtype)
        else:
            out[name] = value.clone()
    return out


def greedy_soup(states: Sequence[StateDict], score: Callable[[StateDict], float]
                ) -> tuple[StateDict, list[int]]:
    """Wortsman et al.'s greedy soup: members sorted by their own ``score`` (higher is better,
    e.g. validation accuracy), best first; each next member joins when the soup's score with it
    is at least the soup's without. Returns the soup and the members in it, in joining order."""
    check_soupable(states)
    ranked = sorted(range(len(states)), key=lambda m: -score(states[m]))
    chosen = [ranked[0]]
    soup, best = dict(states[ranked[0]]), score(states[ranked[0]])
    for m in ranked[1:]:
        candidate = uniform_soup([states[i] for i in (*chosen, m)])
        value = score(candidate)
        if value >= best:
            chosen.append(m)
            soup, best = candidate, value
    return soup, chosen
