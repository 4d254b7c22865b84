"""Loading a run's result — one fused model or a voting ensemble — for evaluation and serving."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from tensorturn import layout
from tensorturn.errors import RecipeError, TensorTurnError
from tensorturn.recipes import BUILTIN, Recipe, resolve
from tensorturn.recipes.answer import Prediction
from tensorturn.recipes.learned import restore
from tensorturn.recipes.vote import EnsembleModel
from tensorturn.spec import RunState
from tensorturn.store.objects import ObjectMissing, Store, sha256_hex
from tensorturn.store.tensors import ENSEMBLE_FORMAT, MODEL_FORMAT, from_bytes, header_of, metadata_of
from tensorturn.trust import UntrustedError, check_recipe_allowed


@dataclass
class Predictor:
    """A recipe plus one or more models and a vote rule ("single", "soft" or "hard")."""

    recipe: Recipe
    models: list[nn.Module]
    vote: str
    members: list[dict]

    @classmethod
    def from_bytes(cls, data: bytes, allow: Collection[str] = (),
                   options: Mapping[str, Any] | None = None, what: str = "the model file") -> "Predictor":
        """The model file's predictor; ``allow``: recipe names allowed for this call besides the
        machine's allowlist (:func:`tensorturn.recipes.resolve`); ``options``: recipe options
        given besides the file's (an exported folder's :meth:`Recipe.standalone_options`);
        ``what``: the file, as an error names it.

        Bytes that are not a whole TensorTurn model file (a truncated or garbage file, metadata
        missing or of the wrong type) are one TensorTurnError naming ``what``. The model is built
        only once its own config, built on the meta device, has the very tensors and shapes the
        file holds (:func:`check_shapes`): a crafted config cannot make this process allocate
        what the file does not hold."""
        file = ModelFile.parse(data, what)
        recipe = resolve(file.recipe, {**file.options, **(options or {})}, allow)
        try:
            restore(recipe, file.state)
        except (LookupError, TypeError, ValueError, AttributeError, RuntimeError) as exc:
            raise TensorTurnError(f"{what}: its metadata 'recipe_state' is not what a recipe learned "
                                  f"({type(exc).__name__}: {_line(exc)})") from None
        for prefix, config in file.parts:
            check_shapes(recipe, config, file.shapes, prefix, what)
        try:
            tensors = from_bytes(data)
        except Exception as exc:  # noqa: BLE001 - safetensors' own check of the bytes (SafetensorError)
            raise TensorTurnError(f"{what} is not a readable safetensors file: {_line(exc)}") from None
        models = []
        for prefix, config in file.parts:
            model = recipe.model(config)
            model.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
            models.append(model.eval())
        return cls(recipe, models, file.vote, file.members)

    @torch.no_grad()
    def member_outputs(self, x: torch.Tensor) -> torch.Tensor:
        """``[members, rows, ...]`` outputs (probabilities, or values for regression) for
        preprocessed inputs ``x``."""
        return torch.stack([self.recipe.predict(m, x) for m in self.models])

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(combined output, member outputs) for preprocessed inputs ``x``, as served: the
        recipe's kind combines the members (classification: mean probability, or hard-vote
        shares; regression: the mean, in the user's units — ``Recipe.unscale_targets``); one
        model's output is itself."""
        per_member = self.member_outputs(x)
        combined = self.recipe.combine(per_member, self.vote)
        if self.recipe.kind.scaled:
            unscale = self.recipe.unscale_targets
            return unscale(combined), torch.stack([unscale(p) for p in per_member])
        return combined, per_member

    def serve_rows(self, x: np.ndarray) -> Prediction:
        """The outputs for raw rows ``x`` (the recipe preprocesses them), as served: what
        ``tensorturn serve`` answers and an exported model's ``predict`` returns, one code path."""
        with torch.inference_mode():
            combined, per_member = self.predict(self.recipe.preprocess(torch.from_numpy(x)))
            return Prediction(combined.float().numpy(), per_member.float().numpy())

    def as_model(self, vote: str | None = None) -> nn.Module:
        """The result as one model for ``Recipe.evaluate``: the fused model, or the ensemble
        (:class:`~tensorturn.recipes.vote.EnsembleModel`) voting by ``vote`` (default: its own rule)."""
        if self.vote == "single":
            return self.models[0]
        return EnsembleModel(self.recipe, self.models, vote or self.vote)


@dataclass
class ModelFile:
    """What a model file's header says of it (:meth:`parse`): its recipe, the recipe's options and
    learned state, each model's (key prefix, config) — one, or one per ensemble member — the vote
    rule, and every tensor's shape. No tensor is read."""

    recipe: str
    options: dict[str, Any]
    state: dict[str, Any]
    parts: list[tuple[str, dict[str, Any]]]
    vote: str
    members: list[dict]
    shapes: dict[str, list[int]]

    @classmethod
    def parse(cls, data: bytes, what: str) -> "ModelFile":
        """The header of ``data``, checked; TensorTurnError naming ``what`` (and what is wrong)."""
        try:
            meta, shapes = header_of(data)
        except ValueError as exc:
            raise TensorTurnError(f"{what} is not a safetensors file: {exc}") from None
        fmt = meta.get("format")
        if fmt not in (MODEL_FORMAT, ENSEMBLE_FORMAT):
            raise TensorTurnError(f"{what} is not a TensorTurn model file (format {fmt!r})")

        def field(name: str, kind: type, default: str | None = None) -> Any:
            text = meta.get(name, default)
            if text is None:
                raise TensorTurnError(f"{what}: its metadata has no {name!r}: not a whole TensorTurn model file")
            try:
                value = json.loads(text) if kind is not str else text
            except ValueError:
                value = None
            if not isinstance(value, kind):
                raise TensorTurnError(f"{what}: its metadata {name!r} is not a JSON {kind.__name__}")
            return value

        recipe = field("recipe", str)
        options, state = field("recipe_options", dict, "{}"), field("recipe_state", dict, "{}")
        if fmt == MODEL_FORMAT:
            return cls(recipe, options, state, [("", field("config", dict))], "single", [], shapes)
        members = field("members", list)
        if not members or not all(isinstance(e, dict) and isinstance(e.get("member"), int)
                                  and isinstance(e.get("config"), dict) for e in members):
            raise TensorTurnError(f"{what}: its metadata 'members' is not a list of members "
                                  f"(each a number and a model config)")
        parts = [(f"m{e['member']}.", e["config"]) for e in members]
        return cls(recipe, options, state, parts, field("vote", str), members, shapes)


class ShapeMismatch(RecipeError):
    """A model file's tensors are not those of the model its recipe and config build."""


def check_shapes(recipe: Recipe, config: dict[str, Any], shapes: Mapping[str, list[int]], prefix: str,
                 what: str) -> None:
    """ShapeMismatch, naming the first tensor and both shapes, unless the model ``recipe`` builds
    from ``config`` — on the meta device, where nothing is allocated — holds exactly the tensors
    of ``shapes`` under ``prefix``, of those shapes. A model that cannot be built from ``config``
    is one RecipeError."""
    try:
        with torch.device("meta"):
            expected = {k: list(v.shape) for k, v in recipe.model(config).state_dict().items()}
    except (TensorTurnError, OSError):  # (a file its model reads that is not here: the caller says where)
        raise
    except Exception as exc:  # noqa: BLE001 - the file's config does not build a model: one line
        raise RecipeError(f"recipe {getattr(recipe, 'ref', '?')!r} cannot build the model {what} "
                          f"describes: {type(exc).__name__}: {_line(exc)}") from None
    held = {k[len(prefix):]: v for k, v in shapes.items() if k.startswith(prefix)}
    for name in sorted(expected.keys() | held.keys()):
        if expected.get(name) != held.get(name):
            said = {k: "absent" if v is None else str(v) for k, v in (("file", held.get(name)),
                                                                      ("model", expected.get(name)))}
            raise ShapeMismatch(f"{what}: tensor {prefix + name!r} is {said['file']} in the file, "
                                f"{said['model']} in the model its config builds; refused before "
                                f"building it")


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def load_result(store: Store, run_id: str, allow: Collection[str] = ()) -> tuple[Predictor, dict[str, Any]]:
    """The run's final artifact, trusted only as far as it proves itself: the manifest must be
    signed by the pool key, its recipe allowed on this machine or named in ``allow`` (checked
    before the model file is read), and the file must match the manifest's sha256 and name the
    same recipe."""
    from tensorturn.data.source import pinned

    data, manifest = result_bytes(store, run_id, allow)
    with pinned(dataset_pins(manifest)):  # a recipe over a pushed dataset reads the run's index
        return Predictor.from_bytes(data, allow, what=f"run {run_id}'s model file"), manifest


def dataset_pins(manifest: dict[str, Any]) -> dict[str, str] | None:
    """The dataset indexes the run pinned when it started (key → sha256; the signed spec's
    ``datasets``), or None for a run started before runs pinned them."""
    pins = (manifest.get("spec") or {}).get("datasets")
    return pins if isinstance(pins, dict) else None


def result_bytes(store: Store, run_id: str, allow: Collection[str] = ()) -> tuple[bytes, dict[str, Any]]:
    """The run's final model file, checked as :func:`load_result` checks it, and its manifest."""
    from tensorturn.state.manifest import read_manifest

    try:
        manifest = read_manifest(store, run_id, verify=True)
    except ObjectMissing:
        raise TensorTurnError(f"no run {run_id!r} in the store (see `tensorturn runs`)") from None
    if manifest.get("state") != RunState.SUCCEEDED or not manifest.get("model_uri"):
        raise TensorTurnError(f"run {run_id} has no model to serve (state {manifest.get('state')})")
    if manifest["recipe"] not in allow:  # the caller's own, as `resolve` takes them
        check_recipe_allowed(manifest["recipe"], BUILTIN)
    final = "final_ensemble" if manifest["mode"] == "ensemble" else "final_model"
    data = store.get_bytes(layout.key(final, run_id))
    if sha256_hex(data) != manifest["model_sha256"]:
        raise UntrustedError(f"run {run_id}: the model file does not match its recorded sha256")
    named = metadata_of(data).get("recipe")
    if named != manifest["recipe"]:
        raise UntrustedError(f"run {run_id}: the model file names recipe {named!r}, its manifest "
                             f"{manifest['recipe']!r}; refused")
    return data, manifest
