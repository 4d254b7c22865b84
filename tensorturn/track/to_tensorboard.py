"""TensorBoard: event files in ``<track dir>/runs/<run id>/`` (``tensorboard --logdir runs``),
written with torch's :class:`~torch.utils.tensorboard.SummaryWriter` (torch is here already; the
``tensorboard`` package it needs is the one that reads them). Scalars per round, the run's
settings as hparams and as a text table, the model's store key as text. What is logged is kept
beside the events (``tensorturn-logged.json``): event files are append-only, and a second
``tensorturn track`` must not log a round twice."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tensorturn.track.base import Final, Logged, Param

KEPT = "tensorturn-logged.json"


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, track_dir: Path):
        self.root = track_dir / "runs"
        self.dir = self.root
        self.writer: Any = None

    def where(self) -> str:
        return str(self.dir)

    def start(self, run_id: str, params: dict[str, Param]) -> Logged:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = self.root / run_id
        logged = Logged().load(self.dir / KEPT)
        self.writer = SummaryWriter(log_dir=str(self.dir))
        if not (self.dir / KEPT).exists():
            from torch.utils.tensorboard.summary import hparams

            # hparams written into this run's own events (SummaryWriter.add_hparams would open a
            # second run folder); the final figures are the metrics the HParams tab lists
            metrics = {k: 0.0 for k in ("final/test_loss", "final/test_accuracy")}
            for summary in hparams(params, metrics):
                self.writer.file_writer.add_summary(summary)
            table = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
            self.writer.add_text("run/settings", f"| setting | value |\n|---|---|\n{table}")
            logged.save(self.dir / KEPT)
        return logged

    def step(self, step: int, metrics: dict[str, float], logged: Logged) -> None:
        for key, value in sorted(metrics.items()):
            self.writer.add_scalar(key, value, step)
        self.writer.flush()
        logged.save(self.dir / KEPT)

    def finish(self, final: Final, logged: Logged) -> None:
        for key, value in sorted(final.metrics.items()):
            self.writer.add_scalar(key, value, final.step)
        lines = [f"state: {final.state}"]
        if final.model is not None:
            lines += [f"model: {final.model.uri}", f"sha256: {final.model.sha256}"]
        if final.error:
            lines.append(f"error: {final.error}")
        self.writer.add_text("run/model", "  \n".join(lines), final.step)
        self.writer.flush()
        logged.save(self.dir / KEPT)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
