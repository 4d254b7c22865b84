"""A fused run's end: keep the last round's weights or the best round's, test them, finish.

The same for every sync policy: where a round's weights live is the caller's to say (θ_{r+1} for
rounds, a version's key for ``--sync async``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tensorturn import layout
from tensorturn.modes.fused.options import eval_passes, options
from tensorturn.recipes import recipe_of
from tensorturn.spec import RunSpec, RunState
from tensorturn.state.board import RunBoard
from tensorturn.state.manifest import end_run
from tensorturn.store import seals
from tensorturn.store.objects import Store
from tensorturn.store.tensors import from_bytes, is_finite
from tensorturn.train.device import pick_device
from tensorturn.train.diloco import UpdateRejected
from tensorturn.train.loop import load_model


def kept_round(spec: RunSpec, board: RunBoard) -> int:
    """The round whose weights the run keeps: the last, or with ``--keep best`` the one with the
    lowest validation loss (a round without the figure, or not a number, is never the best)."""
    opts = options(spec)
    rounds = board.rounds.all(spec.run_id) if opts.keep == "best" else []
    if not rounds:
        return opts.rounds - 1

    def loss(rec: dict[str, Any]) -> float:
        value = rec.get("val_loss")
        return value if value is not None and math.isfinite(value) else math.inf

    return int(min(rounds, key=lambda rec: (loss(rec), -rec["round"]))["round"])


def finalize(spec: RunSpec, store: Store, board: RunBoard,
             weights_key: Callable[[int], str] | None = None, local: Path | None = None,
             finish: Callable[..., None] | None = None) -> None:
    """Store the final model, evaluate it on the test split, and finish the run. The weights
    after round r are at ``weights_key(r)`` (θ_{r+1}'s key, unless said otherwise); ``local``
    is a file holding the last round's, when this machine has them. ``finish`` (the attempt's
    :meth:`~tensorturn.tasks.attempt.Unit.finish_run`) finishes the run with the attempt's own
    records; without it, the run is finished here, its manifest first."""
    run_id, opts = spec.run_id, options(spec)
    kept = kept_round(spec, board) if opts.keep == "best" else opts.rounds - 1
    key = weights_key(kept) if weights_key else layout.key("global", run_id, kept + 1)  # θ after round `kept`
    data = local.read_bytes() if local is not None and kept == opts.rounds - 1 else seals.get_bytes(store, key)
    theta = from_bytes(data)
    if not is_finite(theta):  # a run never ends "succeeded" on weights that cannot answer
        raise UpdateRejected(f"the weights after round {kept} hold NaN/Inf: no model is kept "
                             f"(a lower --lr or --outer-lr, or --keep best, may help)")
    sha = store.put_bytes(layout.key("final_model", run_id), data)
    recipe = recipe_of(spec)
    device = pick_device()
    model = load_model(recipe, theta, recipe.default_config(), device)
    test, rows = recipe.evaluate_counted(model, "test", device, eval_passes(spec, recipe))
    result = {"metrics": {**{f"test_{k}": v for k, v in test.items()}, "test_rows": rows, "kept_round": kept},
              "model_uri": store.uri(layout.key("final_model", run_id)), "model_sha256": sha}
    if finish is not None:
        finish(RunState.SUCCEEDED, **result)
        return
    end_run(store, board, run_id, RunState.SUCCEEDED, **result)
