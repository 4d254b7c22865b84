"""A finished run as a self-describing folder, and that folder loaded back with no pool.

``tensorturn export RUN DIR`` writes (:func:`tensorturn.export.folder.export_run`):

* ``model.safetensors`` — the run's final model file, byte for byte (its sha256 is the run's
  ``model_sha256``): one model, or an ensemble's members under ``m<member>.`` prefixes in one file
  with the vote rule in its metadata — the very file ``tensorturn serve`` loads;
* ``config.json`` — recipe and its options, the run's options, model config(s), task kind, input
  shape and datatype, the served outputs, class names, lineage (run id, data version, the runs it
  started from or learnt from), metrics;
* ``README.md`` — a model card: metrics, data, how it was trained (mode, machines, rounds, bytes);
* ``dataset/`` — only for a recipe over a pushed dataset: that dataset version's index (the
  features' statistics the recipe's preprocessing uses; no rows), so the recipe builds without
  the store;
* optionally ``model.onnx`` (``--format onnx``) and ``transformers/`` (``--format transformers``:
  a GPT-2 folder for ``charlm``/``gpt2-small``).

:func:`load` gives back the torch module(s) and a ``predict`` that answers exactly what the
inference API serves for the same run: it runs the serving code's own path
(:meth:`tensorturn.predictor.Predictor.serve_rows` and
:func:`tensorturn.recipes.answer.served_outputs`). It needs no broker, pool or store, and reads
weights with safetensors only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tensorturn.export.loaded import ExportedModel

__all__ = ["load", "export_run", "ExportedModel"]


def load(path: Any, allow: Any = ()) -> "ExportedModel":
    """The exported folder at ``path`` (:func:`tensorturn.export.loaded.load`)."""
    from tensorturn.export.loaded import load as load_folder

    return load_folder(path, allow)


def __getattr__(name: str) -> Any:  # the heavy parts (torch) only when used
    if name == "export_run":
        from tensorturn.export.folder import export_run

        return export_run
    if name == "ExportedModel":
        from tensorturn.export.loaded import ExportedModel

        return ExportedModel
    raise AttributeError(name)
