"""Weights & Biases: one W&B run per TensorTurn run (its id derived from the run id, so a resume or
``tensorturn track`` goes on in it), project ``tensorturn`` (or WANDB_PROJECT), files under
``<track dir>/wandb``. Offline — nothing leaves this machine, ``wandb sync`` uploads it later —
unless WANDB_MODE says otherwise or this user is logged in (WANDB_API_KEY, or a key for the W&B
host in ~/.netrc, where ``wandb login`` puts it). What is logged is kept in
``<track dir>/wandb/tensorturn-<run id>.json``: an offline run cannot be read back from here."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from tensorturn.track.base import Final, Logged, Param


def logged_in() -> bool:
    """Whether this user has a W&B key here (the environment, or ``wandb login``'s ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or ""
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def mode() -> str:
    return os.environ.get("WANDB_MODE") or ("online" if logged_in() else "offline")


class WandbTracker:
    name = "wandb"

    def __init__(self, track_dir: Path):
        self.dir = track_dir / "wandb"
        self.mode = mode()
        self.run: Any = None  # a wandb Run while one is open
        self.kept = self.dir

    def where(self) -> str:
        run_dir = getattr(self.run, "dir", None)  # the run's files/; its folder is the one `wandb sync` takes
        where = Path(run_dir).parent if run_dir else self.dir
        return f"{where} ({self.mode}{'; `wandb sync` uploads it' if self.mode == 'offline' else ''})"

    def start(self, run_id: str, params: dict[str, Param]) -> Logged:
        import wandb

        self.dir.mkdir(parents=True, exist_ok=True)
        self.kept = self.dir / f"tensorturn-{run_id}.json"
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "tensorturn", name=run_id,
                              id=re.sub(r"[^\w-]", "-", run_id), resume="allow", dir=str(self.dir.parent),
                              mode=self.mode,  # type: ignore[arg-type]  # WANDB_MODE's own words
                              config=params, reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off", save_code=False))
        # rounds and members share one x axis of their own ("step"), not W&B's call counter
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        return Logged().load(self.kept)

    def step(self, step: int, metrics: dict[str, float], logged: Logged) -> None:
        self.run.log({**metrics, "step": step})
        logged.save(self.kept)

    def finish(self, final: Final, logged: Logged) -> None:
        import wandb

        self.run.log({**final.metrics, "step": final.step})
        self.run.summary.update({**final.metrics, "state": final.state})
        if final.model is not None:
            artifact = wandb.Artifact(f"model-{self.run.id}", type="model",
                                      metadata={"uri": final.model.uri, "sha256": final.model.sha256})
            if final.model.path is not None:
                artifact.add_file(str(final.model.path))
            else:  # a reference: W&B records where the model is, not a copy
                artifact.add_reference(final.model.uri, checksum=False)
            self.run.log_artifact(artifact)
        logged.save(self.kept)
        self.run.finish(exit_code=0 if final.state == "succeeded" else 1)
        self.run = None

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
