"""The ``distill`` recipe: the student, an ensemble's recipe trained against the ensemble's vote.

``tensorturn distill RUN`` starts an ordinary fused run of this recipe. It is its *base* recipe
(the ensemble's, with the options the ensemble ran with) in everything — data, model, evaluation,
what the API serves — but two things:

* :meth:`Distilled.shard_data` returns each training row's label together with the teacher's
  target: the ensemble's soft vote at temperature T, kept as its ``top_k`` most likely classes
  (:func:`tensorturn.train.distill.teacher_targets`). A shard's targets are computed once, by the first
  machine that trains the shard — it loads the finished ensemble from the store, checked against
  its signed manifest — and stored beside the ensemble
  (``runs/<ensemble>/teacher/<tag>/shard-<k>-of-<S>.safetensors``); every later round, and every
  other machine, reads them from there. Targets never travel through the broker.
* :meth:`Distilled.loss` is Hinton's distillation loss on them (:func:`tensorturn.train.distill.distill_loss`).

So a distillation is sharded, averaged, checkpointed and requeued like any fused run, and its
result is a one-model file that any machine serves with the base recipe's code; the recipe
options (the ensemble's run id, T, α, top-k, the student's configuration) are its lineage.

The models' outputs must be logits: ``[rows, classes]`` for classification, ``[rows, positions,
vocabulary]`` for a language model — what the default loss assumes. Regression ensembles are
refused (their mean is already the teacher; nothing soft to match). The defaults and ranges of
T, α, top-k and the mixed rows are :mod:`tensorturn.merge.distill`'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tensorturn.errors import RecipeError
from tensorturn.merge.distill import ALPHA, DISTILLABLE, MIXUP, TEMPERATURE, TOP_K, check_settings
from tensorturn.recipes.base import Recipe

log = logging.getLogger(__name__)


class Distilled(Recipe):
    name = "distill"
    # resolve gives it the names its caller allowed (``allow``): the base is resolved with them
    builds_on_recipe = True

    def __init__(self, teacher: str = "", recipe: str = "", recipe_options: dict[str, Any] | None = None,
                 student: dict[str, Any] | None = None, temperature: float = TEMPERATURE,
                 alpha: float = ALPHA, top_k: int = TOP_K, mixup: int = MIXUP,
                 recipe_state: dict[str, Any] | None = None, allow: tuple[str, ...] = ()):
        from tensorturn.recipes import resolve
        from tensorturn.recipes.learned import restore

        if not isinstance(teacher, str) or not teacher or not isinstance(recipe, str) or not recipe:
            raise RecipeError("the distill recipe is what `tensorturn distill RUN` trains; it is "
                              "not named with --recipe (it needs a finished ensemble)")
        check_settings(temperature, alpha, top_k, mixup)
        if student is not None and not isinstance(student, dict):
            raise RecipeError(f"--student must be a JSON object of model settings (got {student!r})")
        self.teacher, self.temperature, self.alpha, self.top_k = teacher, float(temperature), float(alpha), top_k
        self.student, self.mixup = dict(student or {}), mixup
        self.base_ref, self.base_options = recipe, dict(recipe_options or {})
        # what the ensemble's recipe learned from its data (recipes/learned.py): the student's base too
        self.base = restore(resolve(recipe, self.base_options, allow), recipe_state)
        if self.base.task not in DISTILLABLE:
            raise RecipeError(f"recipe {recipe!r} is a {self.base.task} recipe: distillation needs "
                              f"a classification or language-model ensemble")
        # the base's training defaults are the student's
        self.task = self.base.task
        for attr in ("lr", "weight_decay", "batch_size", "eval_batch_size", "input_dtype", "classes"):
            setattr(self, attr, getattr(self.base, attr))
        self._targets: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"Distilled(teacher={self.teacher!r}, base={self.base_ref!r}, T={self.temperature:g}, "
                f"alpha={self.alpha:g}, top_k={self.top_k})")

    @property
    def tag(self) -> str:
        """What the stored targets depend on besides the shard: T, top-k and the mixed rows (the
        rows themselves: the seed)."""
        return f"T{self.temperature:.12g}-k{self.top_k}" + (f"-mix{self.mixup}" if self.mixup else "")

    # ---- the base recipe, unchanged ------------------------------------------------------------
    def standalone_options(self) -> dict[str, Any]:
        base = self.base.standalone_options()  # charlm's vocabulary: the student's too
        return {"recipe_options": {**self.base_options, **base}} if base else {}

    def raw_data(self):
        return self.base.raw_data()

    def model(self, config: dict[str, Any]) -> nn.Module:
        return self.base.model(config)

    def default_config(self) -> dict[str, Any]:
        return {**self.base.default_config(), **self.student}

    def input_shape(self) -> list[int]:
        return self.base.input_shape()

    def preprocess(self, raw: torch.Tensor) -> torch.Tensor:
        return self.base.preprocess(raw)

    def check_input(self, raw: Any) -> str | None:
        return self.base.check_input(raw)

    def predict_proba(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.base.predict_proba(model, x)

    def predict(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.base.predict(model, x)

    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
        return self.base.evaluate(model, x, y)

    def eval_batches(self, split: str) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.base.eval_batches(split)

    def prefetch(self, k: int, shards: int) -> None:
        self.base.prefetch(k, shards)

    def cached_shards(self, shards: int) -> list[int]:
        return self.base.cached_shards(shards)

    def train_rows(self) -> int:
        return self.base.train_rows()

    def sample_input(self) -> torch.Tensor:
        return self.base.sample_input()

    def sample_rows(self, split: str, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.sample_rows(split, rows)

    # ---- what distillation changes -------------------------------------------------------------
    def shard_data(self, k: int, shards: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Shard k's rows (and ``mixup`` mixed rows per row, without a label), each target = its
        label followed by the teacher's top-k probabilities and their class indices (one float
        tensor, so batches slice it like any target)."""
        from tensorturn.train.distill import NO_LABEL, mixup_rows
        from tensorturn.train.loop import derive_seed

        x, y, rows = self.base.shard_data(k, shards, seed)
        x, y = x[rows], y[rows]
        if self.mixup:
            mixed = mixup_rows(x, self.mixup, derive_seed(seed, "mixup", k)).to(x.dtype)
            x = torch.cat([x, mixed])
            y = torch.cat([y, torch.full((len(mixed),) + tuple(y.shape[1:]), NO_LABEL, dtype=y.dtype)])
        values, indices = self.targets(k, shards, seed, x)
        packed = torch.cat([y.unsqueeze(-1).float(), values.float(), indices.float()], dim=-1)
        return x, packed, torch.arange(len(y))

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        from tensorturn.train.distill import distill_loss

        k = (y.shape[-1] - 1) // 2
        labels, values, indices = y[..., 0].long(), y[..., 1:1 + k], y[..., 1 + k:].long()
        logits = model(x)
        classes = logits.shape[-1]
        return distill_loss(logits.reshape(-1, classes), values.reshape(-1, k),
                            indices.reshape(-1, k), labels.reshape(-1), self.temperature, self.alpha)

    def targets(self, k: int, shards: int, seed: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's (top-k probabilities fp16, class indices int32) for shard k's rows ``x``:
        from this process's memory, else the store, else computed here and stored."""
        with self._lock:
            if (k, shards, seed) not in self._targets:
                self._targets[(k, shards, seed)] = self._load_or_compute(k, shards, seed, x)
            return self._targets[(k, shards, seed)]

    def _load_or_compute(self, k: int, shards: int, seed: int, x: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        from tensorturn import config, layout
        from tensorturn.store import seals
        from tensorturn.store.objects import open_store
        from tensorturn.store.tensors import from_bytes, to_bytes

        store = open_store(config.current().resolved_store_url())
        # CPU results depend on the thread count (the task set it: the run's --threads-per-task)
        key = layout.key("teacher", self.teacher, f"{self.tag}-s{seed}-t{torch.get_num_threads()}",
                         k, shards)
        if not store.exists(key):
            values, indices = self.compute_targets(store, x)
            # Not a conditional put: two machines computing one shard at once both write (the
            # later stays) and each trains on its own — the same bytes on CPUs with the same
            # threads; a GPU's may differ in the last bits (see docs/ensemble.md).
            if not store.exists(key):
                seals.put_bytes(store, key, to_bytes({"values": values, "indices": indices},
                                                     {"teacher": self.teacher, "tag": self.tag,
                                                      "rows": str(len(x))}))
                return values, indices
        stored = from_bytes(seals.get_bytes(store, key))
        if len(stored["values"]) != len(x):
            raise RecipeError(f"the stored teacher targets {key} hold {len(stored['values'])} rows, "
                              f"shard {k} has {len(x)}: the ensemble's data changed")
        return stored["values"], stored["indices"]

    @torch.no_grad()
    def compute_targets(self, store: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The ensemble's soft vote on ``x`` (preprocessed rows), a forward pass per piece of
        ``eval_batch_size`` rows and member."""
        from tensorturn.predictor import load_result
        from tensorturn.train.device import pick_device
        from tensorturn.train.distill import teacher_targets

        predictor, _ = load_result(store, self.teacher)
        device = pick_device()
        models = [m.to(device).eval() for m in predictor.models]
        values, indices = [], []
        for lo in range(0, len(x), self.eval_batch_size):
            piece = x[lo:lo + self.eval_batch_size].to(device)
            logits = torch.stack([m(piece).float() for m in models])
            v, i = teacher_targets(logits, self.temperature, self.top_k)
            values.append(v.half().cpu())
            indices.append(i.int().cpu())
        log.info("teacher targets of %d rows from %d members of run %s", len(x), len(models), self.teacher)
        return torch.cat(values), torch.cat(indices)

    def check_student(self, member_configs: list[dict[str, Any]]) -> None:
        """RecipeError in one line unless the student builds and answers a row of the data the
        way the ensemble's members do (the same output shape: the same classes or vocabulary)."""
        sample = self.base.sample_input()
        config = self.default_config()
        try:
            with torch.no_grad():
                out = self.base.model(config).eval()(sample)
        except Exception as exc:  # noqa: BLE001 - any failure of the user's config, in one line
            raise RecipeError(f"the student config {json_text(self.student)} does not fit recipe "
                              f"{self.base_ref!r}'s data: {type(exc).__name__}: {exc}") from None
        with torch.no_grad():
            want = self.base.model(member_configs[0]).eval()(sample) if member_configs else out
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(want.shape):
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise RecipeError(f"the student config {json_text(self.student)} does not fit the data: "
                              f"its output for one row is {got}, the ensemble's members give "
                              f"{tuple(want.shape)}")


def json_text(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True)
