"""The recipe protocol: subclass :class:`Recipe`, fill in ``data`` and ``model``.

A recipe is a plain class. TensorTurn calls it on every machine, so it must be deterministic: the
same splits and the same initial model for the same seed, wherever it runs. Inputs are the
recipe's *raw* inputs (what a user would send to the served model); ``preprocess`` turns them
into the model's input and is applied to training data and to served requests alike.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tensorturn.errors import CODE_ERRORS, RecipeFault
from tensorturn.recipes.kinds import Kind, kind_of


@dataclass
class Splits:
    """Preprocessed tensors of the fixed train/validation/test split."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


class Recipe:
    """Base class of recipes. ``task`` names the kind of task (:mod:`.kinds`): it decides the
    default loss, evaluation, how an ensemble combines members and what the API serves.

    Class attributes give the training defaults a run uses unless the user overrides them.

    Which hooks each kind calls (every kind: ``raw_data``, ``preprocess``, ``model``, ``loss``,
    ``predict``, ``combine``, ``evaluate``, ``check_input``):

    * ``classification``, ``language_model``: the default ``predict`` calls ``predict_proba``
      (class probabilities); ``classes`` names the classes served as ``class_name``.
      ``unscale_targets`` is never called.
    * ``regression``: ``predict`` returns the values (the default: the model's output);
      ``predict_proba`` is never called — override ``predict``. Served predictions, every
      member's and every metric pass through ``unscale_targets`` (the user's units).

    An override the recipe's kind never calls is refused, at submit and by ``check-recipe``.

    One rule measures both modes: a fused run's model and an ensemble are both measured by
    ``evaluate`` — an ensemble as one model whose forward pass returns its vote (the log of the
    combined probabilities, or the combined values: :class:`~tensorturn.recipes.vote.EnsembleModel`),
    so a recipe's own ``evaluate`` gives the same figures, of the same meaning, in both modes. (Under ``--vote
    hard`` the ensemble's ``loss`` is that of its mean probability: vote shares are no
    probabilities.) A recipe that overrides ``evaluate`` reports metrics in the user's units
    itself: pass predictions and targets through ``unscale_targets``.
    """

    name = "recipe"
    task = "classification"  # or "regression", "language_model" (see recipes/kinds.py)
    ref = ""            # how the run named it (set by ``resolve``), e.g. "digits-mlp"
    lr = 1e-3           # inner AdamW learning rate
    weight_decay = 0.0
    batch_size = 32
    eval_batch_size = 512  # rows per forward pass when evaluating (a split never goes in at once)
    input_dtype = "FP32"  # Open Inference Protocol datatype of a raw input
    classes: list[str] | None = None  # names of the classes, by class number (served: class_name)

    def raw_data(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw (x_train, y_train, x_val, y_val, x_test, y_test): a fixed split, same everywhere."""
        raise NotImplementedError

    def model(self, config: dict[str, Any]) -> nn.Module:
        """A fresh model for ``config`` (see :meth:`default_config`)."""
        raise NotImplementedError

    def default_config(self) -> dict[str, Any]:
        """The model configuration used unless a run (or an ensemble member) varies it."""
        return {}

    def config_space(self) -> dict[str, list[Any]]:
        """Choices an ensemble draws each member's variation from (``lr_scale`` scales ``lr``).

        Empty by default: members then differ by seed (and bootstrap sample) only.
        """
        return {}

    def member_config(self, member: int, rng: random.Random) -> dict[str, Any]:
        """Ensemble member ``member``'s variation: one independent draw per key of the space."""
        return {key: rng.choice(choices) for key, choices in sorted(self.config_space().items())}

    def input_shape(self) -> list[int]:
        """Shape of one raw input row (without the batch dimension): learned with the splits and
        kept with the run, so a machine without the data (``serve``, an export) knows it too."""
        known = vars(self).get(INPUT_SHAPE)
        return list(known) if known is not None else list(load_splits(self).x_test.shape[1:])

    def preprocess(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw inputs → model inputs. Applied to training data and to served requests."""
        return raw.float()

    def pinned_options(self) -> dict[str, Any]:
        """Options to write into the run's spec once the recipe is built, so every machine (and
        the served model) builds the very same recipe: a pushed dataset's version, say."""
        return {}

    def standalone_options(self) -> dict[str, Any]:
        """Options that, given besides the run's, build this very recipe's model (and its
        :meth:`check_input`) with none of its data at hand: what an exported folder is loaded
        with on another machine (``charlm``: its vocabulary, otherwise read from its text).
        Empty by default: a model that depends on the options alone needs nothing more."""
        return {}

    def check_input(self, raw: Any) -> str | None:
        """What is wrong with served raw inputs (a numpy array), or None; the API answers 400."""
        return None

    @property
    def kind(self) -> Kind:
        return kind_of(self.task)

    def unscale_targets(self, values: torch.Tensor) -> torch.Tensor:
        """Regression: values in the units the model learns (the targets ``raw_data`` returns)
        back in the user's units. Served predictions and reported metrics pass through it; the
        loss is computed in the model's units. Override it when ``raw_data`` scaled the targets,
        e.g. standardised with mean ``mu`` and std ``sigma``: ``return values * sigma + mu``
        (``mu`` and ``sigma`` fixed when the recipe is built, the same on every machine).
        The identity by default."""
        return values

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy for classification; mean squared error for regression."""
        out = model(x)
        if self.task == "regression":
            return F.mse_loss(out.reshape(y.shape) if out.numel() == y.numel() else out, y.float())
        return F.cross_entropy(out, y)

    @torch.no_grad()
    def predict_proba(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Class probabilities (classification and language models)."""
        model.eval()
        return torch.softmax(model(x), dim=-1)

    @torch.no_grad()
    def predict(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """One model's per-row outputs on preprocessed inputs, as the kind combines them:
        probabilities (:meth:`predict_proba`) for classification, values for regression."""
        model.eval()
        if self.task in ("classification", "language_model"):
            return self.predict_proba(model, x)
        return self.kind.outputs(model, x)

    def combine(self, per_member: torch.Tensor, vote: str) -> torch.Tensor:
        """An ensemble's output from its members' (``[members, rows, ...]``), by ``vote``."""
        return self.kind.combine(per_member, vote)

    # -- what a fused shard trains on, what evaluation reads: in memory unless a recipe streams --
    def shard_data(self, k: int, shards: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x, y, rows): the preprocessed data shard ``k`` of ``shards`` trains on. Here the whole
        train split, with the shard's rows a seeded deal of it; a recipe over a pushed dataset
        returns just the shard's rows (read from their chunks)."""
        from tensorturn.train.seeding import shard_rows

        splits = load_splits(self)
        return splits.x_train, splits.y_train, shard_rows(len(splits.y_train), shards, k, seed)

    def prefetch(self, k: int, shards: int) -> None:
        """Bring shard ``k``'s data onto this machine ahead of its task (called in a thread
        while another shard trains). Nothing to do for data held in memory."""

    def cached_shards(self, shards: int) -> list[int]:
        """The shards of ``shards`` whose data this machine already holds (a fused round's
        first claims prefer them). None for data held in memory: every machine reads it all."""
        return []

    def eval_batches(self, split: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Preprocessed (x, y) batches of ``split`` ("val" or "test"); here the split at once."""
        splits = load_splits(self)
        yield getattr(splits, f"x_{split}"), getattr(splits, f"y_{split}")

    def eval_pieces(self, split: str, max_batches: int | None = None
                    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`eval_batches` cut into forward passes of at most :attr:`eval_batch_size` rows;
        the first ``max_batches`` of them when that is given (``--eval-batches``; 0 or None:
        every one)."""
        served = 0
        for x, y in self.eval_batches(split):
            for lo in range(0, len(y), self.eval_batch_size):
                if max_batches and served >= max_batches:
                    return
                served += 1
                yield x[lo:lo + self.eval_batch_size], y[lo:lo + self.eval_batch_size]

    def evaluate_split(self, model: nn.Module, split: str, device: torch.device | None = None,
                       max_batches: int | None = None) -> dict[str, float]:
        """:meth:`evaluate` over :meth:`eval_pieces` on ``device`` (the model's, by default),
        each metric weighted by its piece's rows."""
        return self.evaluate_counted(model, split, device, max_batches)[0]

    def evaluate_counted(self, model: nn.Module, split: str, device: torch.device | None = None,
                         max_batches: int | None = None) -> tuple[dict[str, float], int]:
        """:meth:`evaluate_split`, and how many rows it read (what a figure says it used)."""
        if device is not None:
            model.to(device)
        else:
            device = next(model.parameters(), torch.empty(0)).device
        sums: dict[str, float] = {}
        rows = 0
        for x, y in self.eval_pieces(split, max_batches):
            if len(y) == 0:
                continue
            with code_of_the_recipe("evaluate"):
                figures = self.evaluate(model, x.to(device), y.to(device))
            for name, value in figures.items():
                sums[name] = sums.get(name, 0.0) + value * len(y)
            rows += len(y)
        return ({name: total / rows for name, total in sums.items()} if rows else {}), rows

    def train_rows(self) -> int:
        """How many rows the train split has."""
        return len(load_splits(self).y_train)

    def sample_input(self) -> torch.Tensor:
        """One preprocessed training row (for the memory estimate)."""
        return load_splits(self).x_train[:1]

    def sample_rows(self, split: str, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``rows`` preprocessed (x, y) of ``split`` ("train", "val" or "test"): what
        the checks at submit read, without reading all the data where a recipe streams it."""
        splits = load_splits(self)
        return getattr(splits, f"x_{split}")[:rows], getattr(splits, f"y_{split}")[:rows]

    @torch.no_grad()
    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        """The kind's metrics on preprocessed inputs: accuracy and mean NLL (nats) for
        classification, MSE (``loss``) and MAE for regression, in the user's units."""
        predicted = self.predict(model, x)
        if self.kind.scaled:
            predicted, y = self.unscale_targets(predicted), self.unscale_targets(y)
        return self.kind.metrics(predicted, y)


@contextlib.contextmanager
def code_of_the_recipe(hook: str) -> Iterator[None]:
    """Where a run calls the recipe's ``hook``: an error of its code (:data:`CODE_ERRORS`) comes
    out as :class:`RecipeFault` — the same code fails the same way on every machine, so the run
    fails there, at once, rather than retrying it behind later work."""
    try:
        yield
    except CODE_ERRORS as exc:
        raise RecipeFault(f"the recipe's {hook} raised {type(exc).__name__}: "
                          f"{' '.join(str(exc).split())}") from exc


_SPLITS: dict[tuple[str, str], tuple[Splits, dict[str, Any]]] = {}
# the shape of a row of the splits, learned beside what raw_data sets (Recipe.input_shape reads it)
INPUT_SHAPE = "_tensorturn_input_shape"
# by recipe class: the names of the attributes its raw_data (or preprocess) set — its learned state
_LEARNED: dict[str, set[str]] = {}


def _splits_key(recipe: Recipe) -> tuple[str, str]:
    """The recipe's splits are those of its class and attributes — its learned state aside, so
    an instance given the run's state (:mod:`.learned`) finds the splits loaded by one that
    learned it."""
    qual = type(recipe).__qualname__
    skip = _LEARNED.get(qual, set())
    return qual, repr(sorted((k, v) for k, v in vars(recipe).items() if k not in skip))


def load_splits(recipe: Recipe) -> Splits:
    """The recipe's preprocessed splits, loaded once per process. What ``raw_data`` and
    ``preprocess`` set on the recipe as they ran is its learned state: kept with the splits and
    given to every instance that finds them here (:func:`learned_of` reads it)."""
    found = _SPLITS.get(_splits_key(recipe))
    if found is None:
        before = dict(vars(recipe))
        xtr, ytr, xva, yva, xte, yte = recipe.raw_data()
        p = recipe.preprocess
        splits = Splits(p(xtr), ytr, p(xva), yva, p(xte), yte)
        learned = {k: v for k, v in vars(recipe).items() if k not in before or v is not before[k]}
        learned[INPUT_SHAPE] = list(splits.x_test.shape[1:])
        _LEARNED.setdefault(type(recipe).__qualname__, set()).update(learned)
        found = _SPLITS[_splits_key(recipe)] = (splits, learned)
    splits, learned = found
    for name, value in learned.items():
        if name not in vars(recipe):  # (an instance given the run's state keeps it)
            setattr(recipe, name, value)
    return splits


def learned_of(recipe: Recipe) -> dict[str, Any] | None:
    """The attributes ``raw_data`` and ``preprocess`` set when this recipe's splits were loaded
    in this process, or None when they were not (a recipe that streams its data)."""
    found = _SPLITS.get(_splits_key(recipe))
    return None if found is None else dict(found[1])
