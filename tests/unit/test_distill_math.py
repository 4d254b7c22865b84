"""The math for turning an ensemble into one model (tensorturn.train.distill): the teacher's top-k
targets, Hinton's distillation loss, and uniform and greedy weight soups."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tensorturn.train.distill import (
    NO_LABEL,
    SoupRefused,
    check_soupable,
    distill_loss,
    greedy_soup,
    mixup_rows,
    teacher_targets,
    uniform_soup,
)


def test_the_teacher_is_the_members_mean_softmax_at_temperature_kept_as_renormalised_top_k():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 10, generator=gen)
    values, indices = teacher_targets(logits, temperature=2.0)
    full = torch.softmax(logits / 2.0, -1).mean(0)
    assert torch.allclose(torch.zeros_like(full).scatter(-1, indices, values), full, atol=1e-6)
    top, idx = teacher_targets(logits, temperature=2.0, top_k=3)
    assert top.shape == idx.shape == (5, 3)
    assert torch.allclose(top.sum(-1), torch.ones(5))
    assert torch.equal(idx, full.topk(3, -1).indices)
    assert torch.allclose(top, full.topk(3, -1).values / full.topk(3, -1).values.sum(-1, keepdim=True))
    with pytest.raises(ValueError, match="temperature must be positive"):
        teacher_targets(logits, temperature=0.0)


def test_the_soft_term_has_the_kl_divergences_gradient_scaled_by_t_squared():
    """With every class kept, T² · CE(teacher ‖ student_T) differs from T² · KL by the teacher's
    entropy only: the same gradient with respect to the student's logits."""
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(3, 6, 7, generator=gen)
    t = 3.0
    values, indices = teacher_targets(teacher, t)
    z = torch.randn(6, 7, generator=gen, requires_grad=True)
    (g_ours,) = torch.autograd.grad(distill_loss(z, values, indices, None, t, alpha=1.0), z)
    p_teacher = torch.zeros(6, 7).scatter(-1, indices, values)
    kl = F.kl_div(F.log_softmax(z / t, -1), p_teacher, reduction="batchmean") * t * t
    (g_kl,) = torch.autograd.grad(kl, z)
    assert torch.allclose(g_ours, g_kl, atol=1e-6)


def test_alpha_mixes_the_soft_and_the_hard_terms():
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(8, 4, generator=gen)
    labels = torch.randint(4, (8,), generator=gen)
    values, indices = teacher_targets(torch.randn(2, 8, 4, generator=gen), 2.0)
    hard = F.cross_entropy(z, labels)
    soft = distill_loss(z, values, indices, None, 2.0, alpha=1.0)
    assert torch.allclose(distill_loss(z, values, indices, labels, 2.0, alpha=0.0), hard)
    assert torch.allclose(distill_loss(z, values, indices, labels, 2.0, alpha=0.3), 0.3 * soft + 0.7 * hard)
    with pytest.raises(ValueError, match="pass them"):
        distill_loss(z, values, indices, None, 2.0, alpha=0.5)
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        distill_loss(z, values, indices, labels, 2.0, alpha=1.5)


def member(seed: int, width: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(width, 3, generator=gen), "b": torch.randn(3, generator=gen),
            "steps": torch.tensor(7)}


def test_a_uniform_soup_averages_floating_point_tensors_and_keeps_the_rest():
    a, b, c = member(0), member(1), member(2)
    soup = uniform_soup([a, b, c])
    assert torch.allclose(soup["w"], (a["w"] + b["w"] + c["w"]) / 3)
    assert torch.allclose(soup["b"], (a["b"] + b["b"] + c["b"]) / 3)
    assert torch.equal(soup["steps"], torch.tensor(7))
    assert torch.equal(uniform_soup([a, a])["w"], a["w"])


def test_members_of_different_architectures_are_refused_in_one_line():
    with pytest.raises(SoupRefused, match=r"^members differ in architecture: w is \(4, 3\) "
                                          r"torch.float32 in member 0 but \(5, 3\) torch.float32 in member 1$"):
        check_soupable([member(0), member(1, width=5)])
    other = {**member(1), "extra": torch.zeros(1)}
    with pytest.raises(SoupRefused, match="do not have the same tensors"):
        uniform_soup([member(0), other])
    with pytest.raises(SoupRefused, match="at least 2 members"):
        uniform_soup([member(0)])


def test_the_greedy_soup_adds_members_best_first_while_the_soup_does_not_get_worse():
    """Scored by closeness to a target: the best member starts the soup, a member that pulls the
    average towards the target joins, one that pulls it away does not."""
    target = torch.zeros(4, 3)
    good = {"w": torch.full((4, 3), 1.0), "b": torch.zeros(3), "steps": torch.tensor(7)}
    opposite = {"w": torch.full((4, 3), -0.8), "b": torch.zeros(3), "steps": torch.tensor(7)}
    bad = {"w": torch.full((4, 3), 5.0), "b": torch.zeros(3), "steps": torch.tensor(7)}

    def score(state: dict[str, torch.Tensor]) -> float:
        return -float((state["w"] - target).abs().mean())

    soup, chosen = greedy_soup([good, bad, opposite], score)
    assert chosen == [2, 0]          # opposite (0.8 away) first, then good: their mean is 0.1 away
    assert torch.allclose(soup["w"], torch.full((4, 3), 0.1))


def test_rows_without_a_label_count_in_the_soft_term_only():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 4, generator=gen)
    values, indices = teacher_targets(torch.randn(3, 6, 4, generator=gen), 2.0)
    labels = torch.tensor([0, 1, NO_LABEL, NO_LABEL, 3, NO_LABEL])
    kept = labels >= 0
    soft = distill_loss(logits, values, indices, None, 2.0, 1.0)
    got = distill_loss(logits, values, indices, labels, 2.0, 0.5)
    assert torch.allclose(got, 0.5 * soft + 0.5 * F.cross_entropy(logits[kept], labels[kept]))
    unlabelled = torch.full((6,), NO_LABEL)
    assert torch.allclose(distill_loss(logits, values, indices, unlabelled, 2.0, 0.5), 0.5 * soft)


def test_mixed_transfer_rows_are_seeded_convex_mixes_of_the_rows():
    x = torch.arange(12.0).reshape(4, 3)
    mixed = mixup_rows(x, 3, seed=7)
    assert mixed.shape == (12, 3)
    assert torch.equal(mixed, mixup_rows(x, 3, seed=7))  # every machine makes the same
    assert not torch.equal(mixed, mixup_rows(x, 3, seed=8))
    # each mix of two rows of an arithmetic table stays on its line, between its smallest and largest
    assert torch.allclose(mixed[:, 1] - mixed[:, 0], torch.ones(12))
    assert bool((mixed >= 0).all()) and bool((mixed <= 11).all())
    assert mixup_rows(x, 0, seed=7).shape == (0, 3)
