"""Starting a run on an agent, for a CLI that loads no torch (:func:`tensorturn.client.submit`)."""

from __future__ import annotations

import json
from typing import Any

from celery import Task

from .. import layout
from ..celery_app import app
from ..client import start
from ..config import mask_text
from ..errors import RecipeError, TensorTurnError
from ..roster import list_workers
from ..spec import RunSpec
from .attempt import board_for, store_for


@app.task(bind=True, name="tensorturn.start_run", ignore_result=True)
def start_run(self: Task, spec_json: dict[str, Any]) -> None:
    """Build the recipe, check the model fits, store θ_0 and queue the first work; answers the
    submitter (on ``tt:run:<id>:started``) with the run id, or with the error a user should see
    and its exit code — then nothing was queued."""
    spec = RunSpec.from_json(spec_json)
    worker = self.request.hostname or "?"
    board = board_for(self.app.conf.broker_url)
    reply: dict[str, Any] = {"run_id": spec.run_id}
    try:
        start(spec, self.app.conf.broker_url, store_for(spec.store_url), list_workers(board.r))
    except RecipeError as exc:
        reply = {"error": mask_text(f"{exc} (on worker {worker})"), "exit_code": exc.exit_code}
    except TensorTurnError as exc:
        reply = {"error": mask_text(str(exc)), "exit_code": exc.exit_code}
    except Exception as exc:  # noqa: BLE001 - a recipe's own failure, said in one line
        reply = {"error": mask_text(f"starting run {spec.run_id} failed on {worker}: "
                                    f"{type(exc).__name__}: {' '.join(str(exc).split())}"),
                 "exit_code": 2}
    answer = layout.run_key(spec.run_id, "started")
    pipe = board.r.pipeline()
    pipe.rpush(answer, json.dumps(reply))
    pipe.expire(answer, 3600)  # read at once by the submitter; kept a while for nobody else
    pipe.execute()
