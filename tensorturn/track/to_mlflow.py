"""MLflow: one MLflow run per TensorTurn run, in experiment ``tensorturn`` (or
MLFLOW_EXPERIMENT_NAME), found again by its tag ``tensorturn.run_id``.

Where: MLFLOW_TRACKING_URI when set; otherwise MLflow's own default kept on this machine, a
SQLite file ``<track dir>/mlflow.db`` with artifacts in ``<track dir>/mlruns`` (`mlflow ui`
started in that folder shows them). MLflow 3 refuses its old ``./mlruns`` file store unless told
otherwise; SQLite is what it now writes by default. Written through :class:`MlflowClient` (no
global active run: two trackers in one process do not meet).

The run's model is logged as an MLflow model at the run's artifact path ``model``: the run
exported (``tensorturn export``, from the store the run used) inside a pyfunc model whose code is
:mod:`tensorturn.track.mlflow_model` ("models from code": nothing pickled; the weights stay the
run's safetensors file), with a signature — the input rows and the served outputs — so
``mlflow.pyfunc.load_model("runs:/<id>/model")`` predicts what ``tensorturn serve`` answers, and
the model can be registered. Where it cannot be exported here (a recipe not allowed, its data
missing), the tags and ``model/model-reference.json`` name the model in the store instead, and a
warning says why."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import numpy as np

from tensorturn import config
from tensorturn.track.base import Final, Logged, as_text

log = logging.getLogger(__name__)

TAG = "tensorturn.run_id"
MARK = "samples"  # every round's record holds its samples: the history of this metric says which are logged
MODEL_PATH = "model"  # the run's artifact path of the MLflow model
MODEL_CODE = Path(__file__).with_name("mlflow_model.py")
ARTIFACT = "tensorturn"  # the exported folder's name among the model's artifacts (mlflow_model.ARTIFACT)
PROGRESS_BARS = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
DTYPES = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32, "BOOL": np.bool_}


def signature(doc: dict[str, Any]) -> Any:
    """The MLflow signature of an exported model's ``predict`` (``tensorturn.json``'s ``doc``):
    rows of the recipe's datatype, ``[-1, *shape]`` (one unnamed tensor: MLflow hands the array to
    ``predict`` as given); the served numeric outputs by name; the parameter ``members`` (an
    ensemble's members' outputs too)."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ParamSchema, ParamSpec, Schema, TensorSpec

    given = doc["input"]
    inputs = Schema([TensorSpec(np.dtype(DTYPES.get(given["datatype"], np.float32)), (-1, *given["shape"]))])
    outputs = Schema([TensorSpec(np.dtype(DTYPES[o["datatype"]]), tuple(o["shape"]), o["name"])
                      for o in doc["outputs"] if o["datatype"] in DTYPES])
    return ModelSignature(inputs, outputs, ParamSchema([ParamSpec("members", "boolean", False)]))


@contextmanager
def no_progress_bars() -> Iterator[None]:
    """MLflow draws a bar on stderr while it copies artifacts: not on the run's console."""
    before = os.environ.get(PROGRESS_BARS)
    os.environ[PROGRESS_BARS] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PROGRESS_BARS, None)
        else:
            os.environ[PROGRESS_BARS] = before


def requirements() -> list[str]:
    try:
        return [f"tensorturn=={version('tensorturn')}"]
    except PackageNotFoundError:
        return ["tensorturn"]


class MlflowTracker:
    name = "mlflow"

    def __init__(self, track_dir: Path):
        # nothing here touches the disk or the database: that is start()'s, which the feed
        # guards (a tracker that cannot start is dropped with a warning, the run goes on)
        self.track_dir = track_dir.resolve()
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{self.track_dir / 'mlflow.db'}"
        self.artifacts = (self.track_dir / "mlruns").as_uri()
        self.experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "tensorturn"
        self.client: Any = None
        self.run_id = ""

    def where(self) -> str:
        return f"{config.mask_url(self.uri)}, experiment {self.experiment}, MLflow run {self.run_id}"

    def start(self, run_id: str, params: dict[str, Any]) -> Logged:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        # MLflow's schema migrations log a line each at INFO; the run's lines matter more
        logging.getLogger("alembic").setLevel(logging.WARNING)
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        if self.uri.startswith("sqlite:///"):
            self.track_dir.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = (found.experiment_id if found is not None else
                         self.client.create_experiment(self.experiment, artifact_location=self.artifacts
                                                       if not self.uri.startswith(("http", "databricks"))
                                                       else None))
        runs = self.client.search_runs([experiment_id], f"tags.`{TAG}` = '{run_id}'", max_results=1)
        logged = Logged()
        if runs:  # logged before (a resume, `tensorturn track`): go on in the same MLflow run
            self.run_id = runs[0].info.run_id
            logged.rounds = {m.step for m in self.client.get_metric_history(self.run_id, MARK)}
            logged.members = {int(k[1:].split("/", 1)[0]) for k in runs[0].data.metrics
                              if k.startswith("m") and k.endswith("/segments")}
            logged.finished = runs[0].data.tags.get("tensorturn.finished") == "1"
            if runs[0].info.status != "RUNNING" and not logged.finished:
                self.client.update_run(self.run_id, status="RUNNING")
            return logged
        run = self.client.create_run(experiment_id, run_name=run_id, tags={TAG: run_id})
        self.run_id = run.info.run_id
        # MLflow keeps a parameter once: logged when the run is made, never again
        items = [Param(k, v[:6000]) for k, v in sorted(as_text(params).items())]
        for i in range(0, len(items), 100):  # log_batch takes at most 100 parameters
            self.client.log_batch(self.run_id, params=items[i:i + 100])
        return logged

    def step(self, step: int, metrics: dict[str, float], logged: Logged) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in sorted(metrics.items())])

    def finish(self, final: Final, logged: Logged) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, final.step)
                                                    for k, v in sorted(final.metrics.items())])
        if final.model is not None:
            self.client.set_tag(self.run_id, "tensorturn.model_uri", final.model.uri)
            self.client.set_tag(self.run_id, "tensorturn.model_sha256", final.model.sha256 or "")
            try:
                self.log_model(final)
            except Exception as exc:  # noqa: BLE001 - the run's figures are logged; its model is named instead
                log.warning("run %s: its model is not logged to MLflow as a model (%s: %s); the tags and "
                            "model/model-reference.json name it in the store", final.run_id,
                            type(exc).__name__, config.mask_text(str(exc).splitlines()[0] if str(exc) else ""))
                with tempfile.TemporaryDirectory(prefix="tt-track-") as tmp:
                    ref = Path(tmp) / "model-reference.json"
                    ref.write_text(json.dumps({"uri": final.model.uri, "sha256": final.model.sha256}, indent=2))
                    self.client.log_artifact(self.run_id, str(ref), MODEL_PATH)
        if final.error:
            self.client.set_tag(self.run_id, "tensorturn.error", final.error[:5000])
        self.client.set_tag(self.run_id, "tensorturn.state", final.state)
        self.client.set_tag(self.run_id, "tensorturn.finished", "1")
        self.client.set_terminated(self.run_id, "FINISHED" if final.state == "succeeded" else
                                   "FAILED" if final.state == "failed" else "KILLED")

    def log_model(self, final: Final) -> None:
        """The run exported from its store and logged as an MLflow pyfunc model (module docstring)."""
        import mlflow.pyfunc

        from tensorturn.export.folder import export_run
        from tensorturn.export.loaded import CONFIG_FILE
        from tensorturn.store.objects import open_store

        if not final.store_url:
            raise ValueError("the run's description names no store")
        with tempfile.TemporaryDirectory(prefix="tt-track-") as tmp:
            exported, saved = Path(tmp) / ARTIFACT, Path(tmp) / MODEL_PATH
            export_run(open_store(final.store_url), final.run_id, exported)
            doc = json.loads((exported / CONFIG_FILE).read_text(encoding="utf-8"))
            with warnings.catch_warnings(), no_progress_bars():
                # advice for a model written by hand (type hints, an input example): the signature
                # says what the model takes, and the run's own lines matter more
                warnings.simplefilter("ignore", UserWarning)
                mlflow.pyfunc.save_model(str(saved), python_model=str(MODEL_CODE),
                                         artifacts={ARTIFACT: str(exported)}, signature=signature(doc),
                                         pip_requirements=requirements())
            self.client.log_artifacts(self.run_id, str(saved), MODEL_PATH)

    def close(self) -> None:
        pass
