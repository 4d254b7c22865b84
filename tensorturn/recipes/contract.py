"""The recipe contract: what a run's results rest on, and every hook of a recipe on a few rows.

:func:`contract` is what a run's results depend on — the task kind, the targets, the hooks the
kind calls, the targets' units, class names and the shapes the model gives — and runs wherever a
recipe is about to be used (:func:`check_contract`): when a run starts (``run``, ``distill``), and
in ``serve`` and ``soup``. It trains nothing, builds the model on the meta device (nothing
allocated, any size) and reads a few rows: milliseconds once the data is loaded. :func:`fresh`
checks every hook a run calls on a fresh instance (:func:`check_fresh`).

:func:`check` is the rest of ``tensorturn check-recipe``: each step runs what a pool would, on a
handful of rows — the data and its splits, ``preprocess``, the model, the loss and its gradients,
a few optimizer steps, ``evaluate``, two ensemble members combined by the recipe's kind, and the
answer ``tensorturn serve`` would send. The first problem is one :class:`CheckFailed` naming the
step; nothing is queued or stored. Submit does not run it: it trains (seconds to minutes for a
large model; 53 s for gpt2-small on 2 CPU cores), and a recipe's ``loss`` may have effects of its
own. ``check-recipe`` runs it in a process of its own, each step within a limit
(:mod:`tensorturn.recipes.check`).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import Any

from tensorturn.errors import RecipeError, TensorTurnError

ROWS = 16       # rows each step works on
STEPS = 3       # optimizer steps of the training check


class CheckFailed(RecipeError):
    """The first problem, as ``STEP: what``; from a check's own process, with the recipe's
    ``where`` (file and line) and ``trace`` (its traceback, for ``--debug``) when it raised."""

    def __init__(self, message: str, where: str | None = None, trace: str | None = None):
        super().__init__(message)
        self.where, self.trace = where, trace


def _ignore(step: str) -> None:
    pass


# told each step as it starts: nobody, except in a check's own process
# (:func:`tensorturn.recipes.check.in_child`, through :func:`tell_steps`)
_started: Callable[[str], None] = _ignore


def tell_steps(to: Callable[[str], None]) -> None:
    """Have ``to`` told the name of each step of :func:`check` as it starts (a check's own
    process tells its parent, which holds each step to its limit)."""
    global _started
    _started = to


def _step(name: str, fn: Callable[[], Any]) -> Any:
    _started(name)
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


def _overrides(recipe: Any, hook: str) -> bool:
    from tensorturn.recipes.base import Recipe

    return getattr(type(recipe), hook, None) is not getattr(Recipe, hook, None)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


def contract(recipe: Any, x: Any, y: Any, model: Any = None) -> None:
    """CheckFailed naming the first broken promise a run's results rest on, checked on a few
    preprocessed training rows ``x``, ``y``: a known task kind; no override its kind never calls;
    targets of the kind's type; ``input_shape``; sound ``classes`` and ``unscale_targets``; and
    the model's outputs (``model``'s, else the default model's built on the meta device) shaped
    as the kind and the targets need."""
    import torch

    from tensorturn.recipes.kinds import KINDS

    _require(recipe.task in KINDS, f"task: unknown kind {recipe.task!r}; use one of {', '.join(KINDS)}")
    kind = recipe.kind
    for (hook, caller), advice in kind.ignores.items():
        if _overrides(recipe, hook) and not (caller and _overrides(recipe, caller)):
            raise CheckFailed(f"hooks: {hook} is not used for task {recipe.task!r}: {advice}")
    if kind.scaled:
        _require(y.is_floating_point(), f"data: task {recipe.task!r} needs float targets, got {y.dtype}")
    else:
        _require(not y.is_floating_point(),
                 f"data: task {recipe.task!r} needs integer class targets, got "
                 f"{y.dtype} (a regression recipe sets task = 'regression')")
        _require(y.numel() == 0 or int(y.min()) >= 0,
                 f"data: class targets are class numbers from 0, got {int(y.min()) if y.numel() else 0}")
    input_shape = _step("input_shape", recipe.input_shape)
    _require(list(x.shape[1:]) == list(input_shape),
             f"input_shape: {input_shape} but preprocessed rows are {list(x.shape[1:])}")
    classes = recipe.classes
    if classes is not None:
        _require(not kind.scaled, f"classes: task {recipe.task!r} has no classes (a classifier "
                                  f"sets task = 'classification')")
        _require(isinstance(classes, (list, tuple)) and len(classes) > 0
                 and all(isinstance(c, str) for c in classes),
                 f"classes: must be a list of class names (strings), got {_short(classes)}"
                 + (" (a count of classes is no longer `classes`: name it num_classes)"
                    if isinstance(classes, int) else ""))
    if kind.scaled and len(y):
        back = _step("unscale_targets", lambda: recipe.unscale_targets(y.float()))
        _require(isinstance(back, torch.Tensor) and tuple(back.shape) == tuple(y.shape),
                 f"unscale_targets: must return a tensor shaped like its input {list(y.shape)}, got "
                 f"{list(back.shape) if isinstance(back, torch.Tensor) else type(back).__name__}")
        _require(bool(torch.isfinite(back).all()), "unscale_targets: returned values that are not finite")
    if model is None:
        out = _meta_outputs(recipe, x)
    else:  # a trained model at hand (served): its forward on a few rows, not a meta one (which
        # runs torch's decompositions, and imports torch's dynamo for them: 1–2 s)
        out = _step("predict", lambda: recipe.predict(model, x[:ROWS]))
        out = out if isinstance(out, torch.Tensor) else None
    if out is None or len(x) == 0:
        return
    _require(out.ndim >= 1 and out.shape[0] == len(x),
             f"predict: {out.shape[0] if out.ndim else 0} outputs for {len(x)} rows (rows must come first)")
    if kind.scaled:
        per_row, wanted = out[0].numel(), (y[0].numel() if len(y) else out[0].numel())
        _require(per_row == wanted,
                 f"predict: {per_row} values per row, but the targets have {wanted} (task "
                 f"{recipe.task!r} compares them one to one)")
        return
    n_classes = int(out.shape[-1]) if out.ndim >= 2 else 1
    _require(n_classes >= 2, f"predict: {n_classes} class per row; a classifier needs at least 2 "
                             f"(a regression recipe sets task = 'regression')")
    if classes is not None:
        _require(len(classes) == n_classes,
                 f"classes: {len(classes)} names for the model's {n_classes} classes")
    _require(y.numel() == 0 or int(y.max()) < n_classes,
             f"data: class target {int(y.max()) if y.numel() else 0} but the model gives "
             f"{n_classes} classes")


REAL_FORWARD_BYTES = 256 * 2**20  # a model whose meta forward fails runs for real up to this size


def _meta_outputs(recipe: Any, x: Any) -> Any:
    """``predict`` of the default model on the meta device (shapes only; nothing allocated).
    Meta cannot run every model (data-dependent operations), so when it fails a model of up to
    REAL_FORWARD_BYTES runs on the CPU instead — a recipe whose model does not fit its data is
    refused either way; None only for a bigger model meta cannot run (training checks it)."""
    import torch

    with torch.random.fork_rng(devices=[]):
        try:
            _started("model")
            with torch.device("meta"):
                model = recipe.model(recipe.default_config())
        except Exception:  # noqa: BLE001 - it cannot be built on meta: build it for real below
            model = None
        if model is not None:
            try:
                _started("predict")
                with torch.device("meta"):
                    out = recipe.predict(model, x[:ROWS].to("meta"))
                return out if isinstance(out, torch.Tensor) else None
            except Exception:  # noqa: BLE001 - the real forward below says what is wrong, if anything
                if sum(p.numel() * p.element_size() for p in model.parameters()) > REAL_FORWARD_BYTES:
                    return None
        model = _step("model", lambda: recipe.model(recipe.default_config()))
        out = _step("predict", lambda: recipe.predict(model, x[:ROWS]))
    return out if isinstance(out, torch.Tensor) else None


def check_contract(name: str, recipe: Any, consequence: str, data: bool = True,
                   model: Any = None) -> None:
    """:func:`contract` on a few training rows of ``recipe`` (of a distillation: of the
    ensemble's recipe): RecipeError in one line — "recipe NAME failed at STEP: what; consequence".

    Without ``data`` (serving a model, souping members: the training data may live only on
    the trainers), on zeros of the recipe's input shape and no targets instead. ``model``: the
    trained model whose outputs are checked (serving one), else the recipe's default one."""
    from tensorturn.recipes import BUILTIN

    # a student of the ``distill`` recipe is checked on its ensemble's recipe (named, not imported)
    distilled = f"{type(recipe).__module__}:{type(recipe).__name__}" == BUILTIN["distill"]
    target = recipe.base if distilled else recipe
    try:
        x, y = _step("data", lambda: target.sample_rows("train", ROWS)) if data else _no_data(target)
        contract(target, x, y, model if target is recipe else None)  # a student: its own kind
    except CheckFailed as exc:
        raise CheckFailed(f"recipe {name!r} failed at {exc}; {consequence}") from exc


def check_fresh(name: str, recipe: Any, consequence: str, vote: str | None = None) -> None:
    """:func:`fresh` as a run's start says it: RecipeError in one line — "recipe NAME failed at
    STEP: what (file:line); consequence"."""
    try:
        fresh(recipe, vote)
    except CheckFailed as exc:
        where = f" ({exc.where})" if exc.where else ""
        raise CheckFailed(f"recipe {name!r} failed at {exc}{where}; {consequence}", exc.where, exc.trace) from exc


def fresh(recipe: Any, vote: str | None = None) -> None:
    """What every other machine will do, on ``recipe`` built as they build it (from its options and
    the run's learned state: :func:`tensorturn.recipes.recipe_for`): :func:`contract`, then
    ``evaluate`` of the initial model on a few validation rows (and, with ``vote``, of an ensemble
    of it; a model over REAL_FORWARD_BYTES is left to the run). CheckFailed naming the step, with
    the recipe's file and line; an attribute only another hook sets is named with the fix."""
    import torch

    from tensorturn.recipes.vote import EnsembleModel

    step = "data"
    try:
        x, y = recipe.sample_rows("val", ROWS)
        contract(recipe, x, y)
        step = "model"
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            shaped = recipe.model(recipe.default_config())
        if sum(p.numel() * p.element_size() for p in shaped.parameters()) > REAL_FORWARD_BYTES:
            return
        with torch.random.fork_rng(devices=[]):
            model = recipe.model(recipe.default_config())
        step = "evaluate"
        _returns_metrics(step, recipe.evaluate(model, x, y))
        if vote is not None:
            step = "evaluate (an ensemble)"
            _returns_metrics(step, recipe.evaluate(EnsembleModel(recipe, [model, model], vote), x, y))
    except CheckFailed:
        raise
    except Exception as exc:  # noqa: BLE001 - the recipe's own failure, in one line
        from tensorturn.tracebacks import tail, user_site
        message = f"{step}: {type(exc).__name__}: {' '.join(str(exc).split())}"
        missing = getattr(exc, "name", None) if isinstance(exc, AttributeError) else None
        if missing and getattr(exc, "obj", None) is recipe:
            message += (f"; every machine, serve and an exported model build the recipe afresh, from "
                        f"its options and what raw_data set, and a hook other than raw_data sets "
                        f"self.{missing}: set it in __init__ or in raw_data (what raw_data sets is "
                        f"kept with the run)")
        raise CheckFailed(message, user_site(exc), tail(exc)) from exc


def _returns_metrics(step: str, metrics: Any) -> None:
    _require(isinstance(metrics, dict) and "loss" in metrics
             and all(isinstance(v, (int, float)) for v in metrics.values()),
             f"{step}: must return a dict of numbers with 'loss', got {_short(metrics)}")


def _no_data(recipe: Any) -> tuple[Any, Any]:
    """Two preprocessed rows of zeros of the recipe's raw input, and no targets."""
    import torch

    raw_dtype = torch.float32 if str(recipe.input_dtype).startswith("FP") else torch.int64
    shape = _step("input_shape", recipe.input_shape)
    x = _step("preprocess", lambda: recipe.preprocess(torch.zeros([2, *shape], dtype=raw_dtype)))
    return x, torch.empty(0, dtype=torch.float32 if recipe.kind.scaled else torch.int64)


def notes(recipe: Any, y_train: Any) -> list[str]:
    """What looks unintended but may not be: targets that look standardised with no
    ``unscale_targets`` to bring predictions back to the user's units."""
    if not recipe.kind.scaled or _overrides(recipe, "unscale_targets") or len(y_train) < 2:
        return []
    mean, std = float(y_train.float().mean()), float(y_train.float().std())
    if abs(mean) < 0.1 and 0.8 < std < 1.2:
        return [f"the targets have mean {mean:.2f} and std {std:.2f}: if raw_data standardised "
                f"them, define unscale_targets so served predictions and metrics are in your units"]
    return []


def check(name: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run every check; the summary of what was found, or CheckFailed naming the first problem."""
    import orjson
    import torch

    from tensorturn.recipes import load_splits, resolve
    from tensorturn.recipes.answer import Prediction, encode_answer
    from tensorturn.recipes.learned import restore, state_of
    from tensorturn.recipes.vote import EnsembleModel
    from tensorturn.train.loop import train_steps

    t0 = time.perf_counter()
    recipe = _step("build", lambda: resolve(name, options or {}))
    splits = _step("data", lambda: load_splits(recipe))
    sizes = {}
    for split in ("train", "val", "test"):
        x, y = getattr(splits, f"x_{split}"), getattr(splits, f"y_{split}")
        _require(len(x) > 0, f"data: the {split} split is empty")
        _require(len(x) == len(y), f"data: the {split} split has {len(x)} inputs but {len(y)} targets")
        sizes[split] = len(x)
    x = splits.x_train[:ROWS]
    contract(recipe, x, splits.y_train[:ROWS])
    kind = recipe.kind
    input_shape = _step("input_shape", recipe.input_shape)
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
    x_val, y_val = splits.x_val[:ROWS], splits.y_val[:ROWS]
    metrics = _step("evaluate", lambda: recipe.evaluate(model, x_val, y_val))
    _finite_metrics("evaluate", metrics)
    member = _step("member_config", lambda: recipe.member_config(1, random.Random(0)))
    other = _step("model (an ensemble member's config)", lambda: recipe.model({**config, **{
        k: v for k, v in member.items() if k != "lr_scale"}}))
    per_member = _step("predict", lambda: torch.stack([recipe.predict(m, x_val) for m in (model, other)]))
    _require(per_member.shape[1] == len(x_val),
             f"predict: {per_member.shape[1]} outputs for {len(x_val)} rows (rows must come first)")
    vote = "soft"
    combined = _step("combine", lambda: recipe.combine(per_member, vote))
    _require(combined.shape[0] == len(x_val), f"combine: {combined.shape[0]} outputs for {len(x_val)} rows")
    # an ensemble is measured by the recipe's evaluate too, as one model (see Recipe's docstring)
    ensemble = EnsembleModel(recipe, [model, other], vote)
    voted = _step("evaluate (an ensemble)", lambda: recipe.evaluate(ensemble, x_val, y_val))
    _finite_metrics("evaluate (an ensemble)", voted)
    _require(set(voted) == set(metrics), f"evaluate (an ensemble): metrics {sorted(voted)}, but "
                                         f"{sorted(metrics)} for one model")
    if kind.scaled:
        combined, per_member = _step("unscale_targets", lambda: (recipe.unscale_targets(combined), torch.stack(
            [recipe.unscale_targets(p) for p in per_member])))
    pred = Prediction(combined.float().numpy(), per_member.float().numpy())
    members = [{"member": 0}, {"member": 1}]
    answer = _step("serve", lambda: orjson.loads(encode_answer("check", "v", "id", pred, members, kind,
                                                               recipe.classes)))
    outputs = {o["name"]: o for o in answer["outputs"]}
    for o in outputs.values():
        _require(o["shape"][0] == len(x_val) and len(o["data"]) == math.prod(o["shape"]),
                 f"serve: output {o['name']} has shape {o['shape']} and {len(o['data'])} values")
    # every machine but the one that starts a run builds the recipe afresh, with what raw_data set
    state = _step("data", lambda: state_of(recipe))
    fresh(_step("build", lambda: restore(resolve(name, options or {}), state)), vote)
    return {
        "recipe": name, "task": recipe.task, "rows": sizes, "input_shape": list(input_shape),
        "parameters": params, "train_loss": trained, "val_metrics": metrics,
        "outputs": {n: {"datatype": o["datatype"], "shape": ["N", *o["shape"][1:]]}
                    for n, o in outputs.items() if not n.startswith("member_")},
        "notes": notes(recipe, splits.y_train),
        "seconds": round(time.perf_counter() - t0, 2),
    }


def _finite_metrics(step: str, metrics: Any) -> None:
    _require(isinstance(metrics, dict) and "loss" in metrics,
             f"{step}: must return a dict with 'loss', got {metrics!r}")
    _require(all(isinstance(v, float) and math.isfinite(v) for v in metrics.values()),
             f"{step}: values must be finite floats, got {metrics!r}")
