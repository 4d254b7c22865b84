"""An exported folder loaded back: the torch module(s) and the served predictions, no pool.

Nothing here talks to a broker, a pool or an object store: the weights come from the folder's
``tensorturn.safetensors`` (safetensors only, never ``torch.load``), the recipe is built from the name
and options in the file (a user's recipe must be importable here and allowed, as for ``serve``),
and a recipe over a pushed dataset reads that dataset's index from the folder's ``dataset/``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from tensorturn.errors import RecipeError, SpecError, TensorTurnError
from tensorturn.predictor import Predictor, ShapeMismatch
from tensorturn.recipes import Recipe
from tensorturn.recipes.answer import served_outputs
from tensorturn.store.objects import sha256_hex
from tensorturn.store.tensors import header_of
from tensorturn.trust import UntrustedError

# TensorTurn's own two files carry its name, so that the folder's root is free for the layout
# other tools read there (transformers: config.json, model.safetensors, tokenizer.json)
EXPORT_FORMAT = "tensorturn-export/2"
CONFIG_FILE = "tensorturn.json"
MODEL_FILE = "tensorturn.safetensors"
CARD_FILE = "README.md"
DATASET_DIR = "dataset"      # a file store holding the pushed dataset's index only
ONNX_FILE = "model.onnx"
# a folder exported before the layout above: its config.json and model.safetensors were TensorTurn's
OLD_FORMAT, OLD_CONFIG_FILE, OLD_MODEL_FILE = "tensorturn-export/1", "config.json", "model.safetensors"


@dataclass
class ExportedModel:
    """An exported run: ``module`` (the fused model, or the ensemble as one module that votes),
    ``models`` (each member), ``recipe``, ``config`` (``tensorturn.json``) and :meth:`predict`."""

    path: Path
    config: dict[str, Any]
    predictor: Predictor

    @property
    def recipe(self) -> Recipe:
        return self.predictor.recipe

    @property
    def models(self) -> list[nn.Module]:
        """The trained models: one for a fused run, one per member for an ensemble."""
        return self.predictor.models

    @property
    def module(self) -> nn.Module:
        """One module: the fused model, or the ensemble whose forward pass returns its vote in the
        form one member's output takes (:class:`tensorturn.recipes.vote.EnsembleModel`). It
        takes *preprocessed* inputs: ``recipe.preprocess(raw)``."""
        return self.predictor.as_model()

    @property
    def input_shape(self) -> list[int]:
        return list(self.config["input"]["shape"])

    def predict(self, inputs: Any, members: bool = False) -> dict[str, np.ndarray]:
        """The served outputs for raw rows ``inputs`` (array-like ``[N, *input_shape]``), by
        name — ``label``, ``probabilities`` (and ``class_name``), or ``prediction`` — exactly as
        ``tensorturn serve`` answers them for this run; ``members``: each ensemble member's too
        (``member_<m>_probabilities``), as the API's ``"parameters": {"members": true}``."""
        x = _rows(inputs, self.input_shape)
        wrong = self.recipe.check_input(x)
        if wrong:
            raise SpecError(wrong)
        pred = self.predictor.serve_rows(x)
        wanted = self.predictor.members if members else None
        return {o.name: np.asarray(o.data)
                for o in served_outputs(pred, wanted, self.recipe.kind, self.recipe.classes)}


def _rows(inputs: Any, shape: list[int]) -> np.ndarray:
    """``inputs`` as the API parses a request's data: float32 rows of ``shape``, finite."""
    try:
        x = np.asarray(inputs, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"inputs must be numbers shaped [N, {', '.join(map(str, shape))}]: {exc}") from None
    if list(x.shape[1:]) != shape or x.ndim != len(shape) + 1:
        raise SpecError(f"inputs of shape {list(x.shape)} do not fit this model: expected "
                        f"[N, {', '.join(map(str, shape))}]")
    if x.size and not np.isfinite(x).all():
        raise SpecError("inputs contain non-finite values (NaN, Infinity, or beyond the FP32 range)")
    return np.ascontiguousarray(x)


def config_file(folder: Path) -> Path:
    """Where the folder's description is: ``tensorturn.json``, or an older export's ``config.json``."""
    if not (folder / CONFIG_FILE).exists() and (folder / OLD_CONFIG_FILE).exists():
        return folder / OLD_CONFIG_FILE
    return folder / CONFIG_FILE


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's ``tensorturn.json`` (an older export's ``config.json``); TensorTurnError when
    it is no exported model folder."""
    if not folder.is_dir():
        raise TensorTurnError(f"{folder} is not a folder (an exported model is a folder from "
                              f"`tensorturn export RUN DIR`)")
    path = config_file(folder)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TensorTurnError(f"{folder} holds no {CONFIG_FILE}: not a folder from `tensorturn export`") from None
    except (OSError, ValueError) as exc:
        raise TensorTurnError(f"{path} is not readable JSON: {exc}") from None
    wanted = EXPORT_FORMAT if path.name == CONFIG_FILE else OLD_FORMAT
    if not isinstance(doc, dict) or doc.get("format") != wanted:
        found = doc.get("format") if isinstance(doc, dict) else None
        raise TensorTurnError(f"{path} is format {found!r}, not {wanted!r}")
    wrong = _wrong_field(doc)
    if wrong:
        raise TensorTurnError(f"{path}: {wrong}: not a whole folder from `tensorturn export`")
    return doc


def model_file(folder: Path, doc: dict[str, Any]) -> Path:
    """The folder's TensorTurn model file: ``tensorturn.safetensors``, or an older export's
    ``model.safetensors`` (its format says which; never a path the config names)."""
    return folder / (MODEL_FILE if doc.get("format") == EXPORT_FORMAT else OLD_MODEL_FILE)


def _wrong_field(doc: dict[str, Any]) -> str | None:
    """What is missing or of the wrong type among the fields :func:`load` and
    :class:`ExportedModel` read, or None."""
    recipe, given = doc.get("recipe"), doc.get("input")
    shape = given.get("shape") if isinstance(given, dict) else None
    checks = (("model_sha256", isinstance(doc.get("model_sha256"), str), "a string"),
              ("recipe", isinstance(recipe, dict) and isinstance(recipe.get("name"), str),
               "an object with the recipe's name"),
              ("recipe.standalone_options", not isinstance(recipe, dict)
               or isinstance(recipe.get("standalone_options") or {}, dict), "an object"),
              ("input.shape", isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool)
                                                              and d > 0 for d in shape), "a list of sizes"),
              ("dataset", doc.get("dataset") in (None, DATASET_DIR), repr(DATASET_DIR)))
    return next((f"{name} is missing or not {kind}" for name, ok, kind in checks if not ok), None)


@contextmanager
def dataset_store(folder: Path, doc: dict[str, Any]) -> Iterator[None]:
    """While the recipe is built: a recipe over a pushed dataset reads its index from the folder's
    ``dataset/`` (a file store holding the index only), not from a pool's store."""
    if not doc.get("dataset"):
        yield
        return
    from tensorturn.data.source import reading_from
    from tensorturn.store.objects import FileStore

    with reading_from(FileStore((folder / DATASET_DIR).resolve().as_uri())):
        yield


def load(path: str | Path, allow: Collection[str] = ()) -> ExportedModel:
    """The folder ``tensorturn export`` wrote at ``path``: checked (``tensorturn.safetensors`` must
    be the file ``tensorturn.json`` names by sha256, of the same recipe), its recipe built (``allow``:
    recipe names allowed for this call besides this machine's allowlist — a user recipe is code),
    its weights loaded. TensorTurnError (one line) for a folder that is not one."""
    folder = Path(path).expanduser()
    doc = read_config(folder)
    weights, described = model_file(folder, doc), config_file(folder).name
    try:
        data = weights.read_bytes()
    except OSError as exc:
        raise TensorTurnError(f"{weights} is not readable: {exc.strerror or exc}") from None
    if sha256_hex(data) != doc.get("model_sha256"):
        raise UntrustedError(f"{weights} is not the file {described} names (its sha256 "
                             f"differs): the folder was changed after export")
    try:
        named = header_of(data)[0].get("recipe")
    except ValueError as exc:
        raise TensorTurnError(f"{weights} is not a safetensors file: {exc}") from None
    if named != doc["recipe"]["name"]:
        raise UntrustedError(f"{weights} names recipe {named!r}, {described} "
                             f"{doc['recipe']['name']!r}; refused")
    standalone = doc["recipe"].get("standalone_options") or {}
    with dataset_store(folder, doc):
        predictor = rebuilt(data, allow, standalone, what=str(weights),
                            hint="this folder's recipe needs that data wherever it loads" if standalone
                            or not doc.get("vocabulary") else "the folder was exported by a TensorTurn "
                            "that did not save what rebuilds the model without its data: export the run again")
    return ExportedModel(folder, doc, predictor)


def rebuilt(data: bytes, allow: Collection[str] = (), options: dict[str, Any] | None = None,
            hint: str = "", what: str = "the model file") -> Predictor:
    """:meth:`Predictor.from_bytes`, where what the recipe cannot rebuild on this machine — a
    file its model reads that is not here, a model of other shapes than the file's weights (its
    data differs from the run's; or the file was crafted: found on the meta device, before the
    model is built) — is one line (RecipeError) ending in ``hint``."""
    try:
        name = header_of(data)[0].get("recipe")
    except ValueError:
        name = None  # from_bytes says what is wrong with the file
    try:
        return Predictor.from_bytes(data, allow, options, what=what)
    except ShapeMismatch as exc:
        raise RecipeError(f"recipe {name!r} built here does not fit the model file ({exc}): the recipe's "
                          f"data here is not the run's, or the file was made to ask for more; {hint}") from None
    except OSError as exc:
        said = f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else str(exc)
        raise RecipeError(f"recipe {name!r} cannot build its model here ({said}, from {Path.cwd()}); "
                          f"{hint}") from None
    except RuntimeError as exc:  # load_state_dict: "size mismatch for tok.weight: ..."
        detail = next((line.strip() for line in str(exc).splitlines()[1:] if line.strip()),
                      str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        raise RecipeError(f"recipe {name!r} built here does not fit the model file ({detail}): the "
                          f"recipe's data here is not the run's; {hint}") from None
