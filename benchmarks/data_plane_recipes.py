"""The `tabular` recipe on the path every recipe used before the data plane: the whole table in
memory on every machine (the base class's shard_data / eval_batches), for benchmarks/data_plane.py."""

from tensorturn.recipes.base import Recipe
from tensorturn.recipes.tabular import Tabular


class InMemoryTabular(Tabular):
    shard_data = Recipe.shard_data
    eval_batches = Recipe.eval_batches
    train_rows = Recipe.train_rows
    sample_input = Recipe.sample_input
