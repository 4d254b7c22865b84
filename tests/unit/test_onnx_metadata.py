"""An exported ONNX graph says what reads its outputs — the task, the class names by label — and
where it came from, in the graph's own metadata (`metadata_props`), which any runtime reads."""

from __future__ import annotations

import json

from tensorturn.export.formats import onnx_metadata


def test_the_metadata_names_the_classes_in_label_order_and_the_run():
    doc = {"format": "tensorturn-export/2", "task": "classification", "model_sha256": "ab" * 32,
           "recipe": {"name": "imagefolder", "options": {"size": 32}}, "lineage": {"run_id": "r-1"},
           "input": {"shape": [3, 32, 32], "datatype": "FP32"}, "classes": ["cat", "dog"],
           "outputs": [{"name": "label", "datatype": "INT64", "shape": [-1]}]}
    props = onnx_metadata(doc)
    assert json.loads(props["tensorturn.classes"]) == ["cat", "dog"]
    assert json.loads(props["tensorturn.recipe"]) == {"name": "imagefolder", "options": {"size": 32}}
    assert props["tensorturn.run_id"] == "r-1" and props["tensorturn.task"] == "classification"
    assert all(isinstance(v, str) for v in props.values())  # ONNX keeps strings only
    assert "tensorturn.classes" not in onnx_metadata({**doc, "classes": None})
