"""A finished run as a self-describing folder, and that folder loaded back with no pool.

``tensorturn export RUN DIR`` writes (:func:`tensorturn.export.folder.export_run`):

* ``tensorturn.safetensors`` — the run's final model file, byte for byte (its sha256 is the run's
  ``model_sha256``): one model, or an ensemble's members under ``m<member>.`` prefixes in one file
  with the vote rule in its metadata — the very file ``tensorturn serve`` loads;
* ``tensorturn.json`` — recipe and its options, the run's options, model config(s), task kind,
  input shape and datatype, the served outputs, class names, lineage (run id, data version, the
  runs it started from or learnt from), metrics; no store URL;
* ``README.md`` — a model card, its YAML front matter the Hugging Face Hub's (library, pipeline
  tag, tags, metrics): metrics, data, how it was trained (mode, machines, rounds, bytes);
* ``dataset/`` — only for a recipe over a pushed dataset: that dataset version's index (the
  features' statistics the recipe's preprocessing uses; no rows), so the recipe builds without
  the store;
* optionally ``model.onnx`` (``--format onnx``; its ``metadata_props`` name the task, class names
  and recipe) and, with ``--format transformers`` (``charlm``, ``gpt2-small``, ``textlm``), the
  files that make the folder itself a transformers GPT-2 folder: ``config.json``,
  ``model.safetensors``, ``generation_config.json``, ``tokenizer.json``, ``tokenizer_config.json``.

TensorTurn's own files carry its name so the root is free for transformers' names. A folder
exported before (``tensorturn-export/1``: TensorTurn's ``config.json`` and ``model.safetensors``,
GPT-2 under ``transformers/``) still loads.

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
