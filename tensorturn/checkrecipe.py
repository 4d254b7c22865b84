"""``tensorturn check-recipe``: every hook of a recipe on a few rows, in seconds, before a run.

Each step runs what a pool would, on a handful of rows: the data and its splits, ``preprocess``,
the model, the loss and its gradients, a few optimizer steps, ``evaluate``, two ensemble members
combined by the recipe's kind, and the answer ``tensorturn serve`` would send. The first problem
is one line naming the step; nothing is queued or stored.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import Any

from .errors import RecipeError, TensorTurnError

ROWS = 16       # rows each step works on
STEPS = 3       # optimizer steps of the training check


class CheckFailed(RecipeError):
    pass


def _step(name: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except CheckFailed:
        raise
    except TensorTurnError as exc:  # already says what is wrong
        raise CheckFailed(f"{name}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - the recipe's own failure, in one line
        text = " ".join(str(exc).split())
        raise CheckFailed(f"{name}: {type(exc).__name__}: {text}" if text else
                          f"{name}: {type(exc).__name__}") from exc


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise CheckFailed(message)


def check(name: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run every check; the summary of what was found, or CheckFailed naming the first problem."""
    import orjson
    import torch

    from .recipes import load_splits, resolve
    from .recipes.kinds import KINDS
    from .serve import Prediction, encode_answer
    from .training import train_steps

    t0 = time.perf_counter()
    recipe = _step("build", lambda: resolve(name, options or {}))
    _require(recipe.task in KINDS, f"task: unknown kind {recipe.task!r}; use one of {', '.join(KINDS)}")
    kind = recipe.kind
    splits = _step("data", lambda: load_splits(recipe))
    sizes = {}
    for split in ("train", "val", "test"):
        x, y = getattr(splits, f"x_{split}"), getattr(splits, f"y_{split}")
        _require(len(x) > 0, f"data: the {split} split is empty")
        _require(len(x) == len(y), f"data: the {split} split has {len(x)} inputs but {len(y)} targets")
        sizes[split] = len(x)
    if kind.name == "regression":
        _require(splits.y_train.is_floating_point(),
                 f"data: task 'regression' needs float targets, got {splits.y_train.dtype}")
    else:
        _require(not splits.y_train.is_floating_point(),
                 f"data: task {recipe.task!r} needs integer class targets, got "
                 f"{splits.y_train.dtype} (a regression recipe sets task = 'regression')")
    input_shape = _step("input_shape", recipe.input_shape)
    x = splits.x_train[:ROWS]
    _require(list(x.shape[1:]) == list(input_shape),
             f"input_shape: {input_shape} but preprocessed rows are {list(x.shape[1:])}")
    config = _step("default_config", recipe.default_config)
    model = _step("model", lambda: recipe.model(config))
    params = sum(p.numel() for p in model.parameters())
    _require(params > 0, "model: it has no parameters to train")
    loss = _step("loss", lambda: recipe.loss(model, x, splits.y_train[:ROWS]))
    _require(isinstance(loss, torch.Tensor) and loss.ndim == 0,
             f"loss: expected a scalar tensor, got {getattr(loss, 'shape', type(loss).__name__)}")
    _require(math.isfinite(float(loss.detach())), f"loss: not finite ({float(loss.detach())})")
    _step("loss backward", loss.backward)
    _require(any(p.grad is not None for p in model.parameters()), "loss: no gradient reaches the model")
    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr)
    rows = torch.arange(min(len(splits.x_train), ROWS * STEPS))
    trained, _ = _step("training steps", lambda: train_steps(
        recipe, model, opt, splits.x_train, splits.y_train, rows, STEPS,
        min(recipe.batch_size, ROWS), 0, torch.device("cpu")))
    metrics = _step("evaluate", lambda: recipe.evaluate(model, splits.x_val[:ROWS], splits.y_val[:ROWS]))
    _require(isinstance(metrics, dict) and "loss" in metrics,
             f"evaluate: must return a dict with 'loss', got {metrics!r}")
    _require(all(isinstance(v, float) and math.isfinite(v) for v in metrics.values()),
             f"evaluate: values must be finite floats, got {metrics!r}")
    member = _step("member_config", lambda: recipe.member_config(1, random.Random(0)))
    other = _step("model (an ensemble member's config)", lambda: recipe.model({**config, **{
        k: v for k, v in member.items() if k != "lr_scale"}}))
    x_val = splits.x_val[:ROWS]
    per_member = _step("predict", lambda: torch.stack([recipe.predict(m, x_val) for m in (model, other)]))
    _require(per_member.shape[1] == len(x_val),
             f"predict: {per_member.shape[1]} outputs for {len(x_val)} rows (rows must come first)")
    vote = "soft"
    combined = _step("combine", lambda: recipe.combine(per_member, vote))
    _require(combined.shape[0] == len(x_val), f"combine: {combined.shape[0]} outputs for {len(x_val)} rows")
    _step("ensemble metrics", lambda: kind.metrics(combined, splits.y_val[:ROWS], per_member.mean(0)))
    pred = Prediction(combined.float().numpy(), per_member.float().numpy())
    members = [{"member": 0}, {"member": 1}]
    answer = _step("serve", lambda: orjson.loads(encode_answer("check", "v", "id", pred, members, kind)))
    outputs = {o["name"]: o for o in answer["outputs"]}
    for o in outputs.values():
        _require(o["shape"][0] == len(x_val) and len(o["data"]) == math.prod(o["shape"]),
                 f"serve: output {o['name']} has shape {o['shape']} and {len(o['data'])} values")
    return {
        "recipe": name, "task": recipe.task, "rows": sizes, "input_shape": list(input_shape),
        "parameters": params, "train_loss": trained, "val_metrics": metrics,
        "outputs": {n: {"datatype": o["datatype"], "shape": ["N", *o["shape"][1:]]}
                    for n, o in outputs.items() if not n.startswith("member_")},
        "seconds": round(time.perf_counter() - t0, 2),
    }
