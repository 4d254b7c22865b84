"""The bar an ensemble member's weights must clear: briefly trained members are kept, diverged ones dropped."""


import pytest
import torch

from tensorturn.modes.ensemble.tasks import judge, member_plan, untrained_model
from tensorturn.recipes import load_splits, resolve
from tensorturn.spec import RunSpec
from tensorturn.train.loop import derive_seed, train_steps


def _trained(lr: float | None, steps: int, seed: int) -> list[str | None]:
    """Each member's verdict (None: it votes) after ``steps`` steps, trained as a segment does."""
    spec = RunSpec.create(mode="ensemble", recipe="digits-mlp", store_url="file:///unused",
                          members=4, segments=1, segment_steps=steps, seed=seed, lr=lr)
    recipe, cpu = resolve("digits-mlp"), torch.device("cpu")
    splits = load_splits(recipe)
    verdicts = []
    for plan in member_plan(spec, recipe):
        model = untrained_model(recipe, plan, cpu)
        opt = torch.optim.AdamW(model.parameters(), lr=plan["lr"], weight_decay=recipe.weight_decay)
        n = len(splits.y_train)
        rows = torch.randint(n, (n,), generator=torch.Generator().manual_seed(plan["seed"]))
        train_steps(recipe, model, opt, splits.x_train, splits.y_train, rows, steps,
                    recipe.batch_size, derive_seed(plan["seed"], 0), cpu)
        verdicts.append(judge(recipe, model.state_dict(), plan, cpu, None)[1])
    return verdicts


@pytest.mark.parametrize("seed", [0, 1])
def test_the_bar_keeps_briefly_trained_members_and_drops_diverged_ones(seed):
    """5 steps, the briefest ensemble training in this suite, at the recipe's learning rate (its
    draws span 0.5–2×): every member votes. At --lr 9.9 none does."""
    assert _trained(None, 5, seed) == [None] * 4
    assert all(v and v.startswith("diverged: its val loss") for v in _trained(9.9, 60, seed))
