"""A tracked run's model as MLflow loads it: ``mlflow.pyfunc.load_model("runs:/<id>/model")``.

MLflow's "models from code": this file is the model's code — MLflow copies it into the logged
model and runs it when loading, where ``set_model`` names the model — so nothing is pickled. The
weights are the exported folder (``tensorturn export``) that the logged model carries as its
artifact ``tensorturn``: its safetensors file, read by :func:`tensorturn.export.load`, and
``predict`` is that folder's, so the model answers what ``tensorturn serve`` answers for the run.

Loading it needs TensorTurn installed (the logged model's requirements name it) and, for a
user's recipe, that recipe allowed and importable, as for ``tensorturn.load``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mlflow.models import set_model
from mlflow.pyfunc import PythonModel

ARTIFACT = "tensorturn"  # the exported folder, under the logged model's artifacts


class TensorTurnModel(PythonModel):
    """``predict(rows, params={"members": True})``: the served outputs by name (``label``,
    ``probabilities``… or ``prediction``), as :meth:`tensorturn.export.ExportedModel.predict`."""

    def load_context(self, context: Any) -> None:
        from tensorturn.export import load

        self.model = load(context.artifacts[ARTIFACT])

    # model_input without a type hint: MLflow would validate inputs against a hint, where the
    # logged signature (a tensor of the recipe's rows) is what says what they are
    def predict(self, context, model_input, params: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
        rows = model_input.to_numpy() if hasattr(model_input, "to_numpy") else np.asarray(model_input)
        return self.model.predict(rows, members=bool((params or {}).get("members", False)))


set_model(TensorTurnModel())
