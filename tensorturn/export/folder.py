"""``tensorturn export RUN DIR``: a succeeded run's model as a folder that describes itself.

Why the model file is the run's own, byte for byte: its sha256 is the run's ``model_sha256``
(lineage a reader can check), it is the very file ``tensorturn serve`` loads (so the folder
cannot predict otherwise than the API), and an ensemble stays one file — its members' weights
under ``m<member>.`` and the vote rule in the metadata — rather than one file per member that
could be copied apart from the others.

The folder is written beside ``DIR`` under a temporary name and renamed into place when whole:
a failure (a format that does not map, a disk that fills) leaves no half-written folder.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tensorturn import layout
from tensorturn.config import public
from tensorturn.data.source import check_pinned, pinned
from tensorturn.errors import NotFound, RecipeError, SpecError, TensorTurnError
from tensorturn.export import card
from tensorturn.export.loaded import (
    CARD_FILE,
    CONFIG_FILE,
    DATASET_DIR,
    EXPORT_FORMAT,
    MODEL_FILE,
    ONNX_FILE,
    rebuilt,
)
from tensorturn.predictor import Predictor, dataset_pins, result_bytes
from tensorturn.recipes.answer import served_outputs
from tensorturn.spec import FINISHED, RunState
from tensorturn.store.objects import ObjectMissing, Store
from tensorturn.store.tensors import metadata_of

log = logging.getLogger(__name__)

FORMATS = ("onnx", "transformers")


@dataclass
class ExportResult:
    """What ``export`` wrote: the folder, its files (name → bytes) and the run it holds."""

    path: str
    run_id: str
    mode: str
    recipe: str
    model_sha256: str
    formats: list[str]
    files: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def check_destination(dest: Path) -> None:
    """SpecError unless ``dest`` is free: absent, or an empty folder (nothing there is replaced)."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise SpecError(f"{dest} exists and is not a folder; nothing was written")
    if dest.is_dir() and any(dest.iterdir()):
        raise SpecError(f"{dest} exists and is not empty; export into a new or empty folder "
                        f"(nothing was written)")


def check_formats(formats: Sequence[str]) -> list[str]:
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise SpecError(f"unknown export format {unknown[0]!r}: use {' or '.join(FORMATS)}")
    return list(dict.fromkeys(formats))


def finished_manifest(store: Store, run_id: str) -> dict[str, Any]:
    """The run's manifest if it succeeded; one clear error otherwise."""
    from tensorturn.state.manifest import read_manifest

    if not layout.RUN_ID.fullmatch(run_id):
        raise SpecError(f"{run_id!r} is not a run id (see `tensorturn runs`)")
    try:
        manifest = read_manifest(store, run_id)
    except ObjectMissing:
        raise NotFound(f"no run {run_id!r} in the store (see `tensorturn runs`)") from None
    state = manifest.get("state")
    if state not in FINISHED:
        raise SpecError(f"run {run_id} is {state}: only a run that succeeded can be exported "
                        f"(wait for it: `tensorturn status {run_id} --follow`)")
    if state != RunState.SUCCEEDED or not manifest.get("model_uri"):
        raise SpecError(f"run {run_id} {state}: it has no model to export")
    return manifest


def export_run(store: Store, run_id: str, dest: str | Path, formats: Sequence[str] = ()) -> ExportResult:
    """Write run ``run_id``'s model from ``store`` into the new folder ``dest`` (module docstring);
    ``formats``: also ``onnx`` and/or ``transformers``. Refused, with nothing written, for a run
    that did not succeed, a ``dest`` that is not empty, or a format the model does not map to."""
    dest = Path(dest).expanduser()
    wanted = check_formats(formats)
    _writing(dest, lambda: check_destination(dest))
    finished_manifest(store, run_id)
    data, manifest = result_bytes(store, run_id)  # verified: signed manifest, sha256, recipe allowed
    check_no_secret(metadata_of(data), run_id)
    hint = ("a relative path is read from the current folder: export where the run's data is "
            "at the path its options name")
    dataset = _dataset_index(store, manifest)
    with pinned(dataset_pins(manifest)):  # the recipe reads the run's dataset index, as checked
        predictor = rebuilt(data, hint=hint, what=f"run {run_id}'s model file")
    try:
        doc = describe(predictor, manifest, metadata_of(data), dataset)
    except OSError as exc:  # the recipe read its data again (a vocabulary, an input shape)
        raise RecipeError(f"recipe {manifest['recipe']!r} cannot describe its model here "
                          f"({_said(exc)}, from {Path.cwd()}); {hint}") from None
    _writing(dest, lambda: _write_folder(dest, data, dataset, wanted, predictor, doc, manifest))
    files = {str(p.relative_to(dest)): p.stat().st_size for p in sorted(dest.rglob("*")) if p.is_file()}
    return ExportResult(str(dest), run_id, manifest["mode"], manifest["recipe"], manifest["model_sha256"],
                        wanted, files)


def _said(exc: OSError) -> str:
    return f"{exc.strerror}: {exc.filename}" if exc.strerror and exc.filename else str(exc)


def _writing(dest: Path, write: Callable[[], None]) -> None:
    """``write()``, where a folder that cannot be made or written (under a file, no permission,
    a full disk) is one line, with nothing left behind: the temporary folder is gone (its
    writer removes it) and so are the parents made for ``dest``."""
    made = []
    for parent in dest.parents:  # the parents that do not exist yet, deepest first
        if parent.exists() or parent.is_symlink():
            break
        made.append(parent)
    try:
        write()
    except OSError as exc:
        for parent in made:
            try:
                parent.rmdir()
            except OSError:
                break
        raise TensorTurnError(f"cannot write {dest}: {_said(exc)}; nothing was written") from None


def check_no_secret(file_meta: dict[str, str], run_id: str) -> None:
    """SpecError when the model file's recipe options hold a secret: the file is copied byte for
    byte and its options rebuild the recipe (they cannot be masked), so the secret would leave
    the store with the folder."""
    options = json.loads(file_meta.get("recipe_options") or "{}")
    secret = sorted(k for k, v in options.items() if public({k: v}) != {k: v})
    if secret:
        raise SpecError(f"run {run_id}: recipe option {', '.join(map(repr, secret))} holds a secret (a "
                        f"password, token or key), and the model file carries the options that rebuild "
                        f"its recipe: export refused, nothing was written (pass secrets to a recipe by "
                        f"environment, not as options)")


def _write_folder(dest: Path, data: bytes, dataset: DatasetIndex | None, wanted: list[str],
                  predictor: Predictor, doc: dict[str, Any], manifest: dict[str, Any]) -> None:
    """The folder, written under a temporary name beside ``dest`` and renamed into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        (work / MODEL_FILE).write_bytes(data)
        if dataset is not None:  # as a file store lays it out, so the recipe reads it unchanged
            index_file = work / DATASET_DIR / dataset.key  # its key: a checked name, a version number
            index_file.parent.mkdir(parents=True)
            index_file.write_text(json.dumps(dataset.index, sort_keys=True), encoding="utf-8")
        for fmt in wanted:
            doc["formats"][fmt] = _write_format(fmt, predictor, doc, work)
        for name, text in texts(doc, manifest).items():
            (work / name).write_text(text, encoding="utf-8")
        check_destination(dest)  # still free: nothing another process wrote meanwhile is replaced
        if dest.is_dir():
            dest.rmdir()
        work.rename(dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def texts(doc: dict[str, Any], manifest: dict[str, Any]) -> dict[str, str]:
    """``tensorturn.json`` and the model card, as written: for people and other machines, so what
    the card quotes of the run's record is :func:`public` too (:func:`describe` made ``doc``)."""
    return {CONFIG_FILE: json.dumps(doc, indent=2, sort_keys=True) + "\n",
            CARD_FILE: card.model_card(doc, public(manifest))}


def _write_format(fmt: str, predictor: Predictor, doc: dict[str, Any], work: Path) -> list[str]:
    """Format ``fmt`` written into the folder ``work``: the names of the files it wrote."""
    from tensorturn.export import formats

    if fmt == "onnx":
        formats.write_onnx(predictor, doc, work / ONNX_FILE)
        return [ONNX_FILE]
    return formats.write_gpt2(predictor, work)


@dataclass
class DatasetIndex:
    """The pushed dataset version a run's recipe read: its index (no rows), and its store key —
    built from the run's signed spec (a checked name and a version number), never from a field of
    the index, which is where it goes in the folder."""

    key: str
    index: dict[str, Any]


def _dataset_index(store: Store, manifest: dict[str, Any]) -> DatasetIndex | None:
    """The pushed dataset version the run's recipe read, or None. Checked as the run's machines
    check it: against the sha256 the run pinned in its signed spec when it started (a run
    started before runs pinned it: the index must name the dataset and version its key does);
    otherwise one line naming the index (TamperedObject), and nothing is written."""
    options = (manifest.get("spec") or {}).get("recipe_options") or {}
    if not options.get("dataset"):
        return None
    from tensorturn.data.index import read

    with pinned(dataset_pins(manifest)):
        index, key, sha256 = read(store, str(options["dataset"]), options.get("version"))
        check_pinned(key, sha256)
    return DatasetIndex(key, index)


def describe(predictor: Predictor, manifest: dict[str, Any], file_meta: dict[str, str],
             dataset: DatasetIndex | None) -> dict[str, Any]:
    """``tensorturn.json``: everything needed to rebuild and understand the model, no secret (nor
    where the store is: the folder leaves it): what
    is there for people (the recipe's and the run's options, lineage) is :func:`public` — every
    string masked, secret-named values ``***`` — and what rebuilds the model with none of its data
    (the recipe's :meth:`~tensorturn.recipes.Recipe.standalone_options`) is exact, so it must hold
    no secret (SpecError). The spec's signature is not copied."""
    recipe = predictor.recipe
    spec = dict(manifest.get("spec") or {})
    input_shape = recipe.input_shape()
    probe = predictor.serve_rows(np.zeros([1, *input_shape], np.float32))
    outputs = [{"name": o.name, "datatype": o.datatype, "shape": [-1, *np.asarray(o.data).shape[1:]]}
               for o in served_outputs(probe, None, recipe.kind, recipe.classes)]
    if predictor.vote == "single":
        model: dict[str, Any] = {"kind": "single", "config": json.loads(file_meta["config"])}
    else:
        model = {"kind": "ensemble", "vote": predictor.vote, "members": predictor.members}
    options = public(spec.get("recipe_options") or {})
    standalone = recipe.standalone_options()
    if public(standalone) != standalone:
        raise SpecError(f"run {manifest['run_id']}: recipe {manifest['recipe']!r} needs a secret to "
                        f"rebuild its model: export refused, nothing was written")
    doc: dict[str, Any] = {
        "format": EXPORT_FORMAT,
        "model_file": MODEL_FILE,
        "model_sha256": manifest["model_sha256"],
        "recipe": {"name": manifest["recipe"], "options": options,
                   **({"standalone_options": standalone} if standalone else {})},
        "task": recipe.kind.name,
        "input": {"shape": input_shape, "datatype": recipe.input_dtype,
                  "preprocessing": "the recipe's preprocess (applied by predict and the API)"},
        "outputs": outputs,
        "classes": list(recipe.classes) if recipe.classes else None,
        "model": model,
        "run": public({k: v for k, v in spec.items() if k not in ("store_url", "run_id", "created_at")}),
        "metrics": manifest.get("metrics") or {},
        "lineage": {
            "run_id": manifest["run_id"],
            "mode": manifest["mode"],
            "created_at": manifest.get("created_at"),
            "finished_at": manifest.get("finished_at"),
            "data": public(data_version(options, dataset)),
            "parents": public({k: v for k, v in (("init_from", (spec.get("options") or {}).get("init_from")),
                                                 ("teacher", options.get("teacher"))) if v}),
        },
        "formats": {},
        "exported_at": time.time(),
    }
    vocab = getattr(recipe, "vocab", None)
    if recipe.kind.name == "language_model" and callable(vocab):
        doc["vocabulary"] = vocab()  # token id → character (charlm) or byte (gpt2-small, textlm)
    if dataset is not None:
        doc["dataset"] = DATASET_DIR
    return doc


def data_version(options: dict[str, Any], dataset: DatasetIndex | None) -> dict[str, Any]:
    """What the model was trained on, as precisely as the run records it."""
    if dataset is not None:
        index = dataset.index
        return {"dataset": index.get("name"), "version": index.get("version"),
                "rows": index.get("rows"), "created_at": index.get("created_at"),
                "source": index.get("source")}
    if options.get("data"):
        return {"file": str(options["data"])}
    return {"built_in": "the recipe's own data"}
