"""MLflow: one MLflow run per TensorTurn run, in experiment ``tensorturn`` (or
MLFLOW_EXPERIMENT_NAME), found again by its tag ``tensorturn.run_id``.

Where: MLFLOW_TRACKING_URI when set; otherwise MLflow's own default kept on this machine, a
SQLite file ``<track dir>/mlflow.db`` with artifacts in ``<track dir>/mlruns`` (`mlflow ui`
started in that folder shows them). MLflow 3 refuses its old ``./mlruns`` file store unless told
otherwise; SQLite is what it now writes by default. Written through :class:`MlflowClient` (no
global active run: two trackers in one process do not meet)."""

from __future__ import annotations

import json
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from tensorturn import config
from tensorturn.track.base import Final, Logged, as_text

TAG = "tensorturn.run_id"
MARK = "samples"  # every round's record holds its samples: the history of this metric says which are logged


class MlflowTracker:
    name = "mlflow"

    def __init__(self, track_dir: Path):
        import os

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
            with tempfile.TemporaryDirectory(prefix="tt-track-") as tmp:
                ref = Path(tmp) / "model-reference.json"
                ref.write_text(json.dumps({"uri": final.model.uri, "sha256": final.model.sha256}, indent=2))
                self.client.log_artifact(self.run_id, str(ref), "model")
            if final.model.path is not None:  # on this machine: the weights themselves
                self.client.log_artifact(self.run_id, str(final.model.path), "model")
        if final.error:
            self.client.set_tag(self.run_id, "tensorturn.error", final.error[:5000])
        self.client.set_tag(self.run_id, "tensorturn.state", final.state)
        self.client.set_tag(self.run_id, "tensorturn.finished", "1")
        self.client.set_terminated(self.run_id, "FINISHED" if final.state == "succeeded" else
                                   "FAILED" if final.state == "failed" else "KILLED")

    def close(self) -> None:
        pass
